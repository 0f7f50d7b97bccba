"""Item 5, the operator against kmock's Kubernetes emulator (no cluster needed).

The real operator process (`python -m pstrain_api.cli operator`, log level warning)
talks HTTP to an emulated API server in this process: the emulator and its client
come from the operator's own test fixtures (tests/operator/emulator.py), which carry
every emulator workaround. The benchmark plays the user and the kubelet:

- one job, 1 PS + 8 workers: create it, mark the PS pod Ready the moment it appears,
  time until all 9 pods exist; 1 warm-up job and `repeats` timed jobs in one operator.
- 50 such jobs created at once (back to back), each PS marked Ready as soon as it
  appears; time from the first creation until all 450 pods exist. Every repetition
  starts a fresh emulator and operator.
- the operator's peak RSS (VmHWM from /proc) at the end of each 50-job run.

Pods are followed through a watch stream (no polling); a pod "exists" when its ADDED
event reaches the benchmark.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .core import Config, Figure
from .procs import LOOPBACK, free_port

NAMESPACE = "pstrain-bench"
ROOT = Path(__file__).resolve().parent.parent


def _fixtures() -> Any:
    """The operator tests' emulator fixtures (imported from the repository)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.operator import emulator

    return emulator


def job_body(name: str, workers: int) -> dict[str, Any]:
    from pstrain_api.model import TrainingJob

    job = TrainingJob.model_validate({
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"replicas": {"ps": {"replicas": 1}, "worker": {"replicas": workers}},
                 "training": {"steps": 10}},
    })
    return job.to_api()


def _forget_finished_requests(emulator: Any) -> None:
    """Keep kmock's request history to the requests being handled (see Env)."""
    handle = emulator._handle

    async def forgetful_handle(request: Any) -> Any:
        try:
            return await handle(request)
        finally:
            try:
                emulator._requests.remove(request)
            except ValueError:
                pass  # already forgotten

    emulator._handle = forgetful_handle


def peak_rss_mb(pid: int) -> float:
    """VmHWM (peak resident set) of a process, in MB (10^6 bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM line")


class Operator:
    """`pstrain operator` as a child process of the benchmark."""

    def __init__(self, kubeconfig: Path, log_path: Path) -> None:
        self.health = free_port()
        env = {**os.environ, "KUBECONFIG": str(kubeconfig),
               "PSTRAIN_OPERATOR_NAMESPACES": NAMESPACE}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pstrain_api.cli", "operator", "--metrics-port", "0",
                 "--health-port", str(self.health), "--log-level", "warning"],
                env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the operator exited with {self.proc.returncode}: "
                                   f"{self.log_path.read_text(errors='replace')[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://{LOOPBACK}:{self.health}/healthz",
                                            timeout=2):
                    return
            except OSError:
                time.sleep(0.1)  # the operator is still starting; bounded by the deadline
        raise RuntimeError(f"the operator was not healthy within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


class Env:
    """A fresh emulator and operator.

    kmock 0.8 decides how to serve each request by scanning its whole request history
    (`request in payload._source` runs every payload's filter over every request ever
    received), so one request costs O(requests served before it) and a few hundred jobs
    make the emulator, not the operator, the bottleneck (measured before this fix: job
    k of a sequence of 1+8 jobs took about 0.5 s x k, 90% of it in kmock's
    Filter.__iter__). The benchmark makes the emulator remember only the requests in
    flight: each is forgotten when its handling ends. Nothing here reads the history.
    """

    def __init__(self, tmp: Path, tag: str) -> None:
        emu = _fixtures()
        self.emu = emu
        self.thread = emu.EmulatorThread(NAMESPACE)
        self.thread.start()
        self.thread.call(lambda: _forget_finished_requests(self.thread.emulator))
        self.api = emu.HttpApi(self.thread.url)
        self.op = Operator(self.thread.write_kubeconfig(tmp / f"kubeconfig-{tag}"),
                           tmp / f"operator-{tag}.log")
        try:
            self.op.wait_healthy()
        except RuntimeError:
            self.close()
            raise

    def ready_status(self) -> dict[str, Any]:
        return self.emu.pod_status("Running", ready=True)

    def close(self) -> None:
        self.op.stop()
        self.thread.stop()


class PodWatch:
    """Follows pod creations through a watch stream of the emulated API (no polling)
    and marks every PS pod Ready the moment it is seen, as a kubelet would once the
    server answers its readiness probe."""

    def __init__(self, env: Env) -> None:
        import threading

        self.env = env
        self.seen: dict[str, float] = {}
        self.marked: dict[str, float] = {}
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.error: BaseException | None = None
        import http.client
        from urllib.parse import urlsplit

        url = urlsplit(env.thread.url)
        self._conn = http.client.HTTPConnection(url.hostname, url.port, timeout=600)
        self._conn.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods?watch=true")
        self._resp = self._conn.getresponse()
        self.thread = threading.Thread(target=self._follow, name="pod-watch", daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        import json

        try:
            for line in self._resp:
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") != "ADDED":
                    continue
                name = event["object"]["metadata"]["name"]
                now = time.perf_counter()
                with self.lock:
                    self.seen.setdefault(name, now)
                    self.changed.notify_all()
                if "-ps-" in name and name not in self.marked:
                    self.env.api.set_pod_status(NAMESPACE, name, self.env.ready_status())
                    with self.lock:
                        self.marked[name] = time.perf_counter()
                        self.changed.notify_all()
        except (OSError, ValueError) as exc:  # the stream closes when the emulator stops
            with self.lock:
                self.error = exc
                self.changed.notify_all()

    def wait_all(self, names: list[str], per_job: int, timeout_s: float) -> None:
        prefix = tuple(f"{n}-" for n in names)
        want = per_job * len(names)
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while sum(1 for p in self.seen if p.startswith(prefix)) < want:
                if self.error is not None:
                    raise RuntimeError(f"the pod watch ended: {self.error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    got = sum(1 for p in self.seen if p.startswith(prefix))
                    raise RuntimeError(f"only {got} of {want} pods existed after "
                                       f"{timeout_s:.0f} s")
                self.changed.wait(timeout=min(left, 1.0))

    def close(self) -> None:
        """End the stream from this side: shutting the socket down wakes the reader
        (closing the response object would block on the reader's buffer lock)."""
        import socket

        if self._conn.sock is not None:
            try:
                self._conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the server
        self.thread.join(timeout=10)
        self._conn.close()


def _drive(env: Env, watch: PodWatch, names: list[str], workers: int,
           timeout_s: float) -> tuple[float, float]:
    """Create the jobs `names` (PS pods get marked Ready by `watch` as they appear) and
    wait until every pod of every job exists. Returns (seconds from the first
    creation, seconds from the last PS Ready mark) until the last pod appeared."""
    per_job = 1 + workers
    prefix = tuple(f"{n}-" for n in names)
    t_start = time.perf_counter()
    if len(names) == 1:
        env.api.create_job(job_body(names[0], workers))
    else:
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda n: env.api.create_job(job_body(n, workers)), names))
    watch.wait_all(names, per_job, timeout_s)
    with watch.lock:
        t_end = max(t for p, t in watch.seen.items() if p.startswith(prefix))
        t_mark = max(t for p, t in watch.marked.items() if p.startswith(prefix))
    return t_end - t_start, t_end - t_mark


