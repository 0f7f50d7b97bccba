"""The operator's settings: read once from the environment and the command line,
validated up front, then frozen.

Every setting is an environment variable (what the Helm chart sets) and a flag of
`pstrain operator` (the flag wins). The names are a contract with the chart:

| variable                             | flag                  | default                 |
|--------------------------------------|-----------------------|-------------------------|
| PSTRAIN_OPERATOR_NAMESPACES          | --namespaces          | "" (all namespaces)     |
| PSTRAIN_OPERATOR_RUNTIME_IMAGE       | --runtime-image       | DEFAULT_RUNTIME_IMAGE   |
| PSTRAIN_OPERATOR_METRICS_PORT        | --metrics-port        | 8080 (0 disables)       |
| PSTRAIN_OPERATOR_HEALTH_PORT         | --health-port         | 8081 (0 disables)       |
| PSTRAIN_OPERATOR_LOG_LEVEL           | --log-level           | info                    |
| PSTRAIN_OPERATOR_LEADER_ELECTION     | --leader-election     | false                   |
| PSTRAIN_OPERATOR_JOB_POD_SECURITY    | --job-pod-security    | restricted              |
| PSTRAIN_OPERATOR_PROGRESS_INTERVAL   | --progress-interval   | 10 (seconds, 1 to 30)   |
| PSTRAIN_OPERATOR_JOB_NETWORK_POLICY  | --job-network-policy  | true                    |
| PSTRAIN_OPERATOR_PS_LIVENESS_SECONDS | --ps-liveness-seconds | 60 (0 off, 10 to 3600)  |
| PSTRAIN_OPERATOR_NAMESPACE           | (downward API)        | "" (unknown)            |

PSTRAIN_OPERATOR_NAMESPACE is the operator's own namespace (the chart sets it from the
pod's metadata); a job's NetworkPolicy admits the progress probe from it.

PROGRESS_INTERVAL and PS_LIVENESS_SECONDS are optional tuning (how often training
progress is refreshed while a job runs; how long a parameter server may leave its health
check unanswered before its kubelet kills it, see `build.liveness_probe`); the others
are the chart's contract.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pstrain_api import constants as c
from pstrain_api.names import dns_label_problem
from pstrain_api.quote import quote

ENV_NAMESPACES = "PSTRAIN_OPERATOR_NAMESPACES"
ENV_RUNTIME_IMAGE = "PSTRAIN_OPERATOR_RUNTIME_IMAGE"
ENV_METRICS_PORT = "PSTRAIN_OPERATOR_METRICS_PORT"
ENV_HEALTH_PORT = "PSTRAIN_OPERATOR_HEALTH_PORT"
ENV_LOG_LEVEL = "PSTRAIN_OPERATOR_LOG_LEVEL"
ENV_LEADER_ELECTION = "PSTRAIN_OPERATOR_LEADER_ELECTION"
ENV_JOB_POD_SECURITY = "PSTRAIN_OPERATOR_JOB_POD_SECURITY"
ENV_PROGRESS_INTERVAL = "PSTRAIN_OPERATOR_PROGRESS_INTERVAL"
ENV_JOB_NETWORK_POLICY = "PSTRAIN_OPERATOR_JOB_NETWORK_POLICY"
ENV_OPERATOR_NAMESPACE = "PSTRAIN_OPERATOR_NAMESPACE"
ENV_PS_LIVENESS = "PSTRAIN_OPERATOR_PS_LIVENESS_SECONDS"

LogLevel = Literal["debug", "info", "warning", "error"]
PodSecurity = Literal["restricted", "none"]
LOG_LEVELS: tuple[LogLevel, ...] = ("debug", "info", "warning", "error")
POD_SECURITY: tuple[PodSecurity, ...] = ("restricted", "none")
PEERING_NAME = "pstrain"


class SettingsError(ValueError):
    """A setting with a value the operator cannot run with; the message names it."""


@dataclass(frozen=True)
class PodSettings:
    """What the pure pod builder needs from the operator's configuration."""

    runtime_image: str = c.DEFAULT_RUNTIME_IMAGE
    pod_security: PodSecurity = "restricted"
    ps_liveness_seconds: int = 60  # 0: parameter servers get no livenessProbe


@dataclass(frozen=True)
class OperatorSettings:
    namespaces: tuple[str, ...] = ()
    runtime_image: str = c.DEFAULT_RUNTIME_IMAGE
    metrics_port: int = 8080
    health_port: int = 8081
    log_level: LogLevel = "info"
    leader_election: bool = False
    job_pod_security: PodSecurity = "restricted"
    progress_interval: float = 10.0
    job_network_policy: bool = True
    operator_namespace: str = ""
    ps_liveness_seconds: int = 60

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    @property
    def pods(self) -> PodSettings:
        return PodSettings(self.runtime_image, self.job_pod_security, self.ps_liveness_seconds)


def _port(name: str, raw: str) -> int:
    try:
        port = int(raw)
    except ValueError as exc:
        raise SettingsError(f"{name} is {quote(raw)}; it must be a port number (0 disables).") from exc
    if not 0 <= port <= 65535:
        raise SettingsError(f"{name} is {port}; it must be between 0 and 65535 (0 disables).")
    return port


def _bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off", ""):
        return False
    raise SettingsError(f"{name} is {quote(raw)}; it must be true or false.")


def _liveness(name: str, raw: str) -> int:
    try:
        seconds = int(raw)
    except ValueError as exc:
        raise SettingsError(f"{name} is {quote(raw)}; it must be a whole number of seconds "
                            "(0 disables).") from exc
    if seconds != 0 and not 10 <= seconds <= 3600:
        raise SettingsError(f"{name} is {seconds}; it must be 0 (no liveness probe) or "
                            "between 10 and 3600 seconds.")
    return seconds


