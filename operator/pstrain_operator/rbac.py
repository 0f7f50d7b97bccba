"""Every Kubernetes API permission the operator uses, kopf's own calls included.

This table is the source of the Helm chart's RBAC (`charts/generate.py` renders it and
the chart's tests check the chart grants exactly this). The operator's integration
test records every request the operator makes to the emulated API server and fails
when one is not covered here, so the table stays derived from the code.

Each entry: (apiGroup, resource, verbs). "" is the core group.

Who needs what:
- trainingjobs: kopf lists/watches them and patches its progress annotations
  (`pstrain.io/...`); the operator gets a job afresh on each reconcile and deletes it
  when ttlSecondsAfterFinished has passed.
- trainingjobs/status: the operator's single status write (JSON merge patch).
- trainingjobs/finalizers: never called. The operator's children name their job with
  `blockOwnerDeletion: true`, and a cluster with the OwnerReferencesPermissionEnforcement
  admission plugin (OpenShift's default) refuses that from anyone who may not `update`
  the owner's finalizers: without it no job of such a cluster would get a single pod.
- pods: kopf lists/watches them (pod events wake the owning job); the operator lists
  them by label selector, creates and deletes them.
- services: the operator gets and creates the headless Service.
- secrets: the operator gets and creates each job's credentials Secret (deleted with
  the job by garbage collection, through its ownerReference, so no delete). `get` also
  reads the job's worker key for the progress probe. Namespaced mode grants this in the
  watched namespaces' Roles; all-namespaces mode puts it, as it does pods, in the
  ClusterRole, because Secrets are made in whichever namespace a job is.
- networkpolicies: the operator gets and creates each job's NetworkPolicy (when
  PSTRAIN_OPERATOR_JOB_NETWORK_POLICY is true; garbage-collected with the job).
- podgroups (Volcano, scheduler-plugins): the operator creates a gang-started job's
  PodGroup (spec.runPolicy.gangScheduling).
- events: kopf posts the operator's decisions (core/v1 Events).
- customresourcedefinitions, namespaces: kopf's resource and namespace discovery.
- kopfpeerings (namespaced, when PSTRAIN_OPERATOR_NAMESPACES is set) and
  clusterkopfpeerings (cluster-wide, when it is empty): kopf peering, used for leader
  election (PSTRAIN_OPERATOR_LEADER_ELECTION=true). kopf keeps its record in them
  (list/watch, patch); `get` follows kopf's documented RBAC for peering.
"""

from __future__ import annotations

from typing import Final

Permission = tuple[str, str, tuple[str, ...]]

PERMISSIONS: Final[tuple[Permission, ...]] = (
    ("pstrain.io", "trainingjobs", ("get", "list", "watch", "patch", "delete")),
    ("pstrain.io", "trainingjobs/status", ("patch",)),
    ("pstrain.io", "trainingjobs/finalizers", ("update",)),
    ("", "pods", ("list", "watch", "create", "delete")),
    ("", "services", ("get", "create")),
    ("", "secrets", ("get", "create")),
    ("networking.k8s.io", "networkpolicies", ("get", "create")),
    ("scheduling.volcano.sh", "podgroups", ("create",)),
    ("scheduling.x-k8s.io", "podgroups", ("create",)),
    ("", "events", ("create",)),
    ("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch")),
    ("", "namespaces", ("list", "watch")),
    ("kopf.dev", "kopfpeerings", ("get", "list", "watch", "patch")),
    ("kopf.dev", "clusterkopfpeerings", ("get", "list", "watch", "patch")),
)

CLUSTER_SCOPED: Final = frozenset({
    ("", "namespaces"),
    ("apiextensions.k8s.io", "customresourcedefinitions"),
    ("kopf.dev", "clusterkopfpeerings"),
})


def allows(group: str, resource: str, verb: str) -> bool:
    """Whether PERMISSIONS grants `verb` on `group`/`resource` (resource may carry a
    subresource: `trainingjobs/status`)."""
    return any(g == group and r == resource and verb in verbs for g, r, verbs in PERMISSIONS)
