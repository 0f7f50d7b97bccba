"""Leader election on a real API server: two `pstrain operator` processes with
`leaderElection.enabled` (kopf peering), each logged in with a token of the chart's
ServiceAccount so that the API server judges what the chart grants, serving all
namespaces (the chart's ClusterKopfPeering) or two listed ones (its KopfPeering in
each). The one of the higher (random) peering priority leads and the other waits; the
leader makes a job's pods; once it stops, the other takes over and makes the next job's.

The chart and its peering objects live on a second kube-apiserver
(`apiserver.second_api_server`), a world of their own that no other test's operator
watches. Pods stay Pending (no node): the tests are about who acts.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.operator.conftest import OperatorProcess

from .apiserver import (apply_example, job_namespace, operator_log, second_api_server,
                        token_kubeconfig, wait_for_crd)
from .conftest import Cluster, wait_until
from .test_kube_chart import install

PAUSED = "Pausing operations in favour of"
RESUMED = "Resuming operations after the pause"
WAIT = 60


@dataclass
class Peers:
    cluster: Cluster
    operators: list[OperatorProcess]
    namespaces: list[str]  # where jobs go: the watched ones ([] when all are)

    def log(self, op: OperatorProcess) -> str:
        return op.log_tail(100_000)

    def apply_job(self, name: str, k: int) -> str:
        """The digits example as job `name` in the k-th watched namespace (or a new one
        when all are watched); that namespace."""
        namespace = self.namespaces[k] if self.namespaces else job_namespace(
            self.cluster, "lead")
        apply_example(self.cluster, namespace, name)
        return namespace

    def wait(self, what: str, predicate: Any) -> Any:
        """wait_until, with both operators' logs and the peerings in its failure."""
        try:
            return wait_until(what, predicate, timeout=WAIT)
        except AssertionError as exc:
            tails = "\n".join(f"--- operator {k}\n" + operator_log(op, 300)
                               for k, op in enumerate(self.operators))
            peerings = self.cluster.kubectl("get", "clusterkopfpeerings,kopfpeerings", "-A",
                                            "-o", "yaml", check=False).stdout
            raise AssertionError(f"{exc}\n{tails}\n--- peerings\n{peerings}") from None

    def wait_for_pod(self, namespace: str, name: str) -> None:
        self.wait(f"pod {name}", lambda: self.cluster.kubectl(
            "get", "pod", name, namespace=namespace, check=False).returncode == 0)


@pytest.fixture(scope="module", params=["all-namespaces", "namespaced"])
def peers(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Peers]:
    """The chart with leader election, serving all namespaces (one ClusterKopfPeering)
    or two listed ones (a KopfPeering and a Role in each), and two operators."""
    work = Path(tempfile.mkdtemp(prefix="pstrain-leader-"))
    operators: list[OperatorProcess] = []
    try:
        with second_api_server(cluster, work) as second:
            watched = ([job_namespace(second, "lead") for _ in range(2)]
                       if request.param == "namespaced" else [])
            release = install(second, {"leaderElection": {"enabled": True},
                                       "watchNamespaces": watched})
            for namespace in watched or [None]:  # the chart made the peering objects
                second.kubectl("get", "kopfpeering/pstrain" if namespace
                               else "clusterkopfpeering/pstrain", namespace=namespace)
            wait_for_crd(second)
            kubeconfig = token_kubeconfig(second, release.service_account,
                                          work / "operator.kubeconfig")
            try:  # (stopped while their API server still answers)
                for k in range(2):
                    (work / f"op{k}").mkdir()
                    operators.append(OperatorProcess(
                        kubeconfig, work / f"op{k}",
                        extra_env={"PSTRAIN_OPERATOR_NAMESPACES": ",".join(watched),
                                   "PSTRAIN_OPERATOR_LEADER_ELECTION": "true"}))
                    operators[-1].start()
                yield Peers(second, operators, watched)
            finally:
                for op in operators:
                    op.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def priority(log: str) -> int:
    found = re.search(r"peering priority (\d+)", log)
    assert found, "the operator did not say its peering priority"
    return int(found.group(1))


def acting(log: str) -> bool:
    """kopf starts a peer paused, logs when it resumes, and logs a pause only when it
    was acting; the last of those says whether it acts (in every namespace it serves:
    one peer has one priority everywhere)."""
    return log.rfind(RESUMED) > log.rfind(PAUSED)


def test_one_operator_leads_and_the_other_takes_over_when_it_stops(peers: Peers) -> None:
    follower, leader = sorted(peers.operators, key=lambda op: priority(peers.log(op)))
    peers.wait("the operator of the higher priority alone to act", lambda: acting(
        peers.log(leader)) and not acting(peers.log(follower)))

    namespace = peers.apply_job("led", 0)
    peers.wait_for_pod(namespace, "led-ps-0")
    assert f"{namespace}/led" in peers.log(leader)
    assert f"{namespace}/led" not in peers.log(follower)  # it waited

    seen = len(peers.log(follower))
    leader.stop()  # a clean exit takes its record out of the peering at once
    peers.wait("the other operator to resume",
               lambda: RESUMED in peers.log(follower)[seen:])
    namespace = peers.apply_job("after", 1)
    peers.wait_for_pod(namespace, "after-ps-0")
    assert f"{namespace}/after" in peers.log(follower)
