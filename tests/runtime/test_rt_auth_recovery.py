"""The chief recovering a replaced parameter server that refuses this job's credentials
for a while: until the server's name leads to its new pod, a call may reach whatever
answers at the old address, which refuses the keys. The chief waits that out within
the bound it gives an unreachable server (`connect_timeout`), and fails with one line
that says so when the refusals outlast it (a real mismatch of keys). In one process,
no sockets; the bounds are small, so each test takes a second or two."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pstrain_runtime.ps.store import PSError
from pstrain_runtime.worker.client import retry_recovering, retry_unavailable
from pstrain_runtime.worker.context import WorkerRole
from pstrain_runtime.worker.trainer import Trainer

from .builders import Events, KillableTransport, digits_training

pytestmark = pytest.mark.timeout(60)

REFUSAL = "ps-0:2222: the call's credentials are not valid for this job"


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


class ReplacedServer(KillableTransport):
    """Parameter server 0, replaced (empty) when `replace` is called: its next call
    finds it unreachable, the `refusals` after that are refused as another job's server
    refuses this job's keys (None: every one, for good), then it answers."""

    def __init__(self) -> None:
        super().__init__(0)
        self.unreachable = 0
        self.refusals: int | None = 0
        self.refused = 0
        self.replaced = False

    def replace(self, refusals: int | None) -> None:
        self.replaced = True
        self.kill()
        self.restart()
        self.unreachable, self.refusals = 1, refusals

    def _check(self) -> None:
        super()._check()
        if self.unreachable:
            self.unreachable -= 1
            raise PSError("UNAVAILABLE", "ps-0:2222: failed to connect")
        if self.refusals is None or self.refusals > 0:
            self.refusals = None if self.refusals is None else self.refusals - 1
            self.refused += 1
            raise PSError("UNAUTHENTICATED", REFUSAL)


def replaced_at(server: ReplacedServer, step: int,
                refusals: int | None) -> Callable[[str, dict[str, Any]], None]:
    """An event hook that replaces `server` once the chief reports `step`."""
    def hook(kind: str, fields: dict[str, Any]) -> None:
        if kind == "progress" and fields["step"] >= step and not server.replaced:
            server.replace(refusals)
    return hook


def chief(tmp_path: Path, server: ReplacedServer, events: Events,
          connect_timeout: float) -> Trainer:
    training = digits_training(steps=80, checkpoint={"directory": str(tmp_path),
                                                     "intervalSteps": 20})
    return Trainer(training, WorkerRole("ns", 0, 1), [server], emit=events,
                   progress_interval=0.0, connect_timeout=connect_timeout)


def test_the_chief_waits_out_a_replaced_server_refusing_its_keys(tmp_path: Path) -> None:
    server, events = ReplacedServer(), Events()
    events.hooks.append(replaced_at(server, 30, refusals=4))
    trainer = chief(tmp_path, server, events, connect_timeout=30.0)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    assert server.refused == 4
    (restored,) = events.of("restored")
    assert restored["servers"] == [0] and restored["step"] >= 20, restored
    assert result.global_step == 80


def test_a_server_that_refuses_the_keys_for_good_fails_the_chief_within_the_bound(
        tmp_path: Path) -> None:
    server, events = ReplacedServer(), Events()
    events.hooks.append(replaced_at(server, 30, refusals=None))
    trainer = chief(tmp_path, server, events, connect_timeout=1.0)
    started = time.monotonic()
    try:
        with pytest.raises(PSError) as caught:
            trainer.run()
    finally:
        trainer.close()
    assert time.monotonic() - started < 15  # 1 s per retried call, and training
    assert caught.value.code == "UNAUTHENTICATED"
    message = caught.value.message
    assert message.startswith(REFUSAL) and "\n" not in message, message
    assert "still refused after 1 s while recovering the parameter servers" in message
    assert server.refused > 1 and not events.of("restored")


def fails(code: str, times: int) -> Callable[[], str]:
    """A call that fails with `code` `times` times, then answers "ok"."""
    left = [times]

    def call() -> str:
        if left[0]:
            left[0] -= 1
            raise PSError(code, REFUSAL)
        return "ok"
    return call


@pytest.mark.parametrize("code", ["UNAUTHENTICATED", "PERMISSION_DENIED"])
def test_a_refusal_is_retried_only_while_recovering_and_within_the_bound(code: str) -> None:
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    with pytest.raises(PSError) as caught:
        retry_unavailable(fails(code, 1), 10.0, clock=lambda: now[0], sleep=sleep)
    assert caught.value.message == REFUSAL  # not recovering: fatal at once, unchanged
    assert retry_recovering(fails(code, 5), 10.0, clock=lambda: now[0],
                            sleep=sleep) == "ok"
    started = now[0]
    with pytest.raises(PSError) as caught:
        retry_recovering(fails(code, 10**6), 10.0, clock=lambda: now[0], sleep=sleep)
    assert 10.0 <= now[0] - started <= 12.0
    assert caught.value.code == code
    assert caught.value.message.startswith(REFUSAL + " (still refused after 10 s")
    with pytest.raises(PSError) as caught:  # any other refusal: as before
        retry_recovering(fails("INVALID_ARGUMENT", 1), 10.0, clock=lambda: now[0],
                         sleep=sleep)
    assert caught.value.message == REFUSAL
