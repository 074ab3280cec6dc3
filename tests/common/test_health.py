"""Every gRPC server serves grpc.health.v1 and reflection; the worker is SERVING only once its model is loaded."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos.segserve.v1 import worker_pb2_grpc
from scheduler.config import SchedulerConfig
from scheduler.servicer import start_server as start_scheduler, stop_server
from tests.support.fake_services import FakeWorkerServicer, serve
from tests.scheduler.test_service import make_fake
from tests.worker.test_server import runner  # noqa: F401 (fixture)
from worker.server import WorkerServicer, start_server as start_worker

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def status(channel, service: str = "") -> int:
    return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))).status


async def until_status(channel, service: str, expected: int, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (now := await status(channel, service)) != expected:
        assert asyncio.get_running_loop().time() < deadline, f"{service!r} stayed {now}, not {expected}"
        await asyncio.sleep(0.05)


async def services(channel) -> set[str]:
    stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    return {s.name async for reply in stream for s in reply.list_services_response.service}


async def test_the_worker_is_not_serving_until_its_model_is_loaded(runner):  # noqa: F811
    servicer = WorkerServicer()
    server, port = await start_worker(servicer, "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        assert await status(channel) == NOT_SERVING and await status(channel, "segserve.v1.Worker") == NOT_SERVING
        servicer.attach(runner)
        await servicer.serving.set(True)
        assert await status(channel) == SERVING and await status(channel, "segserve.v1.Worker") == SERVING
        assert {"segserve.v1.Worker", "grpc.health.v1.Health"} <= await services(channel)
    await server.stop(grace=None)


async def test_the_scheduler_serves_health_and_reflection_and_stops_serving_on_shutdown():
    worker_server = await serve(worker_pb2_grpc.add_WorkerServicer_to_server, FakeWorkerServicer(make_fake()))
    config = SchedulerConfig(worker_address=f"127.0.0.1:{worker_server.bound_port}", port=0)
    server, engine = await start_scheduler(config)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
        assert await status(channel) == SERVING
        await until_status(channel, "segserve.v1.Scheduler", SERVING)  # once it connected to the worker
        assert {"segserve.v1.Scheduler", "grpc.health.v1.Health"} <= await services(channel)
        await server.serving.set(False)  # what stop_server does first
        assert await status(channel) == NOT_SERVING
        await stop_server(server, engine)
    await worker_server.stop(None)


async def test_the_scheduler_service_serves_only_while_a_worker_is_connected():
    """The overall status is the process's (liveness); the Scheduler service's, whether it can take requests."""
    fake = FakeWorkerServicer(make_fake())
    worker_server = await serve(worker_pb2_grpc.add_WorkerServicer_to_server, fake)
    address = f"127.0.0.1:{worker_server.bound_port}"
    await worker_server.stop(None)  # nobody there yet
    server, engine = await start_scheduler(SchedulerConfig(worker_address=address, port=0))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
        await asyncio.sleep(0.5)
        assert await status(channel) == SERVING and await status(channel, "segserve.v1.Scheduler") == NOT_SERVING
        worker_server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(fake, worker_server)
        worker_server.add_insecure_port(address)
        await worker_server.start()
        await until_status(channel, "segserve.v1.Scheduler", SERVING)
        await worker_server.stop(None)  # the worker dies: found by the idle health check
        await until_status(channel, "segserve.v1.Scheduler", NOT_SERVING)
        assert await status(channel) == SERVING
        await stop_server(server, engine)
