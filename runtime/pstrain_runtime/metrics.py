"""Prometheus metrics of a replica, served over HTTP at /metrics (prometheus-client).

A pod's replica serves them on port PSTRAIN_METRICS_PORT (9400, declared by the pod as
`metrics`, scraped by the chart's PodMonitor); the local runner sets no port and no
metrics server starts. The metrics come from thin proxies around the two seams that
every tensor crosses, so neither the store nor the trainer knows about them:

- `MeteredStore` wraps a parameter server's ParameterStore (the gRPC service and the
  TCP data plane both call it): pushes, pulls, bytes in and out, apply latency, the
  global step and the staleness of applied gradients;
- `MeteredClient` wraps a trainer's ShardedClient: time in pull and in push, the step
  time, compute (the step less pull and push), steps and samples/s.

Every metric is prefixed `pstrain_`; the pod's labels (job, role, index) come from the
scrape, so metrics carry no labels of their own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .proto import ps_pb2 as pb
from .ps.store import ParameterStore
from .transport import wire

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)


def serve_metrics(port: int, registry: CollectorRegistry) -> None:
    """Serve `registry` at http://0.0.0.0:`port`/metrics from a daemon thread."""
    start_http_server(port, registry=registry)


class PSMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.pushes = Counter("pstrain_ps_pushes", "Gradient pushes received.",
                              registry=registry)
        self.applied = Counter("pstrain_ps_pushes_applied", "Pushes applied to the "
                               "parameters.", registry=registry)
        self.pulls = Counter("pstrain_ps_pulls", "Parameter pulls served.", registry=registry)
        self.bytes_in = Counter("pstrain_ps_received_bytes", "Bytes of tensor frames "
                                "received (pushes).", registry=registry)
        self.bytes_out = Counter("pstrain_ps_sent_bytes", "Bytes of tensor frames sent "
                                 "(pulls).", registry=registry)
        self.apply_seconds = Histogram("pstrain_ps_apply_seconds", "Time to apply one "
                                       "push's gradients.", buckets=LATENCY_BUCKETS,
                                       registry=registry)
        self.global_step = Gauge("pstrain_ps_global_step", "Global step on this parameter "
                                 "server.", registry=registry)
        self.staleness = Histogram("pstrain_ps_gradient_staleness_steps", "Global steps "
                                   "applied between a gradient's step and its own "
                                   "application.", buckets=STALENESS_BUCKETS,
                                   registry=registry)


def _counted(frames: Iterator[bytes], add: Callable[[float], None],
             first: list[bytes] | None = None) -> Iterator[bytes]:
    """`frames`, each counted by `add`; `first`: the first frame (the stream's header)
    is kept there, copied (the data plane reuses a frame's buffer once the next one is
    read)."""
    for frame in frames:
        if first is not None and not first:
            first.append(bytes(frame))
        add(len(frame))
        yield frame


