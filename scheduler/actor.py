"""The scheduler as a Ray async actor: engine and gRPC server live on the actor's event loop.

The router reaches it by its gRPC address (host:port returned by `start`);
Ray only hosts and supervises it.
"""

from __future__ import annotations

import dataclasses

import ray

from scheduler.config import SchedulerConfig
from scheduler.servicer import start_server, stop_server
from common import tracing
from common.heap import freeze_startup_heap


@ray.remote(num_cpus=0)
class SchedulerActor:
    """`start(config) -> port`, `stats() -> dict`, `stop()`; all run on one asyncio loop."""

    def __init__(self):
        self._server = None
        self._engine = None
        self._drain_timeout_s = 0.0

    async def start(self, config: SchedulerConfig) -> int:
        """Build the engine, serve gRPC on config.host:config.port; returns the bound port."""
        if self._server is not None:
            raise RuntimeError("the scheduler actor is already started")
        tracing.setup("scheduler", config)  # in the actor's process, where the spans are made
        self._server, self._engine = await start_server(config)
        freeze_startup_heap()  # this process serves the scheduler alone: its start-up heap stays out of collections
        self._drain_timeout_s = config.drain_timeout_s
        return self._server.bound_port

    async def node_ip(self) -> str:
        """The IP address of the Ray node the actor runs on."""
        return ray.util.get_node_ip_address()

    async def stats(self) -> dict:
        """The engine's EngineStats as a dict (zeros before start)."""
        return dataclasses.asdict(self._engine.stats()) if self._engine else {}

    async def stop(self) -> None:
        """Drain (config.drain_timeout_s for the requests under way; new ones refused), then stop; the spans still
        queued are exported."""
        if self._server is not None:
            await stop_server(self._server, self._engine, drain_timeout_s=self._drain_timeout_s)
            self._server = self._engine = None
        tracing.shutdown()
