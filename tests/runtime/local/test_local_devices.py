"""Table tests of GPU assignment for local replicas (pure; no GPU needed)."""

from __future__ import annotations

import pytest

from pstrain_runtime.local.devices import DeviceRequest, assign_gpus, parse_visible, visible_gpus

PS0, PS1 = DeviceRequest("j-ps-0", "ps", 0), DeviceRequest("j-ps-1", "ps", 0)


def workers(n: int, gpus: int = 0) -> list[DeviceRequest]:
    return [DeviceRequest(f"j-worker-{i}", "worker", gpus) for i in range(n)]


@pytest.mark.parametrize(
    ("requests", "visible", "expected"),
    [
        pytest.param([PS0, *workers(2)], [], {}, id="no-gpu-sets-nothing"),
        pytest.param([PS0, *workers(2)], ["0"],
                     {"j-ps-0": "", "j-worker-0": "0", "j-worker-1": "0"},
                     id="one-gpu-shared-ps-hidden"),
        pytest.param([PS0, PS1, *workers(4, gpus=1)], ["0", "1"],
                     {"j-ps-0": "", "j-ps-1": "", "j-worker-0": "0", "j-worker-1": "1",
                      "j-worker-2": "0", "j-worker-3": "1"}, id="round-robin"),
        pytest.param([*workers(2, gpus=2), DeviceRequest("j-chief-0", "chief", 1)],
                     ["0", "1", "2"],
                     {"j-worker-0": "0,1", "j-worker-1": "2,0", "j-chief-0": "1"},
                     id="two-per-worker-wraps"),
        pytest.param(workers(1, gpus=4), ["3", "5"], {"j-worker-0": "3,5"},
                     id="request-capped-at-visible-no-duplicates"),
    ],
)
def test_assign_gpus(requests, visible, expected):
    assert assign_gpus(requests, visible) == expected


@pytest.mark.parametrize(("value", "expected"), [
    ("0,1", ["0", "1"]), (" 2 , 3 ", ["2", "3"]), ("", []), ("-1", []),
    ("GPU-abc,GPU-def", ["GPU-abc", "GPU-def"]),
])
def test_parse_visible(value, expected):
    assert parse_visible(value) == expected


def test_visible_gpus_prefers_the_environment():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "1,2"}) == ["1", "2"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
