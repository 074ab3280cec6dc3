"""The worker as a Ray actor: its gRPC server and model live in the actor, on a node Ray chooses.

`segserve serve --ray-address ADDR --ray-workers` places the workers this way (asking for one GPU
each when the cluster has GPUs); the scheduler reaches each by the address `start` returns, exactly
as it reaches a worker process or pod.
"""

from __future__ import annotations

import asyncio

import ray

from common import tracing
from common.tls import internal_tls
from worker.config import WorkerConfig
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
        runner = await asyncio.to_thread(load_runner, config)
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
