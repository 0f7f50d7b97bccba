"""The chart's job monitoring: a PodMonitor for the training pods' /metrics and the
Grafana dashboard ConfigMap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pstrain_api import constants as c

from .helm import CHART, objects_of, one, render, require_helm

DASHBOARD = CHART / "files" / "grafana-dashboard.json"


@pytest.fixture(autouse=True)
def _helm() -> None:
    require_helm()


def test_nothing_by_default() -> None:
    objs = render()
    assert objects_of(objs, "PodMonitor") == []
    assert [o for o in objects_of(objs, "ConfigMap")
            if o["metadata"]["name"].endswith("-dashboard")] == []


def test_pod_monitor_scrapes_every_training_pod() -> None:
    objs = render({"metrics": {"jobPodMonitor": {"enabled": True,
                                                 "labels": {"release": "prom"}}}})
    monitor = one(objs, "PodMonitor")
    spec = monitor["spec"]
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert spec["selector"]["matchLabels"] == {c.LABEL_MANAGED_BY: c.MANAGED_BY}
    assert spec["namespaceSelector"] == {"any": True}
    assert spec["podMetricsEndpoints"] == [
        {"port": c.METRICS_PORT_NAME, "path": "/metrics", "interval": "15s"}]
    assert c.LABEL_JOB in spec["podTargetLabels"]


def test_dashboard_config_map_holds_the_dashboard() -> None:
    objs = render({"metrics": {"dashboard": {"enabled": True}}})
    (cm,) = [o for o in objects_of(objs, "ConfigMap")
             if o["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["pstrain-training-jobs.json"]) == json.loads(
        DASHBOARD.read_text())


def test_dashboard_shows_step_rate_loss_samples_and_ps_traffic() -> None:
    dash = json.loads(Path(DASHBOARD).read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for metric in ("pstrain_ps_global_step", "pstrain_worker_loss",
                   "pstrain_worker_samples_total", "pstrain_ps_received_bytes_total",
                   "pstrain_ps_sent_bytes_total", "pstrain_worker_compute_seconds_sum"):
        assert metric in exprs, metric
    # Every metric the dashboard reads is one the runtime exports.
    from prometheus_client import CollectorRegistry

    from pstrain_runtime.metrics import PSMetrics, WorkerMetrics

    registry = CollectorRegistry()
    PSMetrics(registry), WorkerMetrics(registry)
    exported = {s.name for m in registry.collect() for s in m.samples}
    exported |= {m.name for m in registry.collect()}
    import re
    used = set(re.findall(r"pstrain_[a-z_]+", exprs)) - {"pstrain_io_job_name"}
    assert used <= exported, used - exported