def _choice(name: str, raw: str, allowed: Sequence[str]) -> str:
    value = raw.strip().lower()
    if value not in allowed:
        raise SettingsError(f"{name} is {quote(raw)}; it must be one of {', '.join(allowed)}.")
    return value


def _namespaces(name: str, raw: str) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(p.strip() for p in raw.split(",") if p.strip()))
    for ns in items:
        problem = dns_label_problem(ns)
        if problem:
            raise SettingsError(f"{name} contains {quote(ns)}; {problem} (namespaces are "
                                "comma-separated).")
    return items


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pstrain operator",
        description="Run the pstrain Kubernetes operator (kopf). Each flag overrides the "
        "environment variable named in its help.",
    )
    parser.add_argument("--namespaces", help=f"Comma-separated namespaces to serve; empty "
                        f"serves all namespaces. [{ENV_NAMESPACES}]")
    parser.add_argument("--runtime-image", help=f"Default image of job pods. [{ENV_RUNTIME_IMAGE}]")
    parser.add_argument("--metrics-port", help=f"Prometheus metrics port, 0 disables. "
                        f"[{ENV_METRICS_PORT}]")
    parser.add_argument("--health-port", help=f"Liveness /healthz port, 0 disables. "
                        f"[{ENV_HEALTH_PORT}]")
    parser.add_argument("--log-level", help=f"debug, info, warning or error. [{ENV_LOG_LEVEL}]")
    parser.add_argument("--leader-election", help=f"true: only one replica acts at a time "
                        f"(kopf peering named {PEERING_NAME!r}). [{ENV_LEADER_ELECTION}]")
    parser.add_argument("--job-pod-security", help=f"restricted: job pods get a restrictive "
                        f"securityContext unless their template sets one; none: no default. "
                        f"[{ENV_JOB_POD_SECURITY}]")
    parser.add_argument("--job-network-policy", help=f"true: a NetworkPolicy per job admits "
                        f"traffic to its parameter servers only from its own pods (and the "
                        f"operator). [{ENV_JOB_NETWORK_POLICY}]")
    parser.add_argument("--progress-interval", help=f"Seconds between training-progress "
                        f"refreshes while a job runs, 1 to 30. [{ENV_PROGRESS_INTERVAL}]")
    parser.add_argument("--ps-liveness-seconds", help=f"Seconds a parameter server may leave "
                        f"its gRPC health check unanswered before its kubelet kills it (the "
                        f"job's restart policy brings it back), 10 to 3600; 0: no liveness "
                        f"probe. [{ENV_PS_LIVENESS}]")
    return parser


def load_settings(argv: Sequence[str], environ: Mapping[str, str]) -> OperatorSettings:
    """Settings from flags over environment over defaults; SettingsError when invalid."""
    args = build_parser().parse_args(list(argv))
    defaults = OperatorSettings()

    def pick(flag: str | None, env: str, default: str) -> tuple[str, str]:
        if flag is not None:
            return f"--{env.removeprefix('PSTRAIN_OPERATOR_').lower().replace('_', '-')}", flag
        return env, environ.get(env, default)

    name, raw = pick(args.namespaces, ENV_NAMESPACES, "")
    namespaces = _namespaces(name, raw)
    name, raw = pick(args.runtime_image, ENV_RUNTIME_IMAGE, defaults.runtime_image)
    image = raw.strip()
    if not image:
        raise SettingsError(f"{name} is empty; it must name a container image.")
    name, raw = pick(args.metrics_port, ENV_METRICS_PORT, str(defaults.metrics_port))
    metrics_port = _port(name, raw)
    name, raw = pick(args.health_port, ENV_HEALTH_PORT, str(defaults.health_port))
    health_port = _port(name, raw)
    if metrics_port and metrics_port == health_port:
        raise SettingsError(
            f"the metrics port and the health port are both {metrics_port}; they must differ."
        )
    name, raw = pick(args.log_level, ENV_LOG_LEVEL, defaults.log_level)
    log_level = _choice(name, raw, LOG_LEVELS)
    name, raw = pick(args.leader_election, ENV_LEADER_ELECTION, "false")
    leader = _bool(name, raw)
    name, raw = pick(args.job_pod_security, ENV_JOB_POD_SECURITY, defaults.job_pod_security)
    security = _choice(name, raw, POD_SECURITY)
    name, raw = pick(args.progress_interval, ENV_PROGRESS_INTERVAL,
                     str(defaults.progress_interval))
    try:
        interval = float(raw)
    except ValueError as exc:
        raise SettingsError(f"{name} is {quote(raw)}; it must be a number of seconds.") from exc
    if not 1 <= interval <= 30:
        raise SettingsError(f"{name} is {raw}; it must be between 1 and 30 seconds (progress "
                            "is refreshed at least every 30 s).")
    name, raw = pick(args.job_network_policy, ENV_JOB_NETWORK_POLICY, "true")
    network_policy = _bool(name, raw)
    name, raw = pick(args.ps_liveness_seconds, ENV_PS_LIVENESS, str(defaults.ps_liveness_seconds))
    liveness = _liveness(name, raw)
    return OperatorSettings(
        job_network_policy=network_policy,
        operator_namespace=environ.get(ENV_OPERATOR_NAMESPACE, "").strip(),
        namespaces=namespaces,
        progress_interval=interval,
        runtime_image=image,
        metrics_port=metrics_port,
        health_port=health_port,
        log_level=log_level,  # type: ignore[arg-type]
        leader_election=leader,
        job_pod_security=security,  # type: ignore[arg-type]
        ps_liveness_seconds=liveness,
    )
