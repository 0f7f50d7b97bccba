"""Process I/O of a local run: free ports, spawning replicas, reading their output,
probing parameter-server readiness, signalling process groups.

Everything that happens reaches the supervisor as an observation on one queue:
`Line` (a line of replica output), `Healthy`, `Exited`. Threads only read and post;
every decision is taken on the thread that runs the loop.

Orphans: each replica runs in its own session (its own process group, so a terminal
Ctrl-C reaches only the runner, which stops the replicas in order), and on Linux it is
started through a tiny exec shim that sets PR_SET_PDEATHSIG, so a replica is killed
when the runner dies, even by SIGKILL. The shim execs the real command, so the pid the
runner holds is the replica's own.
"""

from __future__ import annotations

import collections
import errno
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from pstrain_api.constants import ENV_TERMINATION_LOG

from pstrain_api import constants as c

from ..health import wait_serving
from .supervisor import Exited, Healthy, normalize_exit_code

DEFAULT_REPLICA_COMMAND: tuple[str, ...] = (sys.executable, "-m", "pstrain_api.cli",
                                            "replica")
LOG_TAIL_LINES = 20
EXIT_DRAIN_SECONDS = 2.0
MAX_LINE_BYTES = 64 * 1024  # longer lines arrive in pieces

# Runs as `python -c SHIM PARENT_PID CMD...`: die with the parent, then become CMD.
PDEATHSIG_SHIM = """\
import ctypes, os, signal, sys
PR_SET_PDEATHSIG = 1
ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    sys.exit(137)  # the runner died before the prctl took effect
os.execvp(sys.argv[2], sys.argv[2:])
"""


@dataclass(frozen=True)
class Line:
    """One line of output from start `attempt` of replica `name`."""

    name: str
    attempt: int
    text: str


