"""The CRD on a real API server: accepted, Established, within its size budget."""

from __future__ import annotations

import json

from pstrain_api import crd

from .conftest import CRD_NAME, Cluster


def test_the_crd_is_accepted_and_established(cluster: Cluster) -> None:
    found = cluster.get_json(f"crd/{CRD_NAME}")
    conditions = {c["type"]: c["status"] for c in found["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"
