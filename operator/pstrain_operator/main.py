"""`pstrain operator`: read the settings, wire the Reconciler to kopf, run.

Never imports torch (the operator image has none): the runtime's status client is
imported lazily and is torch-free.
"""

from __future__ import annotations

import logging
import os
import secrets
import sys
from collections.abc import Sequence

from .settings import PEERING_NAME, OperatorSettings, SettingsError, load_settings

log = logging.getLogger("pstrain_operator")

# Peering priorities: kopf pauses an operator that sees a peer of higher OR EQUAL
# priority, so replicas draw distinct random priorities; the highest one acts.
PRIORITY_RANGE = 1 << 30


def _configure_logging(settings: OperatorSettings) -> None:
    level = getattr(logging, settings.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
                        stream=sys.stderr)


def run(settings: OperatorSettings) -> None:
    """Run the operator until it is stopped (SIGTERM/SIGINT)."""
    import kopf

    from .controller import Reconciler
    from .handlers import RequeueIsNotAnError, install, kopf_settings, post_event
    from .kube import RestKube
    from .metrics import Metrics
    from .progress import default_asker, default_fetcher, default_worker_setter

    metrics = Metrics()
    install(Reconciler(kube=RestKube.from_environment(), pod_settings=settings.pods,
                       emit=post_event, fetch_status=default_fetcher(),
                       ask_checkpoint=default_asker(), set_workers=default_worker_setter(),
                       metrics=metrics,
                       progress_interval=settings.progress_interval,
                       network_policy=settings.job_network_policy,
                       operator_namespace=settings.operator_namespace))
    logging.getLogger("kopf.objects").addFilter(RequeueIsNotAnError())
    if settings.metrics_port:
        metrics.serve(settings.metrics_port)
    liveness = (f"http://0.0.0.0:{settings.health_port}/healthz"
                if settings.health_port else None)
    priority = secrets.randbelow(PRIORITY_RANGE) + 1
    log.info("serving %s; leader election %s (peering priority %d)",
             ", ".join(settings.namespaces) or "all namespaces",
             "on" if settings.leader_election else "off", priority)
    kopf.run(
        clusterwide=settings.clusterwide,
        namespaces=list(settings.namespaces),
        standalone=not settings.leader_election,
        # Naming a peering makes it mandatory in kopf; only with leader election.
        peering_name=PEERING_NAME if settings.leader_election else None,
        priority=priority,
        liveness_endpoint=liveness,
        settings=kopf_settings(settings.leader_election),
    )


def operator_main(argv: Sequence[str]) -> int:
    try:
        settings = load_settings(argv, os.environ)
    except SettingsError as exc:
        print(f"pstrain operator: {exc}", file=sys.stderr)
        return 2
    _configure_logging(settings)
    run(settings)
    return 0
