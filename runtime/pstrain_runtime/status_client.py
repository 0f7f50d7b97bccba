"""Job status from parameter server 0, for the operator. Imports no torch.

    fetch_job_status("digits-ps-0.digits.default.svc:2222", timeout=2.0)
    -> {"namespace": "default/digits", "global_step": 420, "loss": 0.08,
        "samples_per_sec": 15000.0, "eval_accuracy": 0.97, "auc": None, "logloss": None,
        "eval_metrics": {"accuracy": 0.97, "loss": 0.1}, "checkpoint_step": 400,
        "checkpoint_path": "/ckpt/ckpt-000000000400.pt", "checkpoint_time": 1.7e9,
        "done": False, "target_steps": 600, "initialized": True, "updated_time": 1.7e9}

Values not known yet are None (no eval yet, no checkpoint yet, no loss yet).
"""

from __future__ import annotations

import math
from typing import Any

import grpc

from .proto import ps_pb2, ps_pb2_grpc
from .transport.auth import Credentials, client_channel
from .transport.tls import TlsFiles, TrustedCa


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _metric(status: ps_pb2.JobStatus, key: str) -> float | None:
    """One metric of the latest evaluation, None when it has none or it is not finite."""
    value = status.eval_metrics.get(key)
    return _finite(value) if value is not None else None


def status_to_dict(status: ps_pb2.JobStatus) -> dict[str, Any]:
    return {
        "namespace": status.namespace,
        "global_step": int(status.global_step),
        "loss": _finite(status.loss),
        "samples_per_sec": status.samples_per_sec or None,
        "eval_accuracy": _finite(status.eval_accuracy) if status.has_eval else None,
        "auc": _metric(status, "auc"),
        "logloss": _metric(status, "logloss"),
        "eval_metrics": {k: v for k, v in sorted(status.eval_metrics.items())
                         if math.isfinite(v)},
        "checkpoint_step": int(status.checkpoint_step) if status.has_checkpoint else None,
        "checkpoint_path": status.checkpoint_path if status.has_checkpoint else None,
        "checkpoint_time": status.checkpoint_time if status.has_checkpoint else None,
        "done": bool(status.done),
        "target_steps": int(status.target_steps) or None,
        "initialized": bool(status.initialized),
        "updated_time": status.updated_time or None,
        # sparse tables' live rows and server memory (None: the model has none)
        "sparse_rows": int(status.sparse_rows) if _has_tables(status) else None,
        "sparse_bytes": int(status.sparse_bytes) if _has_tables(status) else None,
        "workers": list(status.workers) or None,  # the servers' live worker set
    }


def _has_tables(status: ps_pb2.JobStatus) -> bool:
    return status.sparse_rows >= 0 and status.sparse_bytes > 0


def _ask(address: str, timeout: float, method: str, namespace: str,
         credentials: Credentials | None, tls: TlsFiles | TrustedCa | None) -> Any:
    """One unary call with a NamespaceRequest to the server at `address`, proving
    `credentials` (over TLS with `tls`); None when it cannot be reached, refuses, or does
    not answer within `timeout` seconds."""
    try:
        with client_channel(address, credentials, tls=tls) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            return getattr(stub, method)(ps_pb2.NamespaceRequest(namespace=namespace),
                                         timeout=timeout)
    except grpc.RpcError:
        return None


def fetch_job_status(address: str, timeout: float, namespace: str = "",
                     credentials: Credentials | None = None,
                     tls: TlsFiles | TrustedCa | None = None) -> dict[str, Any] | None:
    """The job status held by the parameter server at `address` (PS 0), or None when it
    cannot be reached, holds no job yet, or does not answer within `timeout` seconds.

    `namespace` is "<k8s namespace>/<job name>"; empty means the job that reported last
    (a parameter server normally serves one job). `credentials`: the job's worker key
    (or chief key) when the servers check them (see `auth`).
    """
    reply = _ask(address, timeout, "GetJobStatus", namespace, credentials, tls)
    return status_to_dict(reply) if reply is not None else None


def set_workers(address: str, timeout: float, namespace: str, workers: list[int],
                credentials: Credentials | None = None,
                tls: TlsFiles | TrustedCa | None = None) -> int | None:
    """Elastic workers: make `workers` the live worker set of `namespace` on the server at
    `address` (call it on every parameter server of the job; it needs the chief's key).
    Returns the global step at the change, or None when the server cannot be reached,
    refuses, or holds no such job."""
    try:
        with client_channel(address, credentials, tls=tls) as channel:
            stub = ps_pb2_grpc.ParameterServerStub(channel)
            reply = stub.SetWorkers(ps_pb2.WorkersRequest(namespace=namespace,
                                                          workers=workers), timeout=timeout)
    except grpc.RpcError:
        return None
    return int(reply.global_step)


def request_checkpoint(address: str, timeout: float, namespace: str = "",
                       credentials: Credentials | None = None,
                       tls: TlsFiles | TrustedCa | None = None) -> int | None:
    """Ask PS 0 at `address` for a checkpoint before a disruption: the chief writes one
    when it next hears from PS 0, and its step then shows in `fetch_job_status`. Returns
    the global step the request was made at (a checkpoint at or after it answers it), or
    None when the server cannot be reached or holds no job."""
    reply = _ask(address, timeout, "RequestCheckpoint", namespace, credentials, tls)
    return int(reply.global_step) if reply is not None and reply.initialized else None
