"""The Scheduler gRPC service: thin methods that validate, delegate to the Engine and convert.

Requests arrive as GenerateRequest.from_pb and pass generate.validate_request (an
InvalidParameter becomes INVALID_ARGUMENT with its message, naming the field);
events leave as the contract events' to_pb(). Cancelling a Generate call (the
client going away) cancels the handler; its `finally` aborts the request, which
frees the slot and KV blocks at once. GenerateStreams carries many requests over
one call, each step's events in one message (scheduler/streams.py).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from protos.segserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from protos.segserve.v1.generate import GenerateRequest, validate_request
from protos.segserve.v1.sampling import InvalidParameter
from protos.segserve.v1.stats import DrafterReplicaStats
from scheduler import traces
from scheduler.config import SchedulerConfig
from scheduler.convert import stats_to_pb
from scheduler.drafter_client import DrafterClient
from scheduler.engine import Engine, EngineNotReady
from scheduler.group import EngineGroup
from scheduler.scheduler import QueueFull
from scheduler.streams import StreamsCall
from scheduler.worker_client import WorkerClient
from common.health import Serving, start_serving
from common.tls import EXCLUSIVE_PORT, internal_tls

logger = logging.getLogger(__name__)

_DRAFTER_STATS_TIMEOUT_S = 0.5  # a drafter slower than this shows without stats; GetStats itself stays quick


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, engine: Engine | EngineGroup):
        self.engine = engine
        self._calls: set[StreamsCall] = set()
        self._is_draining = False
        self.serving = Serving([scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name])
        """The standard grpc.health.v1 status: overall ("") SERVING while the server is up (start_server to
        stop_server: a liveness probe's); the Scheduler service's SERVING while, besides, a worker is connected
        and the server is not draining (a readiness probe's; watch_workers keeps it). The Health RPC says more:
        whether a connected worker is ready."""

    @property
    def is_draining(self) -> bool:
        """Set by stop_server: new requests are refused while the ones under way finish; a GenerateStreams call
        ends once none of its requests is live."""
        return self._is_draining

    @is_draining.setter
    def is_draining(self, value: bool) -> None:
        self._is_draining = value
        for call in self._calls:
            call.wake()

    async def Generate(self, request: scheduler_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.is_draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is shutting down")
        if self.engine.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is not connected to its worker yet")
        generate = GenerateRequest.from_pb(request)
        try:
            with traces.admission(generate):
                validate_request(generate, self.engine.info)
                stream = self.engine.add_request(generate)
        except InvalidParameter as exc:  # RequestRejected included
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineNotReady as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        try:
            async for event in stream:
                yield event.to_pb()
        finally:  # normal end: a no-op; client cancelled: frees the request now
            self.engine.abort(generate.request_id)

    async def GenerateStreams(self, request_iterator, context: grpc.aio.ServicerContext):
        await context.send_initial_metadata(())  # at once: the client writes nothing before (scheduler_client.py)
        call = StreamsCall(self.engine, lambda: self._is_draining)
        self._calls.add(call)
        reader = asyncio.create_task(call.read(request_iterator))
        try:
            async for response in call.responses():
                yield response
        finally:  # the client is gone, or the call broke: abort what is left
            self._calls.discard(call)
            reader.cancel()
            call.close()

    async def watch_workers(self, poll_s: float = 0.2) -> None:
        """Forever: keep the Scheduler service's health status to whether it can take requests now."""
        is_serving = None
        while True:
            now = self.engine.is_connected and not self._is_draining
            if now != is_serving:
                await self.serving.set_services(now)
                is_serving = now
            await asyncio.sleep(poll_s)

    async def GetInfo(self, request: scheduler_pb2.SchedulerInfoRequest, context: grpc.aio.ServicerContext):
        if self.engine.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is not connected to its worker yet")
        return scheduler_pb2.SchedulerInfo(worker=self.engine.info.to_pb())

    async def GetStats(self, request: scheduler_pb2.StatsRequest, context: grpc.aio.ServicerContext):
        return stats_to_pb(self.engine.stats(), await self._drafter_stats())

    async def _drafter_stats(self) -> list[DrafterReplicaStats]:
        """Each drafter replica, asked now, off the step loop (an in-process drafter without replicas: none)."""
        replica_stats = getattr(self.engine.drafter, "replica_stats", None)
        return await replica_stats(_DRAFTER_STATS_TIMEOUT_S) if replica_stats is not None else []

    async def Health(self, request: common_pb2.HealthRequest, context: grpc.aio.ServicerContext):
        return (await self.engine.health()).to_pb()


async def start_server(config: SchedulerConfig, engine: Engine | EngineGroup | None = None
                       ) -> tuple[grpc.aio.Server, Engine | EngineGroup]:
    """Start the engine (by default an EngineGroup over config.worker_address's workers, connecting in the
    background) and serve on host:port.

    The bound port (useful with port 0) is in `server.bound_port`. With the config's internal TLS, the server
    requires client certificates and the worker and drafter clients present one (mutual TLS both ways).
    """
    tls = internal_tls(config)
    if tls is not None:
        tls.check()
    if engine is None:
        drafter = (DrafterClient(config.drafter_addresses, config.draft_timeout_ms / 1000, config.drafter_retry_s,
                                 tls=tls) if config.drafter_addresses else None)
        engine = EngineGroup(config, lambda address, server_name: WorkerClient(
            address, config.worker_step_timeout_s, tls, server_name), drafter)
    engine.start()
    server = grpc.aio.server(options=[EXCLUSIVE_PORT])
    servicer = SchedulerServicer(engine)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    try:
        port = await start_serving(server, servicer.serving, f"{config.host}:{config.port}", tls,
                                   "the scheduler's gRPC server")
    except OSError:
        await engine.stop()
        raise
    server.bound_port = port
    server.serving = servicer.serving
    server.servicer = servicer
    await servicer.serving.set(True)
    server.health_watch = asyncio.create_task(servicer.watch_workers())
    logger.info("scheduler listening on %s:%d%s", config.host, port, " (mutual TLS)" if tls else "")
    return server, engine


async def stop_server(server: grpc.aio.Server, engine: Engine | EngineGroup, grace_s: float = 2.0,
                      drain_timeout_s: float = 0.0) -> None:
    """Drain, then stop: NOT_SERVING and new requests refused at once; the requests under way get
    `drain_timeout_s` to finish; then the engine stops (ending whatever is left with an error event)."""
    server.health_watch.cancel()
    await server.serving.set(False)
    server.servicer.is_draining = True
    if not await wait_idle(engine, drain_timeout_s):
        logger.warning("requests still under way after %.0f s of draining; stopping anyway", drain_timeout_s)
    await engine.stop()
    await server.stop(grace_s)
    if isinstance(engine, EngineGroup):
        await engine.close()
        return
    for client in (engine.worker, engine.drafter):
        close = getattr(client, "close", None)
        if close is not None:
            await close()


async def wait_idle(engine: Engine | EngineGroup, timeout_s: float, poll_s: float = 0.05) -> bool:
    """True once the engine runs and queues nothing; False when `timeout_s` passed first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(poll_s)