class MeteredStore:
    """A ParameterStore that counts what passes through it; everything else is the
    store's own (attribute access is delegated)."""

    def __init__(self, store: Any, metrics: PSMetrics) -> None:
        self._store = store
        self._m = metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _pushed(self, first: list[bytes], reply: pb.PushReply) -> None:
        self._m.pushes.inc()
        if not reply.applied:
            return
        self._m.applied.inc()
        self._m.apply_seconds.observe(reply.apply_seconds)
        self._m.global_step.set(reply.info.global_step)
        if first:
            header = wire.decode_frame(first[0])
            if isinstance(header, pb.StreamHeader):
                self._m.staleness.observe(max(0, reply.info.global_step - 1 - header.step))

    def push(self, messages: Iterator[bytes], *args: Any, **kwargs: Any) -> pb.PushReply:
        first: list[bytes] = []
        reply = self._store.push(_counted(messages, self._m.bytes_in.inc, first), *args,
                                 **kwargs)
        self._pushed(first, reply)
        return reply

    def pull(self, request: pb.PullRequest, *args: Any, **kwargs: Any) -> Iterator[bytes]:
        self._m.pulls.inc()
        return _counted(self._store.pull(request, *args, **kwargs), self._m.bytes_out.inc)

    def push_pull(self, messages: Iterator[bytes], *args: Any, **kwargs: Any) -> Iterator[bytes]:
        first: list[bytes] = []
        frames = self._store.push_pull(_counted(messages, self._m.bytes_in.inc, first),
                                       *args, **kwargs)
        self._m.pulls.inc()
        return self._answered(first, frames)

    def _answered(self, first: list[bytes], frames: Iterator[bytes]) -> Iterator[bytes]:
        for i, frame in enumerate(frames):
            if i == 0:
                header = wire.decode_frame(frame)
                if isinstance(header, pb.StreamHeader) and header.HasField("push_reply"):
                    self._pushed(first, header.push_reply)
            self._m.bytes_out.inc(len(frame))
            yield frame

    # The store's own batching over the metered `push_pull` (the same keywords, always:
    # a twin of it once lacked a riding sparse push's `after_push`).
    push_pull_small = ParameterStore.push_pull_small


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.pull_seconds = Histogram("pstrain_worker_pull_seconds", "Time to pull the "
                                      "parameters.", buckets=LATENCY_BUCKETS,
                                      registry=registry)
        self.push_seconds = Histogram("pstrain_worker_push_seconds", "Time to push the "
                                      "gradients (with the parameters when combined).",
                                      buckets=LATENCY_BUCKETS, registry=registry)
        self.compute_seconds = Histogram("pstrain_worker_compute_seconds", "Time of a step "
                                         "outside pull and push: forward and backward.",
                                         buckets=LATENCY_BUCKETS, registry=registry)
        self.step_seconds = Histogram("pstrain_worker_step_seconds", "Time of one training "
                                      "step.", buckets=LATENCY_BUCKETS, registry=registry)
        self.steps = Counter("pstrain_worker_steps", "Training steps done by this worker.",
                             registry=registry)
        self.samples = Counter("pstrain_worker_samples", "Samples trained on by this "
                               "worker.", registry=registry)
        self.samples_per_second = Gauge("pstrain_worker_samples_per_second", "Samples per "
                                        "second of the last step.", registry=registry)
        self.loss = Gauge("pstrain_worker_loss", "Training loss of the last reported "
                          "step (the chief's report).", registry=registry)


class MeteredClient:
    """A trainer's ShardedClient whose pulls and pushes are timed. A step ends at each
    push; its compute time is the step less the pulls and pushes within it."""

    def __init__(self, client: Any, metrics: WorkerMetrics, batch_size: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._client = client
        self._m = metrics
        self._batch = batch_size
        self._clock = clock
        self._step_start: float | None = None
        self._io = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def _timed(self, histogram: Histogram, call: Callable[[], Any]) -> Any:
        start = self._clock()
        if self._step_start is None:
            self._step_start = start
        try:
            return call()
        finally:
            spent = self._clock() - start
            histogram.observe(spent)
            self._io += spent

    def _step_done(self, push_spent: float) -> None:
        now = self._clock()
        step = now - (self._step_start if self._step_start is not None else now - push_spent)
        self._m.step_seconds.observe(step)
        self._m.compute_seconds.observe(max(0.0, step - self._io))
        self._m.steps.inc()
        self._m.samples.inc(self._batch)
        if step > 0:
            self._m.samples_per_second.set(self._batch / step)
        self._step_start, self._io = now, 0.0

    def pull(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(self._m.pull_seconds, lambda: self._client.pull(*args, **kwargs))

    def _push(self, method: str, *args: Any, **kwargs: Any) -> Any:
        start = self._clock()
        result = self._timed(self._m.push_seconds,
                             lambda: getattr(self._client, method)(*args, **kwargs))
        self._step_done(self._clock() - start)
        return result

    def push(self, *args: Any, **kwargs: Any) -> Any:
        return self._push("push", *args, **kwargs)

    def push_pull(self, *args: Any, **kwargs: Any) -> Any:
        return self._push("push_pull", *args, **kwargs)

    def report(self, report: pb.StatusReport) -> None:
        if math.isfinite(report.loss):  # NaN: no loss yet
            self._m.loss.set(report.loss)
        self._client.report(report)