def find_free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free on `host` a moment ago.

    All sockets are held open together so the kernel hands out distinct ports; they are
    closed before the replicas bind them (a small race every local launcher accepts).
    """
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
    return ports


def wrap_command(command: Sequence[str], parent_pid: int | None = None) -> list[str]:
    """`command` behind the PR_SET_PDEATHSIG shim where Linux offers it."""
    if not sys.platform.startswith("linux"):
        return list(command)
    pid = os.getpid() if parent_pid is None else parent_pid
    return [sys.executable, "-c", PDEATHSIG_SHIM, str(pid), *command]


def replica_environment(base: Mapping[str, str], cluster_env: Mapping[str, str],
                        threads: int) -> dict[str, str]:
    """The replica's environment: the runner's, the cluster spec's, unbuffered Python
    output (so lines arrive as they are printed) and a thread budget unless set."""
    env = dict(base)
    env.update(cluster_env)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("MKL_NUM_THREADS", str(threads))
    return env


class ReplicaProcess:
    """One running replica process, its output reader and (for a PS) health prober."""

    def __init__(self, name: str, attempt: int, popen: subprocess.Popen[bytes],
                 post: Callable[[object], None], now: Callable[[], float],
                 tail: collections.deque[str], termination_log: Path | None = None):
        self.name = name
        self.termination_log = termination_log
        self.attempt = attempt
        self.popen = popen
        self.stop = threading.Event()
        self._post = post
        self._now = now
        self._tail = tail
        self.reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self.waiter = threading.Thread(target=self._wait, name=f"wait-{name}", daemon=True)
        self.reader.start()
        self.waiter.start()
        self.prober: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self) -> None:
        stream = self.popen.stdout
        if stream is None:
            return
        for raw in iter(lambda: stream.readline(MAX_LINE_BYTES), b""):
            text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            self._tail.append(text)
            self._post(Line(self.name, self.attempt, text))
        stream.close()

    def _wait(self) -> None:
        code = self.popen.wait()
        self.stop.set()
        # Let the reader pass on the last lines first; a grandchild that inherited the
        # pipe may keep it open, so do not wait for end-of-file forever.
        self.reader.join(timeout=EXIT_DRAIN_SECONDS)
        self._post(Exited(self.name, self.attempt, normalize_exit_code(code), self._now(),
                          self._termination_message()))

    def _termination_message(self) -> str:
        if self.termination_log is None:
            return ""
        try:
            return self.termination_log.read_text(encoding="utf-8", errors="replace").strip()
        except OSError:
            return ""

    def probe_health(self, address: str, interval: float = 0.1,
                     check: str = c.GATE_GRPC) -> None:
        """Post `Healthy` once the replica at `address` passes `check`: the gRPC health
        service answers SERVING (GRPCHealth), or the port accepts a connection (TCP)."""
        wait = wait_serving if check == c.GATE_GRPC else wait_listening
        self.prober = threading.Thread(target=self._probe, args=(wait, address, interval),
                                       name=f"health-{self.name}", daemon=True)
        self.prober.start()

    def _probe(self, wait: Callable[[str, threading.Event, float], bool], address: str,
               interval: float) -> None:
        if wait(address, self.stop, interval):
            self._post(Healthy(self.name, self.attempt, self._now()))

    def signal(self, signum: int, leftovers: bool = False) -> None:
        """Signal the replica's whole process group while the replica is alive; with
        `leftovers`, also after it exited, for children it left behind in its group."""
        if self.popen.poll() is not None and not leftovers:
            return
        try:
            os.killpg(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone


def wait_listening(address: str, stop: threading.Event, interval: float = 0.1) -> bool:
    """Try a TCP connection to `address` until one is accepted (True) or `stop` is set:
    the readiness of a program that only serves on its port (`tf.distribute.Server`)."""
    host, _, port = address.rpartition(":")
    while not stop.is_set():
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return True
        except OSError:
            stop.wait(interval)
    return False


class ProcessTable:
    """The replicas' processes, keyed by replica name, and the observation queue.

    Every replica runs `command` unless `commands` names its own (a role whose template
    sets a command)."""

    def __init__(self, command: Sequence[str], environments: Mapping[str, Mapping[str, str]],
                 now: Callable[[], float], cwd: str | None = None,
                 commands: Mapping[str, Sequence[str]] | None = None):
        self.command = list(command)
        self.commands = {name: list(cmd) for name, cmd in (commands or {}).items()}
        self.environments = environments
        self.now = now
        self.cwd = cwd
        self.observations: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.procs: dict[str, ReplicaProcess] = {}  # the latest attempt of each replica
        self.history: list[ReplicaProcess] = []  # every attempt, for the final clean-up
        self.tails: dict[str, collections.deque[str]] = collections.defaultdict(
            lambda: collections.deque(maxlen=LOG_TAIL_LINES))

    def post(self, item: object) -> None:
        """Thread- and signal-handler-safe (SimpleQueue.put is reentrant)."""
        self.observations.put(item)

    def start(self, name: str, attempt: int) -> ReplicaProcess:
        """Spawn replica `name`; raises OSError when the command cannot be started."""
        command = self.command_of(name)
        if shutil.which(command[0], path=self.environments[name].get("PATH")) is None:
            raise FileNotFoundError(
                errno.ENOENT, "not an executable file or a program on PATH")
        log_name = self.environments[name].get(ENV_TERMINATION_LOG)
        log = Path(log_name) if log_name else None
        if log is not None:
            log.unlink(missing_ok=True)  # what an earlier attempt left explains that one
        popen = subprocess.Popen(
            wrap_command(command),
            env=dict(self.environments[name]),
            cwd=self.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        tail = self.tails[name]
        tail.clear()  # the tail explains the latest attempt
        proc = ReplicaProcess(name, attempt, popen, self.post, self.now, tail, log)
        self.procs[name] = proc
        self.history.append(proc)
        return proc

    def command_of(self, name: str) -> list[str]:
        return self.commands.get(name, self.command)

    def signal(self, names: Sequence[str], signum: int) -> None:
        for name in names:
            proc = self.procs.get(name)
            if proc is not None:
                proc.signal(signum)

    def tail(self, name: str, lines: int = 10) -> list[str]:
        return list(self.tails[name])[-lines:]

    def kill_all(self, wait: float = 5.0) -> None:
        """Last-resort clean-up: SIGKILL every replica process group (including what an
        exited replica left behind in its group) and reap the replicas."""
        for proc in self.history:
            proc.stop.set()
            proc.signal(signal.SIGKILL, leftovers=True)
        for proc in self.history:
            try:
                proc.popen.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
            proc.waiter.join(timeout=1.0)
