"""The parameter server's state and rules, without sockets: `ParameterStore`, the
facade the servers (gRPC `server.py`, the TCP data plane, the in-process transport)
call. It holds the namespaces (`ps.namespace`) and routes each call to the module that
owns its concern:

- `ps.shard` and `ps.pull`: the dense shard: Init (and restore), applying gradients,
  pulls;
- `ps.grads`: a push's gradients, read and checked before any rule sees them;
- `ps.async_steps` and `ps.sync_barrier`: the step rules (async with the staleness
  bound; sync buckets and the barrier);
- `ps.membership`: who may push: the worker set, SetWorkers, generations;
- `ps.job_board`: reports, job status, checkpoint requests, finish;
- `ps.waits`: every wait ends.

Streams come in as iterators of raw frame messages (see `wire`), so the transports are
thin adapters and tests can drive the store directly.

Invariants:
- Bad input (unknown namespace or tensor, wrong shape or dtype, NaN/inf, pushes before
  initialisation, chunks out of order or truncated) raises `PSError` with a status
  code and a message, and leaves parameters, optimizer state and step unchanged:
  gradients are read into pooled scratch buffers and validated before anything is
  applied.
- One lock per namespace (`Namespace.cond`) serialises every change to it.

Also re-exported here, for the modules that import them from `store`: `PSError`,
`Namespace`, `SLOT_SEPARATOR`, `optimizer_from_pb`, `optimizer_to_pb`, `is_all_finite`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ..proto import ps_pb2 as pb
from ..transport import wire
from . import async_steps, grads, job_board, membership, pull, shard, sync_barrier
from .errors import PSError, invalid
from .grads import GRAD_DTYPES, FlatGrads, RunningSum, first_nonfinite, is_all_finite
from .job_board import JobReport
from .membership import new_generation
from .namespace import Namespace
from .shard import SLOT_SEPARATOR, optimizer_from_pb, optimizer_to_pb, physical_memory
from .streams import read_header
from .sync_barrier import Bucket
from .waits import MAX_WAIT, WAIT_SLICE, Gone, wait_until

__all__ = ["GRAD_DTYPES", "MAX_WAIT", "SLOT_SEPARATOR", "WAIT_SLICE", "Bucket", "FlatGrads",
           "Gone", "JobReport", "Namespace", "PSError", "ParameterStore", "RunningSum",
           "first_nonfinite", "is_all_finite", "new_generation", "optimizer_from_pb",
           "optimizer_to_pb", "physical_memory"]


class ParameterStore:
    """All namespaces of one parameter server."""

    def __init__(self, ps_index: int = 0, clock: Callable[[], float] = time.monotonic,
                 max_wait: float = MAX_WAIT, max_init_bytes: int | None = None,
                 checkpoint_dir: Path | None = None) -> None:
        self.ps_index = ps_index
        # The job's checkpoint directory as this server sees it: where it writes its
        # own rows of a sparse checkpoint (`sparse.shard_writes`); None: nowhere.
        self.checkpoint_dir = checkpoint_dir
        self.clock = clock
        self.max_wait = max_wait
        self.max_init_bytes = physical_memory() if max_init_bytes is None else max_init_bytes
        self._lock = threading.Lock()
        self._namespaces: dict[str, Namespace] = {}
        self.stopping = threading.Event()

    # ------------------------------------------------------------------ lookup
    def namespace(self, name: str, create: bool = False) -> Namespace:
        with self._lock:
            ns = self._namespaces.get(name)
            if ns is None and create:
                ns = self._namespaces[name] = Namespace(name)
        if ns is None:
            raise PSError(
                "FAILED_PRECONDITION",
                f"namespace {name!r} is not initialised on parameter server "
                f"{self.ps_index}; the chief initialises it (or restores it from a "
                "checkpoint) before workers push or pull",
            )
        return ns

    def namespaces(self) -> list[Namespace]:
        with self._lock:
            return list(self._namespaces.values())

    def _ready(self, name: str) -> Namespace:
        ns = self.namespace(name)
        if not ns.initialized:
            raise PSError("FAILED_PRECONDITION",
                          f"namespace {name!r} is not initialised on parameter server "
                          f"{self.ps_index} yet")
        return ns

    def _wait(self, ns: Namespace, ready: Callable[[], bool], timeout: float | None,
              gone: Gone | None = None) -> bool:
        """`ps.waits.wait_until`, bounded by this store's clock, max_wait and stop."""
        return wait_until(self, ns, ready, timeout, gone)

    # ------------------------------------------------------------------ init
    def init(self, messages: Iterator[bytes]) -> pb.StepInfo:
        restored = shard.read_init(messages, self.max_init_bytes, self.ps_index)
        ns = self.namespace(restored.header.namespace, create=True)
        with ns.cond:
            return shard.install(ns, restored)

    # ------------------------------------------------------------------ push
    def push(self, messages: Iterator[bytes], timeout: float | None = None,
             gone: Gone | None = None) -> pb.PushReply:
        header = read_header(messages, pb.STREAM_KIND_PUSH)
        return self._push(header, messages, timeout, gone)

    def push_pull(self, messages: Iterator[bytes], timeout: float | None = None,
                  chunk_bytes: int = wire.CHUNK_BYTES, gone: Gone | None = None,
                  after_push: Callable[[pb.PushReply], None] | None = None
                  ) -> Iterator[bytes]:
        """A push, then a pull of the pushed tensors (one round trip for a worker).

        Validates and applies now (raises PSError like `push`), then returns the PULL
        frame iterator; its header carries the push's reply in `push_reply`. The pull
        reads the parameters after the push returned, exactly as a separate Pull issued
        after the Push would (in sync mode: after the push's step was applied, within
        the staleness bound). `after_push` gets the push's reply before the pull (a
        sparse push riding on this call, `sparse.riding`)."""
        header = read_header(messages, pb.STREAM_KIND_PUSH)
        reply = self._push(header, messages, timeout, gone)
        if after_push is not None:
            after_push(reply)
        names = [meta.name for meta in header.tensors]
        if not names:
            raise invalid("push_pull: the push lists no tensors; name the tensors to pull "
                          "back")
        request = pb.PullRequest(namespace=header.namespace, names=names,
                                 worker=header.worker)
        return self.pull(request, timeout, chunk_bytes, push_reply=reply, gone=gone)

    def push_pull_small(self, message: bytes, timeout: float | None = None,
                        gone: Gone | None = None,
                        after_push: Callable[[pb.PushReply], None] | None = None) -> bytes:
        """`push_pull` with the whole stream batched in one message each way."""
        try:
            frames = wire.decode_batch(message)
        except wire.WireError as exc:
            raise invalid(f"push_pull: {exc}") from exc
        return wire.encode_batch(self.push_pull(iter(frames), timeout, gone=gone,
                                                after_push=after_push))

    def _push(self, header: pb.StreamHeader, messages: Iterator[bytes],
              timeout: float | None, gone: Gone | None) -> pb.PushReply:
        """Who may push (`membership`), then the gradients (`grads`), then the mode's
        step rule (`sync_barrier` or `async_steps`)."""
        ns = self._ready(header.namespace)
        membership.check_member(ns, header.worker, "push")
        if ns.done:
            for _ in messages:  # drain, so the client sees the reply rather than a reset
                pass
            return ns.not_applied(header.worker, "the job is done; the push was not applied")
        membership.check_generation(ns, header.worker, header.generation, self.ps_index,
                                    "push")
        mode = ns.mode
        rule = sync_barrier.push if mode == "sync" else async_steps.push
        with grads.received(ns, header, messages, mode, self.ps_index) as received:
            return rule(ns, header, received, self._wait, timeout, gone)

    # ------------------------------------------------------------------ pull
    def pull(self, request: pb.PullRequest, timeout: float | None = None,
             chunk_bytes: int = wire.CHUNK_BYTES,
             push_reply: pb.PushReply | None = None,
             gone: Gone | None = None) -> Iterator[bytes]:
        """Validate now (raises PSError), then return the frame iterator."""
        ns = self._ready(request.namespace)
        return pull.pull_frames(ns, request, self.ps_index, self._wait, timeout,
                                 chunk_bytes, push_reply, gone)

    # ------------------------------------------------------------------ control
    def info(self, namespace: str, worker: int | None = None) -> pb.StepInfo:
        with self._lock:
            ns = self._namespaces.get(namespace)
        if ns is None:
            return pb.StepInfo(initialized=False)
        with ns.cond:
            return ns.info(worker)

    def set_workers(self, namespace: str, workers: Iterable[int]) -> pb.StepInfo:
        """Elastic workers: make `workers` the namespace's live set (`membership`); the
        open sync steps a removed worker held back are applied here."""
        ns = self._ready(namespace)
        with ns.cond:
            membership.set_workers(ns, workers)
            sync_barrier.apply_ready_buckets(ns)
            ns.cond.notify_all()
            return ns.info()

    def finish(self, namespace: str) -> pb.StepInfo:
        return job_board.finish(self._ready(namespace))

    def report(self, report: pb.StatusReport) -> None:
        job_board.record_report(self.namespace(report.namespace), report)

    def _reported(self, namespace: str) -> Namespace:
        """`namespace`, or the most recently reported one when empty."""
        if namespace:
            return self.namespace(namespace)
        return job_board.latest_reported(self.namespaces())

    def request_checkpoint(self, namespace: str) -> pb.StepInfo:
        """Ask the chief for a checkpoint (`job_board.request_checkpoint`) of
        `namespace`, or of the most recently reported one when empty."""
        return job_board.request_checkpoint(self._reported(namespace))

    def job_status(self, namespace: str) -> pb.JobStatus:
        """Status of `namespace`, or of the most recently reported one when empty."""
        return job_board.job_status(self._reported(namespace))

    def workers_informed(self) -> bool:
        """Every worker of every finished namespace has been told the job is done."""
        return job_board.workers_informed(self.namespaces())

    def stop(self) -> None:
        self.stopping.set()
        for ns in self.namespaces():
            with ns.cond:
                ns.cond.notify_all()
