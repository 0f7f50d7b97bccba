"""`pstrain replica`: run one replica of a job, a parameter server or a trainer.

The replica learns who it is only from the environment that
`pstrain_api.cluster.ClusterSpec.env(task)` builds: PSTRAIN_CLUSTER (roles, addresses,
this task, the chief), PSTRAIN_TRAINING (the `Training` settings as JSON) and TF_CONFIG.

- role `ps`: serve on PSTRAIN_BIND_ADDRESS if set, else on this task's own port (on
  its host when that is an IP literal, else on 0.0.0.0), and the data plane on port
  PSTRAIN_DATA_PORT of the same host (unset: any free port; Info announces it); exit 0
  after the chief's Shutdown.
- Keys: from the files in PSTRAIN_AUTH_DIR (`auth.load_credentials`); unset means
  authentication is off. TLS: the files in PSTRAIN_TLS_DIR (`tls.load_tls`); unset
  means plain TCP. A server checks every call against them; a trainer proves
  the chief key if it holds it, else its own worker key (derived from the job's worker
  key when that is what it was given), so it can act only as itself.
- role `worker`/`chief`: train; the chief (identity.is_chief) initialises, checkpoints,
  evaluates and finally shuts the servers down; it also writes its scalars as TensorBoard
  event files beside the checkpoints (`worker.chief.tensorboard`). Every trainer exits 0
  when the job is done, and non-zero on a real failure.

A replica that fails says why in one line on stderr and in its termination-message file
(`failure.report_failure`); a mistake in the job's configuration exits with
`constants.EXIT_CONFIGURATION_ERROR` (permanent: the job fails at once). An unexpected
crash keeps its traceback and also leaves its last line in that file.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pstrain_api import constants as c
from pstrain_api import events, security
from pstrain_api.cluster import ReplicaIdentity, parse_cluster_env
from pstrain_api.quote import one_line

from . import allocator
from .failure import ConfigurationError, report_failure, write_termination_message

if TYPE_CHECKING:
    from pstrain_api.model import Training

    from .transport.auth import Credentials
    from .transport.tls import TlsFiles
    from .worker.chief.tensorboard import TensorBoardLog

ENV_BIND_ADDRESS = "PSTRAIN_BIND_ADDRESS"
ENV_NUM_THREADS = "PSTRAIN_NUM_THREADS"


def bind_address(identity: ReplicaIdentity, environ: Mapping[str, str]) -> str:
    """Where a parameter server listens (see the module docstring)."""
    explicit = environ.get(ENV_BIND_ADDRESS)
    if explicit:
        return explicit
    own = identity.addresses(identity.task.role)[identity.task.index]
    host, _, port = own.rpartition(":")
    try:
        ipaddress.ip_address(host.strip("[]"))
        return own
    except ValueError:
        return f"0.0.0.0:{port}"


def worker_index(identity: ReplicaIdentity) -> tuple[int, int]:
    """(index among trainers with the chief as 0, number of trainers)."""
    workers = len(identity.addresses(c.ROLE_WORKER))
    chiefs = len(identity.addresses(c.ROLE_CHIEF))
    task = identity.task
    if task.role == c.ROLE_CHIEF:
        return 0, workers + chiefs
    return (task.index + 1 if chiefs else task.index), workers + chiefs


def namespace_of(identity: ReplicaIdentity) -> str:
    return f"{identity.namespace or 'default'}/{identity.job_name or 'job'}"


def _security(environ: Mapping[str, str],
              role: str) -> tuple[Credentials | None, TlsFiles | None]:
    """The keys this replica holds (None: authentication off) and its TLS files (None:
    TLS off). Raises ValueError when they cannot be read, or a parameter server lacks a
    key."""
    from .transport.auth import load_credentials
    from .transport.tls import load_tls

    credentials, tls = load_credentials(environ), load_tls(environ)
    if (role == c.ROLE_PS and credentials is not None
            and set(credentials.keys) != set(security.KEY_ROLES)):
        raise ValueError(f"a parameter server needs every role key "
                         f"({', '.join(security.KEY_ROLES)}) in {security.ENV_AUTH_DIR}; "
                         f"it has {credentials!r}")
    return credentials, tls


def _checkpoint_dir(environ: Mapping[str, str]) -> Path | None:
    """The job's checkpoint directory, from the training settings every replica is
    given: where a server writes its own rows of a sparse checkpoint, if it sees the
    chief's there (`sparse.shard_writes`). None without one (or without settings the
    server can read: then the chief writes every row)."""
    from pstrain_api.model import Training

    raw = environ.get(c.ENV_TRAINING)
    try:
        directory = Training.model_validate_json(raw).checkpoint.directory if raw else None
    except ValueError:
        return None
    return Path(directory) if directory else None


def run_ps(identity: ReplicaIdentity, environ: Mapping[str, str]) -> int:
    from .ps.server import PSServer

    try:
        data_port = int(environ.get(c.ENV_DATA_PORT) or 0)
        if not 0 <= data_port <= 65535:
            raise ValueError(data_port)
    except ValueError:
        return report_failure(
            f"pstrain replica: {c.ENV_DATA_PORT} is {environ[c.ENV_DATA_PORT]!r}; it must "
            "be a port number (0 to 65535; 0 or unset: any free port)", 2, environ)
    try:
        credentials, tls = _security(environ, c.ROLE_PS)
    except ValueError as exc:
        return report_failure(f"pstrain replica: {exc}", 2, environ)
    from .ps.store import ParameterStore

    store = ParameterStore(identity.task.index, checkpoint_dir=_checkpoint_dir(environ))
    registry = metrics_registry(environ)
    if registry is not None:
        from .metrics import MeteredStore, PSMetrics

        store = MeteredStore(store, PSMetrics(registry))  # type: ignore[assignment]
    server = PSServer(bind_address(identity, environ), ps_index=identity.task.index,
                      data_port=data_port, credentials=credentials, tls=tls, store=store)
    try:
        server.start()
    except (OSError, RuntimeError) as exc:
        return report_failure(f"pstrain replica: parameter server {identity.task.index} "
                              f"could not bind {server.bind}: {exc}", 1, environ)
    events.emit("ready", role=c.ROLE_PS, index=identity.task.index,
                address=f"{server.bind.rsplit(':', 1)[0]}:{server.port}")
    try:
        while not server.wait(1.0):
            pass
    except KeyboardInterrupt:
        server.stop(0)
        return 130
    return 0


def _training_settings(environ: Mapping[str, str]) -> Training | int:
    """The `Training` settings in PSTRAIN_TRAINING, or the exit code after saying why
    there are none."""
    from pstrain_api.model import Training

    raw = environ.get(c.ENV_TRAINING)
    if not raw:
        return report_failure(f"pstrain replica: {c.ENV_TRAINING} is not set; the runner "
                              "or the operator sets it", 2, environ)
    try:
        return Training.model_validate_json(raw)
    except ValueError as exc:
        return report_failure(f"pstrain replica: {c.ENV_TRAINING} is not valid: "
                              f"{one_line(str(exc))}", 2, environ)


def run_trainer(identity: ReplicaIdentity, environ: Mapping[str, str], overlap: bool) -> int:
    import torch

    from .checkpoint import CheckpointError
    from .ps.store import PSError
    from .summary import final_summary, write_summary
    from .worker.chief.tensorboard import tee
    from .worker.client import connect
    from .worker.context import TrainingDiverged, WorkerRole
    from .worker.trainer import Trainer

    training = _training_settings(environ)
    if isinstance(training, int):
        return training
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in environ:
        torch.set_num_threads(int(environ.get(ENV_NUM_THREADS, "1")))
    index, count = worker_index(identity)
    role = WorkerRole(namespace=namespace_of(identity), worker=index, num_workers=count)
    ps = identity.addresses(c.ROLE_PS)
    if not ps:
        return report_failure("pstrain replica: the cluster spec has no parameter servers",
                              2, environ)
    try:
        credentials, tls = _security(environ, identity.task.role)
        if credentials is not None:  # a worker proves its own key: it acts as itself only
            credentials = credentials.for_worker(index)
    except ValueError as exc:
        return report_failure(f"pstrain replica: {exc}", 2, environ)
    if not startup_barrier(ps, environ, tls):
        return c.EXIT_STARTUP_TIMEOUT
    trainer = None
    me = f"pstrain replica: {identity.task.role} {identity.task.index}"
    log = chief_tensorboard_log(training) if role.is_chief else None
    try:
        transports = [connect(a, training.transport, credentials, tls) for a in ps]
        trainer = Trainer(training, role, transports, overlap=overlap,
                          emit=tee(events.emit, log) if log is not None else events.emit)
        registry = metrics_registry(environ)
        if registry is not None:
            from .metrics import MeteredClient, WorkerMetrics

            trainer.client = MeteredClient(trainer.client, WorkerMetrics(registry),
                                           training.batch_size)
        result = trainer.run()
        if role.is_chief:
            write_summary(final_summary(
                result.global_step, result.loss, result.samples_per_sec,
                result.metrics.get("accuracy"), trainer.last_checkpoint), environ)
            trainer.shutdown_servers()
        return 0
    except ConfigurationError as exc:
        return report_failure(f"{me}: configuration error: {one_line(str(exc))}",
                              c.EXIT_CONFIGURATION_ERROR, environ)
    except (TrainingDiverged, CheckpointError, TimeoutError, PSError, ValueError) as exc:
        return report_failure(f"{me} failed: {one_line(str(exc))}", 1, environ)
    finally:
        if trainer is not None:
            trainer.close()
        if log is not None:
            log.close()


def chief_tensorboard_log(training: Training) -> TensorBoardLog | None:
    """The chief's TensorBoard log, in `tensorboard/` beside the checkpoints; None
    when the job has no checkpoint directory (nowhere that outlives the replica)."""
    from .worker.chief.tensorboard import TensorBoardLog, tensorboard_dir

    directory = training.checkpoint.directory
    return TensorBoardLog(tensorboard_dir(directory)) if directory else None


def metrics_registry(environ: Mapping[str, str]) -> Any:
    """A registry served at /metrics on PSTRAIN_METRICS_PORT, or None when it is unset
    or cannot be served (the port is taken: training goes on without metrics)."""
    raw = environ.get(c.ENV_METRICS_PORT)
    if not raw:
        return None
    from prometheus_client import CollectorRegistry

    from .metrics import serve_metrics

    registry = CollectorRegistry()
    try:
        serve_metrics(int(raw), registry)
    except (OSError, ValueError) as exc:  # metrics are worth having, not worth failing for
        print(f"pstrain replica: no /metrics: cannot serve on {c.ENV_METRICS_PORT}={raw!r}: "
              f"{exc}", file=sys.stderr, flush=True)
        return None
    return registry


def startup_barrier(ps: Sequence[str], environ: Mapping[str, str],
                    tls: TlsFiles | None = None) -> bool:
    """Gang start (PSTRAIN_STARTUP_TIMEOUT set): wait until every parameter server
    answers its health check; False, after saying which did not, when the time is up."""
    raw = environ.get(c.ENV_STARTUP_TIMEOUT)
    if not raw:
        return True
    from .health import wait_all_serving, wait_serving

    timeout = float(raw)
    missing = wait_all_serving(ps, timeout, functools.partial(wait_serving, tls=tls))
    if missing:
        print(f"pstrain replica: parameter servers {', '.join(missing)} did not answer their "
              f"health check within {timeout:g}s ({c.ENV_STARTUP_TIMEOUT}, "
              "spec.runPolicy.gangScheduling.startupTimeoutSeconds)", file=sys.stderr,
              flush=True)
        return False
    return True


def replica_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pstrain replica",
        description="Run one replica (parameter server or trainer) from the cluster-spec "
        "environment (PSTRAIN_CLUSTER, PSTRAIN_TRAINING, TF_CONFIG).")
    parser.add_argument("--overlap", action="store_true",
                        help="start pushing a shard during backward as soon as its "
                        "gradients are ready (helps with several parameter servers)")
    args = parser.parse_args(list(argv))
    environ = dict(os.environ)
    try:
        return _dispatch(environ, args.overlap)
    except Exception as exc:  # a bug: keep the traceback, and leave its last line behind
        crash = one_line(f"{type(exc).__name__}: {exc}")
        write_termination_message(f"pstrain replica crashed: {crash}", environ)
        raise


def _dispatch(environ: Mapping[str, str], overlap: bool) -> int:
    try:
        identity = parse_cluster_env(environ)
    except ValueError as exc:
        return report_failure(f"pstrain replica: {exc}", 2, environ)
    if identity.task.role == c.ROLE_PS:
        allocator.tune("ps")
        return run_ps(identity, environ)
    if identity.task.role in (c.ROLE_WORKER, c.ROLE_CHIEF):
        allocator.tune("trainer")
        return run_trainer(identity, environ, overlap)
    return report_failure(f"pstrain replica: task type {identity.task.role!r} is not one "
                          f"of {list(c.ROLES)}", 2, environ)
