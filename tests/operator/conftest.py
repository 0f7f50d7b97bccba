"""Fixtures: the emulated API server and the real operator process against it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from pstrain_runtime.local.processes import find_free_ports

from .emulator import EmulatorThread, wait_for

NAMESPACE = "pstrain-test"


@pytest.fixture()
def emulator() -> Iterator[EmulatorThread]:
    emu = EmulatorThread(NAMESPACE)
    emu.start()
    try:
        yield emu
    finally:
        emu.stop()


class OperatorProcess:
    """`pstrain operator` as a subprocess; start/stop as often as a test needs."""

    def __init__(self, kubeconfig: Path, log_dir: Path, extra_env: dict[str, str] | None = None):
        self.kubeconfig = kubeconfig
        self.log_dir = log_dir
        self.extra_env = extra_env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0
        self.metrics_port = 0

    def command(self) -> list[str]:
        exe = shutil.which("pstrain")
        return [exe] if exe else [sys.executable, "-m", "pstrain_api.cli"]

    def start(self) -> None:
        self.runs += 1
        self.metrics_port, health = find_free_ports(2)
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig),
               "PSTRAIN_OPERATOR_NAMESPACES": NAMESPACE, **self.extra_env}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        log = open(self.log_dir / f"operator-{self.runs}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*self.command(), "operator", "--metrics-port", str(self.metrics_port),
             "--health-port", str(health), "--log-level", "debug"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()

        def healthy() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"the operator exited with {self.proc.returncode}:\n"
                                     + self.log_tail())
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=2):
                    return True
            except OSError:
                return False

        wait_for("the operator's /healthz", healthy, timeout=60, interval=0.2)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=5) as resp:
            return resp.read().decode()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def log_tail(self, lines: int = 60) -> str:
        path = self.log_dir / f"operator-{self.runs}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@pytest.fixture()
def operator_process(emulator: EmulatorThread, tmp_path: Path) -> Iterator[OperatorProcess]:
    op = OperatorProcess(emulator.write_kubeconfig(tmp_path / "kubeconfig"), tmp_path)
    try:
        yield op
    finally:
        op.stop()
