"""`segserve scheduler`: a local Ray instance hosting the SchedulerActor until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from scheduler.config import SchedulerConfig

logger = logging.getLogger(__name__)

_LIVENESS_CHECK_S = 5.0


def init_local_ray() -> None:
    """A private, localhost-only Ray instance: one CPU, no dashboard, no usage reporting, quiet logs."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level=logging.ERROR,
             _node_ip_address="127.0.0.1", configure_logging=True)


def run(config: SchedulerConfig) -> None:
    """Serve the Scheduler gRPC API from a Ray actor; block until SIGINT/SIGTERM, then shut down."""
    import ray

    from scheduler.actor import SchedulerActor

    init_local_ray()
    # After ray.init, which installs its own SIGTERM handler.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    exit_code = 0
    try:
        actor = SchedulerActor.options(name="segserve-scheduler").remote()
        port = ray.get(actor.start.remote(config))
        logger.info("scheduler serving on %s:%d (worker %s)", config.host, port, config.worker_address)
        while not stop.wait(_LIVENESS_CHECK_S):
            try:
                ray.get(actor.stats.remote(), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                logger.error("the scheduler actor is gone: %s", exc)
                exit_code = 1
                break
        if exit_code == 0:
            ray.get(actor.stop.remote(), timeout=10)
    finally:
        ray.shutdown()
    if exit_code:
        sys.exit(exit_code)
