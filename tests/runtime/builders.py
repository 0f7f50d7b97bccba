"""Builders and fakes for the runtime tests.

- `training(...)`: a `Training` from camelCase keyword fields.
- `KillableTransport`: a `LocalTransport` whose server can be "killed" (calls fail with
  UNAVAILABLE) and "restarted" empty, like a parameter-server process restarted by the
  runner at the same address.
- `run_chief`: a one-worker job's chief, run with a bound.
- `ProcessJob`: a whole job as real `pstrain replica` processes on loopback ports,
  whose replicas can be killed and restarted.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pstrain_api.cluster import Task, local_cluster_spec
from pstrain_api.events import parse_event
from pstrain_api.model import Training, TrainingJob
from pstrain_runtime.local.processes import find_free_ports
from pstrain_runtime.proto import ps_pb2 as pb
from pstrain_runtime.ps.store import ParameterStore, PSError
from pstrain_runtime.worker.client import LocalTransport


def training(**fields: Any) -> Training:
    return Training.model_validate(fields)


def digits_training(**fields: Any) -> Training:
    base: dict[str, Any] = {
        "steps": 200, "batchSize": 64, "mode": "async",
        "optimizer": {"name": "momentum", "learningRate": 0.05, "momentum": 0.9},
    }
    base.update(fields)
    return training(**base)


class KillableTransport(LocalTransport):
    def __init__(self, ps_index: int = 0) -> None:
        super().__init__(ParameterStore(ps_index))
        self.ps_index = ps_index
        self.down = threading.Event()

    def kill(self) -> None:
        self.down.set()
        self.store.stop()

    def restart(self) -> None:
        self.store = ParameterStore(self.ps_index)
        self.down.clear()

    def _check(self) -> None:
        if self.down.is_set():
            raise PSError("UNAVAILABLE", f"ps {self.ps_index} is down")

    def push(self, frames: Iterator[bytes]) -> pb.PushReply:
        self._check()
        return super().push(frames)

    def push_pull(self, frames: Iterator[bytes]) -> Iterator[bytes]:
        self._check()
        return super().push_pull(frames)

    def push_pull_small(self, message: bytes) -> bytes:
        self._check()
        return super().push_pull_small(message)

    def init(self, frames: Iterator[bytes]) -> pb.StepInfo:
        self._check()
        return super().init(frames)

    def pull(self, request: pb.PullRequest) -> Iterator[bytes]:
        self._check()
        return super().pull(request)

    def info(self, namespace: str, worker: int = 0) -> pb.StepInfo:
        self._check()
        return super().info(namespace, worker)

    def finish(self, namespace: str) -> pb.StepInfo:
        self._check()
        return super().finish(namespace)

    def sparse(self, frames: list[bytes]) -> list[bytes]:
        self._check()
        return super().sparse(frames)


REPLICA_CMD = [sys.executable, "-c",
               "import sys; from pstrain_api.cli import main; sys.exit(main(['replica']))"]


class Replica:
    def __init__(self, name: str, env: dict[str, str]) -> None:
        self.name = name
        self.env = env
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.lines: list[str] = []
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(REPLICA_CMD, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line.rstrip())
            event = parse_event(line)
            if event is not None:
                self.events.put(dict(event))

    def wait_event(self, predicate: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no matching event; output:\n" +
                                   "\n".join(self.lines[-30:]))
            try:
                event = self.events.get(timeout=min(left, 1.0))
            except queue.Empty:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode} "
                                       "before the event; output:\n" +
                                       "\n".join(self.lines[-30:])) from None
                continue
            if predicate(event):
                return event

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=30)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)


class ProcessJob:
    """A job's replicas as processes; PS first, then workers, chief last."""

    def __init__(self, manifest: dict[str, Any], checkpoint_dir: Path | None = None) -> None:
        if checkpoint_dir is not None:
            manifest["spec"]["training"].setdefault("checkpoint", {})["directory"] = str(
                checkpoint_dir)
        self.job = TrainingJob.model_validate(manifest)
        spec = local_cluster_spec(self.job, find_free_ports(8))
        self.spec = spec
        self.replicas: dict[Task, Replica] = {}
        base = {k: v for k, v in os.environ.items() if not k.startswith("PSTRAIN_")}
        base["PYTHONUNBUFFERED"] = "1"
        base.setdefault("OMP_NUM_THREADS", "1")
        for task in spec.tasks():
            self.replicas[task] = Replica(spec.replica_name(task), {**base, **spec.env(task)})

    @property
    def chief(self) -> Replica:
        return self.replicas[self.spec.chief]

    def ps(self, index: int) -> Replica:
        return self.replicas[Task("ps", index)]

    def worker(self, index: int) -> Replica:
        return self.replicas[Task("worker", index)]

    def start(self) -> None:
        for task in self.spec.tasks():
            self.replicas[task].start()

    def stop_all(self) -> None:
        for rep in self.replicas.values():
            if rep.proc is not None and rep.proc.poll() is None:
                rep.proc.kill()
                rep.proc.wait(timeout=30)

    def kill_ps_after_checkpoint(self, index: int, step: int) -> dict[str, Any]:
        """Start the job, kill parameter server `index` once a checkpoint at `step` or
        later is written, restart it at the same address, and wait for the job to end.
        Returns the checkpoint, restored and done events and every replica's exit code;
        stops every replica in any case."""
        try:
            self.start()
            ckpt = self.chief.wait_event(
                lambda e: e["event"] == "checkpoint" and e["step"] >= step, timeout=150)
            self.ps(index).kill()
            self.ps(index).start()
            restored = self.chief.wait_event(lambda e: e["event"] == "restored", timeout=120)
            done = self.chief.wait_event(lambda e: e["event"] == "done", timeout=180)
            codes = self.wait_all(timeout=60)
        finally:
            self.stop_all()
        return {"checkpoint": ckpt, "restored": restored, "done": done, "codes": codes}

    def wait_all(self, timeout: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for rep in self.replicas.values():
            try:
                codes[rep.name] = rep.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as exc:
                raise TimeoutError(f"{rep.name} did not exit; output:\n" +
                                   "\n".join(rep.lines[-30:])) from exc
        return codes


class Events:
    """Records emitted events; hooks see each one as it comes."""

    def __init__(self) -> None:
        self.items: list[tuple[str, dict[str, Any]]] = []
        self.hooks: list[Any] = []

    def __call__(self, kind: str, **fields: Any) -> None:
        self.items.append((kind, fields))
        for hook in self.hooks:
            hook(kind, fields)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [f for k, f in self.items if k == kind]


def run_trainers(trainers: list[Any], transports: list[Any], bound: float = 90.0) -> None:
    """Run `trainers` (the chief first in the list), one thread each, started from the
    last; re-raise the first failure. A job still running after `bound` seconds (one
    bound for the whole job, inside the test timeout) fails the test after its servers
    are stopped, so no call stays blocked in them (a client pool's thread blocked there
    would keep the interpreter from exiting)."""
    errors: list[BaseException] = []

    def go(trainer: Any) -> None:
        try:
            trainer.run()
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(t,), daemon=True) for t in reversed(trainers)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + bound
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        for transport in transports:
            store = getattr(transport, "store", None)
            if store is not None:
                store.stop()
        for trainer in trainers:
            trainer.close()
        raise AssertionError(f"a trainer did not finish within {bound:.0f} s")
    if errors:
        raise errors[0]


def model_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_chief(chief: Any, limit: float = 45.0) -> None:
    """Run a one-worker job's chief (a `Trainer`) with a bound; close it; re-raise what
    it raised."""
    errors: list[BaseException] = []

    def go() -> None:
        try:
            chief.run()
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(limit)
    chief.close()
    assert not thread.is_alive(), f"the chief did not finish within {limit:g} s"
    if errors:
        raise errors[0]
