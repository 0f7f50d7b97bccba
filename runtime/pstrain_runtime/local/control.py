"""The control channel of a running `pstrain run`, and `pstrain scale`.

A running job listens on a Unix socket named after the job, in a directory only its
user can enter: `$PSTRAIN_RUN_DIR`, else `$XDG_RUNTIME_DIR/pstrain`, else
`/tmp/pstrain-<uid>`. `pstrain scale JOB --replicas N` connects, sends one JSON line
(`{"scale": N}`) and prints the one-line answer (and its one-line warning, if any:
more workers than this machine's cores). The runner turns a request into an
observation (`supervisor.ScaleRequest`) and answers with what the supervisor decided:
the same rules as `kubectl scale` on a cluster (`pstrain_api.membership`).

Nothing here imports torch: `pstrain scale` starts fast.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import queue
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ENV_RUN_DIR = "PSTRAIN_RUN_DIR"
MAX_REQUEST_BYTES = 4096
IO_TIMEOUT_S = 5.0  # a client that sends nothing is dropped after this
ANSWER_TIMEOUT_S = 30.0  # the runner answers within this, or the client is told so
_MAX_SOCKET_PATH = 100  # sun_path is 108 bytes on Linux


def run_dir() -> Path:
    explicit = os.environ.get(ENV_RUN_DIR)
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "pstrain"
    return Path(tempfile.gettempdir()) / f"pstrain-{os.getuid()}"


def socket_path(job_name: str, directory: Path | None = None) -> Path:
    """The control socket of job `job_name` (a Kubernetes name: safe in a file name) in
    `directory` (default: `run_dir()`); a hash of the name, then the system's temporary
    directory, where the path would be too long for a Unix socket."""
    digest = hashlib.sha256(job_name.encode()).hexdigest()[:16]
    directory = run_dir() if directory is None else directory
    for path in (directory / f"{job_name}.sock", directory / f"{digest}.sock",
                 Path(tempfile.gettempdir()) / f"pstrain-{os.getuid()}" / f"{digest}.sock"):
        if len(os.fsencode(str(path))) <= _MAX_SOCKET_PATH:
            return path
    return Path("/tmp") / f"pstrain-{os.getuid()}" / f"{digest}.sock"


@dataclass(frozen=True)
class Answer:
    ok: bool
    message: str
    warning: str = ""


Ask = Callable[[int], Answer]  # replicas -> the runner's answer


class ControlServer:
    """Serves one job's control socket in a thread. `ask(replicas)` is called on that
    thread and must return the runner's answer (bounded: the runner answers within
    ANSWER_TIMEOUT_S)."""

    def __init__(self, job_name: str, ask: Ask) -> None:
        self.path = socket_path(job_name)
        self._ask = ask
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> str | None:
        """Listen; None when listening, else why not (the run goes on without it)."""
        directory = self.path.parent
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if directory.stat().st_uid != os.getuid():
                return f"{directory} belongs to another user"
            if _answers(self.path):
                return (f"another `pstrain run` of this job is listening on {self.path}; "
                        "`pstrain scale` reaches that one")
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()  # left by a run that was killed
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(self.path))
            os.chmod(self.path, 0o600)
            sock.listen(8)
        except OSError as exc:
            return f"cannot listen on {self.path}: {exc.strerror or exc}"
        sock.settimeout(0.5)  # so close() ends the accept loop promptly
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="control", daemon=True)
        self._thread.start()
        return None

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is None:
            return
        sock.close()
        if self._thread is not None:
            self._thread.join(2)
        with contextlib.suppress(OSError):
            self.path.unlink()

    def _serve(self) -> None:
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(IO_TIMEOUT_S)
                try:
                    answer = self._answer(_read_line(conn))
                    reply = {"ok": answer.ok, "message": answer.message}
                    if answer.warning:
                        reply["warning"] = answer.warning
                    conn.sendall((json.dumps(reply) + "\n").encode())
                except OSError:
                    continue  # the client went away

    def _answer(self, raw: bytes) -> Answer:
        try:
            request = json.loads(raw)
        except ValueError:
            return Answer(False, "the request is not JSON")
        replicas = request.get("scale") if isinstance(request, dict) else None
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            return Answer(False, 'the request must be {"scale": <whole number>}')
        return self._ask(replicas)


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while b"\n" not in data and len(data) <= MAX_REQUEST_BYTES:
        chunk = conn.recv(MAX_REQUEST_BYTES)
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0][:MAX_REQUEST_BYTES]


def _answers(path: Path) -> bool:
    """A live runner is listening on `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def request_scale(job_name: str, replicas: int,
                  timeout: float = ANSWER_TIMEOUT_S + IO_TIMEOUT_S,
                  directory: Path | None = None) -> Answer:
    """Ask the `pstrain run` of `job_name` on this machine for `replicas` workers; the
    run's control socket is in `directory` (default: `run_dir()`, as the run chose it)."""
    path = socket_path(job_name, directory)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return Answer(False, f"no `pstrain run` of job {job_name!r} is running on this "
                                 f"machine (nothing listens on {path})")
        except OSError as exc:
            return Answer(False, f"cannot reach {path}: {exc.strerror or exc}")
        try:
            sock.sendall((json.dumps({"scale": replicas}) + "\n").encode())
            reply = json.loads(_read_line(sock) or b"null")
        except TimeoutError:
            return Answer(False, f"the run of job {job_name!r} did not answer within "
                                 f"{timeout:g}s")
        except (OSError, ValueError) as exc:
            return Answer(False, f"the run of job {job_name!r} gave no usable answer: {exc}")
    if not isinstance(reply, dict) or not isinstance(reply.get("message"), str):
        return Answer(False, f"the run of job {job_name!r} gave no usable answer")
    warning = reply.get("warning")
    return Answer(bool(reply.get("ok")), reply["message"],
                  warning if isinstance(warning, str) else "")


class Inbox:
    """Hands one request from the control thread to the runner's loop and its answer
    back: `ask` posts an observation made by `make` and waits (bounded) for `answer`."""

    def __init__(self, post: Callable[[object], None]) -> None:
        self._post = post
        self._lock = threading.Lock()
        self._answers: dict[int, queue.Queue[Answer]] = {}
        self._next = 0

    def ask(self, make: Callable[[int], object]) -> Answer:
        with self._lock:
            self._next += 1
            ticket = self._next
            box: queue.Queue[Answer] = queue.Queue(maxsize=1)
            self._answers[ticket] = box
        self._post(make(ticket))
        try:
            return box.get(timeout=ANSWER_TIMEOUT_S)
        except queue.Empty:
            return Answer(False, f"the runner did not decide within {ANSWER_TIMEOUT_S:g}s")
        finally:
            with self._lock:
                self._answers.pop(ticket, None)

    def answer(self, ticket: int, answer: Answer) -> None:
        with self._lock:
            box = self._answers.get(ticket)
        if box is not None:
            with contextlib.suppress(queue.Full):
                box.put_nowait(answer)


# --------------------------------------------------------------------------- the CLI


def _job_name(target: str) -> str:
    """JOB, trainingjob/JOB, or a manifest file whose job is meant."""
    if "/" in target and target.split("/", 1)[0].lower() in (
            "trainingjob", "trainingjobs", "tj"):
        return target.split("/", 1)[1]
    if target.endswith((".yaml", ".yml")) or Path(target).is_file():
        from pstrain_api.validate import InvalidManifest, load_job

        try:
            return load_job(target).name
        except InvalidManifest as exc:
            raise ValueError("; ".join(str(p) for p in exc.problems)) from exc
    return target


def _count(text: str) -> int:
    try:
        return int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from exc


def scale_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pstrain scale",
        description="Change the number of workers of a job that `pstrain run` is running "
        "on this machine, without restarting it (on a cluster: kubectl scale "
        "trainingjob/JOB --replicas N). Exits 0 when the change is made, 1 when it is "
        "refused or no such run is found, 2 for a bad command line.",
    )
    parser.add_argument("job", metavar="JOB",
                        help="the job's name (metadata.name), trainingjob/NAME, or its "
                        "manifest file")
    parser.add_argument("--replicas", type=_count, required=True, metavar="N",
                        help="the worker count wanted (spec.replicas.worker.replicas), "
                        "within minReplicas and maxReplicas")
    args = parser.parse_args(list(argv))
    try:
        name = _job_name(args.job)
    except ValueError as exc:
        print(f"pstrain scale: {exc}", file=sys.stderr)
        return 1
    answer = request_scale(name, args.replicas)
    print(f"pstrain scale: {answer.message}", file=sys.stdout if answer.ok else sys.stderr)
    if answer.warning:
        print(f"pstrain scale: warning: {answer.warning}", file=sys.stderr)
    return 0 if answer.ok else 1
