"""The one place the benchmarks touch the runtime's API (`pstrain_runtime`): a
parameter server process, and a worker-side sharded client over the runtime's
transports (`transport` "tcp", the default data plane, or "grpc"). When the runtime's
API moves, only this module follows it."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from .procs import LOOPBACK

CONNECT_DEADLINE_S = 60.0


def serve_ps(ps_index: int, port: int, timeout_s: float, token: bytes | None = None,
             checkpoint_dir: str | None = None) -> None:
    """Run one parameter server on 127.0.0.1:`port` until a client's Shutdown RPC (or
    `timeout_s`); with `token`, it checks that job token's keys on every call; with
    `checkpoint_dir`, the job's checkpoint directory (it writes its own rows of a
    sparse checkpoint there, as a replica given the job's settings does). The
    process's allocator is set as `pstrain replica` sets a server's."""
    from pstrain_runtime import allocator

    allocator.tune("ps")
    server = start_ps(ps_index, port, token, checkpoint_dir=checkpoint_dir)
    if not server.wait(timeout_s):
        server.stop(grace=0)


def start_ps(ps_index: int, port: int, token: bytes | None = None,
             tls_dir: str | None = None, checkpoint_dir: str | None = None):  # noqa: ANN201
    """A started parameter server on 127.0.0.1:`port` (authenticated with `token`, over
    TLS with the files in `tls_dir`, writing its rows of sparse checkpoints into
    `checkpoint_dir` where it sees the chief's)."""
    from pathlib import Path

    from pstrain_runtime.ps.server import PSServer
    from pstrain_runtime.ps.store import ParameterStore
    from pstrain_runtime.transport.auth import Credentials
    from pstrain_runtime.transport.tls import TlsFiles

    credentials = Credentials.from_token(token) if token else None
    server = PSServer(f"{LOOPBACK}:{port}", ps_index=ps_index, credentials=credentials,
                      tls=TlsFiles(Path(tls_dir)) if tls_dir else None,
                      store=ParameterStore(ps_index, checkpoint_dir=Path(checkpoint_dir)
                                           if checkpoint_dir else None))
    server.start()
    return server


def connect(ports: Sequence[int], shapes: Mapping[str, Sequence[int]], namespace: str,
            wire_dtype: str = "float32", transport: str = "tcp",
            token: bytes | None = None,
            tls_dir: str | None = None):  # noqa: ANN201 - runtime type, imported lazily
    """A ShardedClient for a model of `shapes` over the servers on `ports`, once every
    server answers; with `token`, it proves that job token's chief key; with `tls_dir`,
    over TLS trusting its ca.crt."""
    from pathlib import Path

    import torch
    from pstrain_runtime.transport.auth import Credentials
    from pstrain_runtime.worker.client import ShardedClient, retry_unavailable
    from pstrain_runtime.worker.client import connect as connect_one
    from pstrain_runtime.worker.placement import build_placement, param_specs

    credentials = Credentials.from_token(token).only("chief") if token else None
    from pstrain_runtime.transport.tls import TlsFiles

    tls = TlsFiles(Path(tls_dir)) if tls_dir else None
    transports = [connect_one(f"{LOOPBACK}:{p}", transport, credentials, tls) for p in ports]
    for t in transports:
        retry_unavailable(lambda t=t: t.info(namespace), CONNECT_DEADLINE_S)
    placement = build_placement(param_specs(shapes), len(ports))
    return ShardedClient(transports, placement, namespace,
                         wire_dtype=getattr(torch, wire_dtype))


def fingerprint(shapes: Mapping[str, Sequence[int]]) -> str:
    text = ";".join(f"{k}:{list(v)}" for k, v in sorted(shapes.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def init(client, params: Mapping[str, object], num_workers: int,  # noqa: ANN001
         mode: str = "async", lr: float = 1e-3) -> None:
    """Install `params` on the servers with a plain SGD optimizer."""
    from pstrain_runtime.optim import OptimizerConfig

    shapes = {k: tuple(v.shape) for k, v in params.items()}  # type: ignore[attr-defined]
    client.init(params, OptimizerConfig(name="sgd", learning_rate=lr), mode=mode,
                num_workers=num_workers, staleness_bound=None,
                fingerprint=fingerprint(shapes))


def has_push_pull(client) -> bool:  # noqa: ANN001
    """Whether this runtime has the fused push-then-pull call (one round trip)."""
    return callable(getattr(client, "push_pull", None))


def step(client, grads, params, worker: int) -> None:  # noqa: ANN001
    """A worker's exchange with the servers in one training step, the way the runtime
    does it: the fused push_pull when the runtime has it, else push then pull."""
    if has_push_pull(client):
        client.push_pull(grads, params, worker=worker)
    else:
        client.push(grads, worker=worker)
        client.pull(params, worker=worker)


def shutdown(client, grace: float = 1.0) -> None:  # noqa: ANN001
    client.shutdown(grace)
    client.close()


# --------------------------------------------------------------------------- training


def make_training(spec: Mapping[str, object]):  # noqa: ANN201
    """`spec.training` (camelCase dict, as in a manifest) as the API model."""
    from pstrain_api.model import Training

    return Training.model_validate(spec)


class Recorder:
    """The chief's event sink: keeps (time, event) pairs and, when `should_stop` says
    so, ends the job at the current global step.

    Ending early works by lowering the chief's `training.steps` to the step it has
    reached: the trainer checks `gstep >= training.steps` after every step, then does
    its normal finish (final eval, Finish RPC, workers learn the job is done). This is
    the only way the benchmark reaches into a running trainer.
    """

    def __init__(self, should_stop) -> None:  # noqa: ANN001
        import time

        self._clock = time.perf_counter
        self.events: list[tuple[float, str, dict]] = []
        self.should_stop = should_stop
        self.trainer = None
        self.stopped_at: int | None = None

    def __call__(self, kind: str, stream: object = None, **fields: object) -> None:
        now = self._clock()
        self.events.append((now, kind, dict(fields)))
        if self.trainer is None or self.stopped_at is not None:
            return
        step = fields.get("step")
        if isinstance(step, int) and step >= 1 and self.should_stop(self.events):
            self.stopped_at = step
            self.trainer.training.steps = step


def run_trainer(training, namespace: str, worker: int, num_workers: int,  # noqa: ANN001
                ports: Sequence[int], emit=None, progress_interval: float = 1.0,  # noqa: ANN001
                overlap: bool = False):  # noqa: ANN201
    """One trainer of one job: chief when worker == 0; `overlap` is `pstrain replica
    --overlap`. The process's allocator is set as `pstrain replica` sets a trainer's.
    Returns (TrainResult, seconds from the start of `run()` to its end)."""
    import time

    from pstrain_runtime import allocator
    from pstrain_runtime.worker.client import connect
    from pstrain_runtime.worker.context import WorkerRole
    from pstrain_runtime.worker.trainer import Trainer

    allocator.tune("trainer")

    role = WorkerRole(namespace=namespace, worker=worker, num_workers=num_workers)
    trainer = Trainer(training, role,
                      [connect(f"{LOOPBACK}:{p}", training.transport) for p in ports],
                      emit=emit or (lambda *a, **k: None),
                      progress_interval=progress_interval, shutdown_grace=5.0,
                      overlap=overlap)
    if isinstance(emit, Recorder):
        emit.trainer = trainer
    try:
        t0 = time.perf_counter()
        result = trainer.run()
        return result, t0, time.perf_counter()
    finally:
        trainer.close()


def shutdown_servers(ports: Sequence[int], grace: float = 5.0) -> None:
    from pstrain_runtime.worker.client import GrpcTransport

    for p in ports:
        t = GrpcTransport(f"{LOOPBACK}:{p}")
        try:
            t.shutdown(grace)
        finally:
            t.close()


# --------------------------------------------------------------------------- sparse


def sparse_table(ports: Sequence[int], namespace: str, dim: int):  # noqa: ANN201
    """A sparse client over the servers on `ports` and the spec of one dynamic table
    of `dim` float32 values per row (Adagrad), defined on them and initialised."""
    import torch
    from pstrain_runtime.optim import OptimizerConfig
    from pstrain_runtime.sparse.client import SparseClient
    from pstrain_runtime.sparse.spec import TableSpec
    from pstrain_runtime.worker.client import connect as connect_one

    dense = connect(ports, {"w": (4,)}, namespace)
    spec = TableSpec(name="bench", num_embeddings=None, embedding_dim=dim, init_std=0.01,
                     optimizer=OptimizerConfig(name="adagrad", learning_rate=0.05))
    client = SparseClient([connect_one(f"{LOOPBACK}:{p}", "tcp") for p in ports], namespace)
    client.configure([spec], reset=True)
    init(dense, {"w": torch.zeros(4)}, num_workers=1)
    return client, spec, dense