def run(cfg: Config) -> list[Figure]:
    workers = cfg.operator_workers
    figs: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="pstrain-bench-op-") as tmpdir:
        tmp = Path(tmpdir)
        env = Env(tmp, "one")
        watch = PodWatch(env)
        try:
            total, after_ready = [], []
            for i in range(cfg.warmup + cfg.repeats):
                t, r = _drive(env, watch, [f"one-{i}"], workers, timeout_s=60)
                if i >= cfg.warmup:
                    total.append(t)
                    after_ready.append(r)
            rss_one = peak_rss_mb(env.op.proc.pid)
        finally:
            watch.close()
            env.close()
        figs.append(Figure.of("operator.one_job.pods_after_ps_ready",
                              f"1 PS + {workers} workers: PS Ready -> all pods exist", "s",
                              after_ready, note="pod creation seen through a watch"))
        figs.append(Figure.of("operator.one_job.created_to_all_pods",
                              f"1 PS + {workers} workers: job created -> all pods exist "
                              "(PS marked Ready at once)", "s", total))
        many, rss, many_after = [], [], []
        n_jobs = cfg.operator_jobs
        for i in range(cfg.warmup + cfg.repeats):
            env = Env(tmp, f"many-{i}")
            watch = PodWatch(env)
            try:
                t, r = _drive(env, watch, [f"m{i}-{k}" for k in range(n_jobs)], workers,
                              timeout_s=120)
                peak = peak_rss_mb(env.op.proc.pid)
            finally:
                watch.close()
                env.close()
            if i >= cfg.warmup:
                many.append(t)
                many_after.append(r)
                rss.append(peak)
        figs.append(Figure.of("operator.many_jobs.all_pods",
                              f"{n_jobs} jobs of 1 PS + {workers} workers created at once: "
                              f"first creation -> all {n_jobs * (1 + workers)} pods exist",
                              "s", many, note="fresh emulator and operator per run"))
        figs.append(Figure.of("operator.many_jobs.after_last_ps_ready",
                              f"{n_jobs} jobs: last PS Ready mark -> all pods exist", "s",
                              many_after))
        figs.append(Figure.of("operator.peak_rss",
                              f"operator peak RSS (VmHWM) after {n_jobs} jobs", "MB", rss,
                              note=f"after {cfg.warmup + cfg.repeats} single jobs: "
                              f"{rss_one:.0f} MB"))
    return figs
