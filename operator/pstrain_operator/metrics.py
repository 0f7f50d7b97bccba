"""Prometheus metrics of the operator (prometheus-client, its own registry).

- `pstrain_operator_jobs{phase}`: TrainingJobs this operator sees, by phase;
- `pstrain_operator_reconcile_total{outcome}`: reconciles, outcome ok or error;
- `pstrain_operator_reconcile_errors_total`: failed reconciles;
- `pstrain_operator_reconcile_seconds`: reconcile latency histogram;
- `pstrain_operator_pods_created_total{role}`: pods created.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pstrain_api import constants as c


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.jobs = Gauge("pstrain_operator_jobs", "TrainingJobs by phase.", ["phase"],
                          registry=self.registry)
        self.reconciles = Counter("pstrain_operator_reconcile", "Reconciles by outcome.",
                                  ["outcome"], registry=self.registry)
        self.errors = Counter("pstrain_operator_reconcile_errors", "Failed reconciles.",
                              registry=self.registry)
        self.latency = Histogram("pstrain_operator_reconcile_seconds", "Reconcile latency.",
                                 registry=self.registry)
        self.pods_created = Counter("pstrain_operator_pods_created", "Pods created.", ["role"],
                                    registry=self.registry)
        self._phases: dict[str, str] = {}
        self._lock = threading.Lock()
        for phase in c.PHASES:
            self.jobs.labels(phase).set(0)

    def job_phase(self, key: str, phase: str | None) -> None:
        """Record `key`'s phase (None: the job is gone) and refresh the gauge."""
        with self._lock:
            if phase is None:
                self._phases.pop(key, None)
            else:
                self._phases[key] = phase
            for p in c.PHASES:
                self.jobs.labels(p).set(sum(1 for v in self._phases.values() if v == p))

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
