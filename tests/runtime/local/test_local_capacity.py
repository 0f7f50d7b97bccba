"""The warning before a local run starts more replicas than this machine's memory holds."""

from __future__ import annotations

import pytest

from pstrain_runtime.local.capacity import GIB, available_memory, capacity_warning


@pytest.mark.parametrize(
    ("processes", "available", "expected"),
    [
        pytest.param(3, 8 * GIB, None, id="digits-fits"),
        pytest.param(32, 8 * GIB, None, id="32-fit-in-8-gib"),
        pytest.param(40, 8 * GIB,
                     "this job starts 40 processes of about 250 MB each (9.8 GiB) and this "
                     "machine has 8.0 GiB available: expect swapping or replicas killed for "
                     "memory; run fewer replicas here, or run the job on Kubernetes",
                     id="40-do-not"),
        pytest.param(4001, None, None, id="unknown-memory-no-guess"),
    ],
)
def test_capacity_warning(processes, available, expected):
    assert capacity_warning(processes, available) == expected


def test_available_memory_reads_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\n"
                       "MemAvailable:    8388608 kB\n")
    assert available_memory(meminfo) == 8 * GIB
