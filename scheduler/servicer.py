"""The Scheduler gRPC service: thin methods that validate, delegate to the Engine and convert.

Cancelling a Generate call (the client going away) cancels the handler; its
`finally` aborts the request, which frees the slot and KV blocks at once.
"""

from __future__ import annotations

import logging

import grpc

from protos.segserve.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from scheduler.config import SchedulerConfig
from scheduler.convert import InvalidRequest, event_to_pb, generate_args_from_pb, stats_to_pb
from scheduler.drafter_client import DrafterClient
from scheduler.engine import Engine, EngineNotReady
from scheduler.scheduler import QueueFull, RequestRejected
from scheduler.worker_client import WorkerClient, info_to_pb

logger = logging.getLogger(__name__)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    async def Generate(self, request: scheduler_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.engine.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is not connected to its worker yet")
        try:
            args = generate_args_from_pb(request, self.engine.info)
            stream = self.engine.add_request(args.request_id, args.prompt_token_ids, args.sampling, args.stopping)
        except (InvalidRequest, RequestRejected) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineNotReady as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        try:
            async for event in stream:
                for message in event_to_pb(event):
                    yield message
        finally:  # normal end: a no-op; client cancelled: frees the request now
            self.engine.abort(args.request_id)

    async def GetInfo(self, request: scheduler_pb2.SchedulerInfoRequest, context: grpc.aio.ServicerContext):
        if self.engine.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is not connected to its worker yet")
        return scheduler_pb2.SchedulerInfo(worker=info_to_pb(self.engine.info))

    async def GetStats(self, request: scheduler_pb2.StatsRequest, context: grpc.aio.ServicerContext):
        return stats_to_pb(self.engine.stats())

    async def Health(self, request: worker_pb2.HealthRequest, context: grpc.aio.ServicerContext):
        health = await self.engine.health()
        return worker_pb2.HealthResponse(ready=health.is_ready, detail=health.detail)


async def start_server(config: SchedulerConfig, engine: Engine | None = None) -> tuple[grpc.aio.Server, Engine]:
    """Start the engine (connecting to config.worker_address in the background) and serve on host:port.

    The bound port (useful with port 0) is in `server.bound_port`.
    """
    if engine is None:
        drafter = (DrafterClient(config.drafter_addresses, config.draft_timeout_ms / 1000, config.drafter_retry_s)
                   if config.drafter_addresses else None)
        engine = Engine(config, WorkerClient(config.worker_address, config.worker_step_timeout_s), drafter)
    engine.start()
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(engine), server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        await engine.stop()
        raise RuntimeError(f"cannot bind the scheduler's gRPC server to {config.host}:{config.port}")
    server.bound_port = port
    await server.start()
    logger.info("scheduler listening on %s:%d", config.host, port)
    return server, engine


async def stop_server(server: grpc.aio.Server, engine: Engine, grace_s: float = 2.0) -> None:
    await engine.stop()
    await server.stop(grace_s)
    for client in (engine.worker, engine.drafter):
        close = getattr(client, "close", None)
        if close is not None:
            await close()
