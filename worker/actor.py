"""The worker as a Ray actor: its gRPC server and model live in the actor, on a node Ray chooses.

`segserve serve --ray-address ADDR --ray-workers` places the workers this way (asking for one GPU
each when the cluster has GPUs); the scheduler reaches each by the address `start` returns, exactly
as it reaches a worker process or pod. A worker of N tensor-parallel ranks gets a placement group of
N bundles packed on one node (segserve/launcher.py): the actor, rank 0, sits in bundle 0 and starts
ranks 1..N-1 as RankActors in the others (worker/ranks.py says how they work together).
"""

from __future__ import annotations

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common import tracing
from common.blocking import in_thread
from common.tls import internal_tls
from worker.config import WorkerConfig
from worker.follower import follow
from worker.loading import resolve_device_dtype
from worker.ranks import RankAddress, launch_process
from worker.server import WorkerServicer, load_runner, start_server


@ray.remote(num_cpus=0)
class WorkerActor:
    """`start(config) -> "ip:port"` once the model is loaded and warmed up; `stop()`."""

    def __init__(self):
        self._server = None
        self._servicer = WorkerServicer()

    async def start(self, config: WorkerConfig) -> str:
        """Bind the gRPC server, load and warm up the model, report SERVING; returns the address to dial."""
        if self._server is not None:
            raise RuntimeError("the worker actor is already started")
        tracing.setup("worker", config)
        self._server, port = await start_server(self._servicer, config.host, config.port, internal_tls(config))
        launch = launch_process if ray.util.get_current_placement_group() is None else launch_rank_actor
        runner = await in_thread(self._servicer.compute, load_runner, config, launch)
        self._servicer.attach(runner)
        await self._servicer.serving.set(True)
        host = ray.util.get_node_ip_address() if config.host in ("0.0.0.0", "::") else config.host
        return f"{host}:{port}"

    async def stop(self) -> None:
        if self._server is not None:
            await self._servicer.serving.set(False)
            await self._server.stop(grace=1.0)
            self._server = None
        tracing.shutdown()


@ray.remote(num_cpus=0)
class RankActor:
    """A follower rank of a WorkerActor, in bundle `rank` of the worker's placement group."""

    def follow(self, config: WorkerConfig, rank: int, address: RankAddress) -> None:
        """Run as the rank until rank 0 stops or is gone, then end the actor."""
        device, _ = resolve_device_dtype(config)
        follow(config, rank, address, device=torch.device("cuda", 0) if device.type == "cuda" else device)
        ray.actor.exit_actor()


def launch_rank_actor(config: WorkerConfig, rank: int, address: RankAddress) -> ray.actor.ActorHandle:
    """worker/ranks.py's Launch on Ray: follower `rank` in bundle `rank` of this actor's placement group, with the
    bundle's GPU where it has one (Ray shows the actor that one GPU alone, as cuda:0)."""
    group = ray.util.get_current_placement_group()
    num_gpus = group.bundle_specs[rank].get("GPU", 0)
    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank)
    actor = RankActor.options(scheduling_strategy=strategy, num_gpus=num_gpus,
                              name=f"segserve-rank-{address.channel_port}-{rank}").remote()
    actor.follow.remote(config, rank, address)
    return actor
