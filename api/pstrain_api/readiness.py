"""What "ready" means for a replica, and what "done" means for the job's other replicas.

A replica runs either the pstrain runtime (`pstrain replica`, the default command) or a
program of the user's own, such as an unmodified TensorFlow parameter-server program
that reads TF_CONFIG and serves on its port with `tf.distribute.Server`. The two differ
in two ways that the local runner and the operator must both respect:

- readiness: the runtime serves the gRPC health service; a user's program only listens
  on its port (or brings its own readinessProbe); a job may also ask for no gate;
- ending: the runtime's replicas exit by themselves once the chief is done; TensorFlow's
  PS (and TF2 worker) servers never do, so they are stopped when the chief exits 0 and
  the job is still Succeeded.

Pure: the job in, plain values out.
"""

from __future__ import annotations

from typing import Any

from . import constants as c
from .model import ReplicaSpec
from .template import main_container


def runs_pstrain_runtime(spec: ReplicaSpec) -> bool:
    """The role runs `pstrain replica`: its main container sets no command of its own."""
    return not main_container(spec.template).get("command")


def user_command(spec: ReplicaSpec) -> list[str] | None:
    """The main container's own command and args, when it sets a command."""
    main = main_container(spec.template)
    if not main.get("command"):
        return None
    return [*main["command"], *(main.get("args") or [])]


def user_probe(spec: ReplicaSpec) -> dict[str, Any] | None:
    """The readinessProbe the user set on the main container, if any."""
    probe = main_container(spec.template).get("readinessProbe")
    return dict(probe) if probe else None


def readiness_gate(spec: ReplicaSpec) -> str:
    """One of GATE_GRPC, GATE_TCP, GATE_PROBE, GATE_NONE for the role's replicas.

    An explicit `readiness` wins, then the template's readinessProbe, then the program:
    the runtime's gRPC health service, or a TCP check of the replica port."""
    if spec.readiness != "Auto":
        return spec.readiness
    if user_probe(spec) is not None:
        return c.GATE_PROBE
    return c.GATE_GRPC if runs_pstrain_runtime(spec) else c.GATE_TCP


def local_check(spec: ReplicaSpec) -> str:
    """The check the local runner can carry out for the role: a probe the user wrote for
    a pod is read as its nearest local equivalent (grpc: the health service; tcpSocket,
    httpGet or exec: the replica port accepting TCP connections)."""
    gate = readiness_gate(spec)
    if gate != c.GATE_PROBE:
        return gate
    probe = user_probe(spec) or {}
    return c.GATE_GRPC if "grpc" in probe else c.GATE_TCP


def describe_check(gate: str) -> str:
    """The check as the words of a message: '... did not <describe> on ADDRESS'."""
    return {
        c.GATE_GRPC: "report SERVING",
        c.GATE_TCP: "accept TCP connections",
        c.GATE_PROBE: "pass its readinessProbe",
        c.GATE_NONE: "start",
    }[gate]


def stopped_on_success(spec: ReplicaSpec) -> bool:
    """Replicas of the role are stopped as soon as the chief exits 0, rather than given
    time to exit by themselves: a user's server program never ends on its own."""
    return not runs_pstrain_runtime(spec)
