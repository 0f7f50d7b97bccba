"""Rules that hold on Kubernetes only: the operator refuses a job that breaks one before
it creates anything (`validate.check_for_kubernetes`, the InvalidSpec condition), while
`pstrain run` accepts it and fills in what is missing (a temporary folder for the rows
beyond `sparseStorage.serverMemory`).

They are not CEL rules of the CRD: the API model, and with it the local runner, must
keep accepting these jobs, "at or under a mountPath" needs path normalisation that CEL
does not have, and Helm never upgrades an installed CRD, so only the operator reaches
every cluster (and every job stored before the rule).

Pure: a validated TrainingJob in, (field path, sentence) pairs out.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from . import template as tpl
from .model import TrainingJob
from .quote import quote

DIRECTORY = "spec.training.sparseStorage.directory"
PS_TEMPLATE = "spec.replicas.ps.template"
MISSING_RULE = ("with serverMemory set, each parameter server keeps the rows beyond it "
                f"there: mount a volume (an emptyDir or a PVC) in {PS_TEMPLATE} and set "
                "directory to its mountPath (only `pstrain run` makes a temporary one)")
MOUNT_RULE = ("it must be at or under the mountPath of a volumeMounts entry of the "
              f"parameter servers' main container: mount a volume there in {PS_TEMPLATE}")
READ_ONLY_RULE = "the parameter servers write their rows there: mount it without readOnly"


def _mounts(job: TrainingJob) -> list[Mapping[str, Any]]:
    """The volumeMounts of the parameter servers' main container (the template's first)."""
    mounts = tpl.main_container(job.spec.replicas.ps.template).get("volumeMounts")
    return [m for m in mounts or [] if isinstance(m, Mapping)
            and isinstance(m.get("mountPath"), str) and m["mountPath"]]


def mount_of(directory: str, mounts: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The mount that holds absolute `directory` (the deepest one at or above it, as the
    kernel resolves nested mounts), or None."""
    if not directory.startswith("/"):
        return None
    path = posixpath.normpath(directory)
    found, depth = None, -1
    for mount in mounts:
        base = posixpath.normpath(mount["mountPath"])
        if (path == base or path.startswith(base.rstrip("/") + "/")) and len(base) > depth:
            found, depth = mount, len(base)
    return found


def rows_directory_problem(job: TrainingJob) -> tuple[str, str] | None:
    """The problem of `sparseStorage.directory` on Kubernetes, or None."""
    storage = job.spec.training.sparse_storage
    if storage.server_memory is None:
        return None
    if storage.directory is None:
        return DIRECTORY, f"{DIRECTORY} is missing; {MISSING_RULE}"
    mounts = _mounts(job)
    mount = mount_of(storage.directory, mounts)
    shown = f"{DIRECTORY} is {quote(storage.directory)}"
    if mount is None:
        paths = ", ".join(quote(m["mountPath"]) for m in mounts[:6]) or "none"
        return DIRECTORY, f"{shown}; {MOUNT_RULE} (the main container's mountPaths: {paths})"
    if mount.get("readOnly") is True:
        return DIRECTORY, (f"{shown}, under the read-only mount "
                           f"{quote(mount['mountPath'])}; {READ_ONLY_RULE}")
    return None


def kubernetes_problems(job: TrainingJob) -> list[tuple[str, str]]:
    """Every rule of this module that `job` breaks, as (field path, sentence)."""
    found = rows_directory_problem(job)
    return [found] if found else []
