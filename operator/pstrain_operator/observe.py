"""What the reconcile decision sees of a pod: `observe_pod` reads the API object once,
so the decisions never parse raw pod JSON."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pstrain_api import constants as c

from .build import ANNOTATION_APPLIED_SPEC, ANNOTATION_SPEC_HASH, controller_uid

ACTIVE_PHASES = frozenset({"Pending", "Running", "Unknown"})


@dataclass(frozen=True)
class ObservedPod:
    """What the decision needs to know about one pod."""

    name: str
    role: str
    index: int
    phase: str = "Pending"
    ready: bool = False
    uid: str = ""
    exit_code: int | None = None
    reason: str = ""
    message: str = ""
    deleting: bool = False
    spec_hash: str = ""
    applied_spec: str = ""
    owner_uid: str = ""
    disruption: str = ""  # reason of a True DisruptionTarget condition (EvictionByEvictionAPI)
    disruption_message: str = ""
    finished_at: datetime | None = None  # when the container that explains the end did

    @property
    def active(self) -> bool:
        return not self.deleting and self.phase in ACTIVE_PHASES


def _terminated(pod: Mapping[str, Any]) -> tuple[int | None, str, str, datetime | None]:
    """Exit code, reason, message and finish time of the container that explains the
    pod's end: the main container when it terminated, else the first one that failed."""
    statuses = list((pod.get("status") or {}).get("containerStatuses") or [])
    statuses.sort(key=lambda s: s.get("name") != c.MAIN_CONTAINER)
    for cs in statuses:
        state = (cs.get("state") or {}).get("terminated") or (
            cs.get("lastState") or {}
        ).get("terminated")
        if state and (cs.get("name") == c.MAIN_CONTAINER or state.get("exitCode")):
            code = state.get("exitCode")
            return (
                int(code) if code is not None else None,
                str(state.get("reason") or ""),
                str(state.get("message") or ""),
                _timestamp(state.get("finishedAt")),
            )
    return None, "", "", None


def _timestamp(value: Any) -> datetime | None:
    """An RFC 3339 time of the API ("2026-01-01T12:00:00Z"), or None."""
    if isinstance(value, datetime):
        return value
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")) if value else None
    except ValueError:
        return None


def observe_pod(pod: Mapping[str, Any]) -> ObservedPod | None:
    """The pod as the decision sees it, or None when it is not a pstrain replica."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    role = labels.get(c.LABEL_ROLE)
    try:
        index = int(labels.get(c.LABEL_INDEX, ""))
    except ValueError:
        return None
    if role not in c.ROLES:
        return None
    status = pod.get("status") or {}
    ready = any(
        cond.get("type") == "Ready" and cond.get("status") == "True"
        for cond in status.get("conditions") or []
    )
    disruption = next((cond for cond in status.get("conditions") or []
                       if cond.get("type") == "DisruptionTarget"
                       and cond.get("status") == "True"), {})
    exit_code, reason, message, finished_at = _terminated(pod)
    phase = str(status.get("phase") or "Pending")
    if status.get("reason"):  # pod-level: Evicted, DeadlineExceeded, NodeLost, ...
        reason = str(status["reason"])
        message = str(status.get("message") or message)
    if phase == "Failed" and not reason:
        reason = "Error"
    return ObservedPod(
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid") or ""),
        role=role,
        index=index,
        phase=phase,
        ready=ready and phase == "Running",
        exit_code=exit_code,
        reason=reason,
        message=message,
        deleting=bool(meta.get("deletionTimestamp")),
        spec_hash=str(annotations.get(ANNOTATION_SPEC_HASH, "")),
        applied_spec=str(annotations.get(ANNOTATION_APPLIED_SPEC, "")),
        owner_uid=controller_uid(meta),
        disruption=str(disruption.get("reason") or ("DisruptionTarget" if disruption else "")),
        disruption_message=str(disruption.get("message") or ""),
        finished_at=finished_at,
    )
