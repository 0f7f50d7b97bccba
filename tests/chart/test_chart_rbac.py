"""The chart's RBAC grants exactly the operator's PERMISSIONS: nothing missing (the
operator would fail on a forbidden call), nothing extra (least privilege), in cluster
mode and in namespaced mode.

The operator's own tests keep PERMISSIONS equal to the calls it makes; this test keeps
the chart equal to PERMISSIONS. Together: a verb the code uses but the chart does not
grant fails a test.
"""

from __future__ import annotations

from typing import Any

import pytest

from .helm import RELEASE_NAMESPACE, generate, objects_of, one, render, require_helm

Grant = tuple[str, str, str]  # (apiGroup, resource, verb)
TEAM_NAMESPACES = ["team-a", "team-b"]
SERVICE_ACCOUNT = {"kind": "ServiceAccount", "name": "pstrain", "namespace": RELEASE_NAMESPACE}


def grants(rules: list[dict[str, Any]]) -> set[Grant]:
    out: set[Grant] = set()
    for rule in rules:
        assert "nonResourceURLs" not in rule and "resourceNames" not in rule, rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), f"wildcard in {rule}"
                    out.add((group, resource, verb))
    return out


def expected(permissions: list[tuple[str, str, tuple[str, ...]]]) -> set[Grant]:
    return {(g, r, v) for g, r, verbs in permissions for v in verbs}


PERMISSIONS = generate.load_permissions()
NAMESPACED, CLUSTER = generate.split_permissions(PERMISSIONS)


@pytest.fixture(scope="module", autouse=True)
def _helm() -> None:
    require_helm()


def test_permissions_table_is_not_empty() -> None:
    assert PERMISSIONS
    assert ("pstrain.io", "trainingjobs", "watch") in expected(PERMISSIONS)


def test_cluster_mode_grants_exactly_the_permissions() -> None:
    objs = render()
    role = one(objs, "ClusterRole")
    assert grants(role["rules"]) == expected(PERMISSIONS)
    assert objects_of(objs, "Role") == [] and objects_of(objs, "RoleBinding") == []
    binding = one(objs, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole", "name": role["metadata"]["name"]}
    assert binding["subjects"] == [SERVICE_ACCOUNT]


def test_namespaced_mode_grants_exactly_the_permissions_per_namespace() -> None:
    objs = render({"watchNamespaces": TEAM_NAMESPACES})
    roles = {r["metadata"]["namespace"]: r for r in objects_of(objs, "Role")}
    bindings = {b["metadata"]["namespace"]: b for b in objects_of(objs, "RoleBinding")}
    assert sorted(roles) == sorted(bindings) == TEAM_NAMESPACES
    for ns in TEAM_NAMESPACES:
        assert grants(roles[ns]["rules"]) == expected(NAMESPACED), ns
        assert bindings[ns]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                           "kind": "Role",
                                           "name": roles[ns]["metadata"]["name"]}
        assert bindings[ns]["subjects"] == [SERVICE_ACCOUNT]
    cluster_roles = objects_of(objs, "ClusterRole")
    if CLUSTER:
        assert len(cluster_roles) == 1
        assert grants(cluster_roles[0]["rules"]) == expected(CLUSTER)
        assert one(objs, "ClusterRoleBinding")["subjects"] == [SERVICE_ACCOUNT]
    else:
        assert cluster_roles == [] and objects_of(objs, "ClusterRoleBinding") == []
    granted = set().union(*(grants(r["rules"]) for r in [*roles.values(), *cluster_roles]))
    assert granted == expected(PERMISSIONS)


def test_namespaced_mode_grants_nothing_cluster_wide_on_namespaced_resources() -> None:
    objs = render({"watchNamespaces": TEAM_NAMESPACES})
    cluster_wide = set().union(set(), *(grants(r["rules"])
                                        for r in objects_of(objs, "ClusterRole")))
    namespaced_resources = {(g, r) for g, r, _ in NAMESPACED}
    assert {(g, r) for g, r, _ in cluster_wide} & namespaced_resources == set()


def test_every_resource_has_a_known_scope() -> None:
    # split_permissions raises for a resource it cannot place; it placed them all.
    assert {(g, r) for g, r, _ in NAMESPACED} <= generate.NAMESPACED
    assert {(g, r) for g, r, _ in CLUSTER} <= generate.CLUSTER_SCOPED


def test_leader_election_peering_is_granted_where_the_peering_object_lives() -> None:
    """kopf patches the status of the peering object: ClusterKopfPeering cluster-wide,
    KopfPeering in each served namespace."""
    table = expected(PERMISSIONS)
    if not any(r.endswith("kopfpeerings") for _, r, _ in table):
        pytest.skip("PERMISSIONS grants no kopf peering (the operator has no leader election)")
    assert ("kopf.dev", "clusterkopfpeerings", "patch") in table
    assert ("kopf.dev", "kopfpeerings", "patch") in table


def test_two_namespaced_installs_do_not_collide_on_cluster_scoped_names() -> None:
    """One operator per team, each in its own namespace, serving only that namespace."""
    def cluster_scoped_names(objs: list[dict[str, Any]]) -> set[tuple[str, str]]:
        return {(o["kind"], o["metadata"]["name"]) for o in objs
                if "namespace" not in o["metadata"]}

    team_a = cluster_scoped_names(render({"watchNamespaces": ["team-a"]}))
    team_b = cluster_scoped_names(render({"watchNamespaces": ["team-b"]}, namespace="team-b"))
    assert team_a and team_a.isdisjoint(team_b)
