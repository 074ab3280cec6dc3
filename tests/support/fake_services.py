"""The fake worker and the fake drafter (tests/support/fakes.py, tests/support/fake_drafter.py) over gRPC, for the
in-process service tier, and `serve`, which starts a servicer on a free port."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc

from protos.segserve.v1 import drafter_pb2, drafter_pb2_grpc, worker_pb2_grpc
from protos.segserve.v1.draft import DraftQuery
from protos.segserve.v1.step import StepRequest
from tests.support.fake_drafter import FakeDrafter
from tests.support.fakes import FakeWorker, InjectedFailure
from worker.step_order import StepOrder


class FakeWorkerServicer(worker_pb2_grpc.WorkerServicer):
    """A FakeWorker over gRPC: injected failures become their status, violations INVALID_ARGUMENT. A step ahead
    runs after the step it follows, with the real worker's StepOrder (gRPC does not order two calls).

    Like the real worker it reads packed steps and answers them packed, and serves StepStream; with
    packed_steps=False (step_stream=False) it plays a worker that predates them: its GetInfo does not offer
    them, and a packed step (a StepStream call) is refused."""

    def __init__(self, worker: FakeWorker, packed_steps: bool = True, step_stream: bool = True):
        self.worker = worker
        self.order = StepOrder()
        self.packed_steps = packed_steps
        self.step_stream = step_stream
        self.num_packed = self.num_unpacked = 0
        """Steps received packed and one message per sequence."""
        self.num_streamed = self.num_called = 0
        """Steps received over StepStream and as Step calls."""
        self.num_streams = 0
        """StepStream calls opened."""

    async def GetInfo(self, request, context):
        info = await self.worker.get_info()
        return dataclasses.replace(info, packed_steps=self.packed_steps, step_stream=self.step_stream).to_pb()

    async def Health(self, request, context):
        return (await self.worker.health()).to_pb()

    async def Step(self, request, context):
        self.num_called += 1
        return await self._step(request, context)

    async def StepStream(self, request_iterator, context):
        if not self.step_stream:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker has no StepStream")
        self.num_streams += 1
        async for request in request_iterator:
            self.num_streamed += 1
            yield await self._step(request, context)

    async def _step(self, request, context):
        packed = request.HasField("packed_sequences")
        if packed and not self.packed_steps:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "this worker does not read packed steps")
        self.num_packed += packed
        self.num_unpacked += not packed
        with self.order.handling(request.step_id):
            try:
                await self.order.after(request.follows_step_id)
                result = await self.worker.step(StepRequest.from_pb(request))
            except InjectedFailure as exc:
                await context.abort(grpc.StatusCode[exc.code], exc.detail)
            except AssertionError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return result.to_pb(packed=packed)


class FakeDrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """A FakeDrafter over gRPC; `is_garbage` answers every query in another request's name."""

    def __init__(self, drafter: FakeDrafter):
        self.drafter = drafter
        self.is_garbage = False

    async def Draft(self, request, context):
        queries = [DraftQuery.from_pb(q) for q in request.queries]
        replies = await self.drafter.draft(queries, list(request.finished_request_ids))
        return drafter_pb2.DraftResponse(replies=[
            replies[q.request_id].to_pb("someone-else" if self.is_garbage else q.request_id) for q in queries])

    async def GetStats(self, request, context):
        if self.drafter.mode == "down":
            await asyncio.sleep(5)  # past any caller's deadline
        return self.drafter.stats().to_pb()


async def serve(add_servicer, servicer) -> grpc.aio.Server:
    """A started in-process gRPC server on a free port (`server.bound_port`)."""
    server = grpc.aio.server()
    add_servicer(servicer, server)
    server.bound_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server
