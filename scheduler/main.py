"""`segserve scheduler`: a Ray actor hosting the scheduler until SIGINT/SIGTERM, which drain it first
(NOT_SERVING, new requests refused, config.drain_timeout_s for those under way; servicer.stop_server).

Ray is a private instance on this machine by default, or an existing cluster with --ray-address
(`ray start --head` on this machine, or a KubeRay cluster): the actor then runs there as a named
actor in the "segserve" namespace, on this process's own node when this process is a cluster
node (so its gRPC address is this host's), anywhere when connected through the Ray client
(ray://...; its address is then logged). This process supervises it and stops it on exit; a start that
takes longer than start_timeout_s (Ray's or the actor's) ends it with code 1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading

import psutil

from scheduler.config import SchedulerConfig
from common.ports import announce_ports
from common.tls import internal_tls

logger = logging.getLogger(__name__)

_LIVENESS_CHECK_S = 5.0
RAY_NAMESPACE = "segserve"


def init_local_ray() -> None:
    """A private, localhost-only Ray instance: one CPU, no dashboard, no usage reporting, quiet logs."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level=logging.ERROR,
             _node_ip_address="127.0.0.1", configure_logging=True)


def init_cluster_ray(address: str) -> None:
    """Join an existing Ray cluster (its GCS address, "auto" or a ray:// client address)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address=address, namespace=RAY_NAMESPACE, logging_level=logging.ERROR, configure_logging=True)


def actor_options(config: SchedulerConfig) -> dict:
    """The actor's name, and on a cluster node this node as its place."""
    import ray

    options = {"name": f"segserve-scheduler-{socket.gethostname()}-{os.getpid()}"}
    if config.ray_address and not config.ray_address.startswith("ray://"):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node_id = ray.get_runtime_context().get_node_id()
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    return options


def _give_up_start(timeout_s: float) -> None:
    """Exit with code 1 from a start that hangs (a scheduler once stayed unready for 300 s in CI, on a loaded
    2-core machine): a supervisor can start a new one, it cannot unstick this one. Every process this one
    started goes first: Ray's GCS and raylet die with their parent, but the raylet's agents outlive it."""
    logger.error("Ray and the scheduler actor did not start within start_timeout_s (%.0f s); exiting", timeout_s)
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    logging.shutdown()
    os._exit(1)


def run(config: SchedulerConfig) -> None:
    """Serve the Scheduler gRPC API from a Ray actor; block until SIGINT/SIGTERM, then shut down."""
    import ray

    from scheduler.actor import SchedulerActor

    tls = internal_tls(config)
    if tls is not None and not (config.ray_address or "").startswith("ray://"):
        tls.check()  # the actor runs on this node and reads them there: a clear error before Ray starts
    watchdog = threading.Timer(config.start_timeout_s, _give_up_start, (config.start_timeout_s,))
    watchdog.daemon = True
    watchdog.start()
    if config.ray_address:
        init_cluster_ray(config.ray_address)
    else:
        logger.info("starting a private Ray instance")
        init_local_ray()
    # After ray.init, which installs its own SIGTERM handler.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    exit_code = 0
    try:
        actor = SchedulerActor.options(**actor_options(config)).remote()
        port = ray.get(actor.start.remote(config))
        announce_ports(port=port)
        node_ip = ray.get(actor.node_ip.remote())
        watchdog.cancel()
        logger.info("scheduler serving on %s:%d, Ray node %s (worker %s)", config.host, port, node_ip,
                    config.worker_address)
        while not stop.wait(_LIVENESS_CHECK_S):
            try:
                ray.get(actor.stats.remote(), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                logger.error("the scheduler actor is gone: %s", exc)
                exit_code = 1
                break
        if exit_code == 0:
            ray.get(actor.stop.remote(), timeout=config.drain_timeout_s + 10)
    finally:
        ray.shutdown()
    if exit_code:
        sys.exit(exit_code)
