"""The scheduler's WorkerClient over gRPC against a scripted worker: steps over one StepStream (or a Step call
each, for a worker that predates it), every answer matched to its own step, and a failed, late or lost step
failing only what was behind it on its stream."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from protos.segserve.v1 import worker_pb2, worker_pb2_grpc
from protos.segserve.v1.info import WorkerInfo
from protos.segserve.v1.step import StepRequest
from scheduler.worker_client import WorkerClient, WorkerError
from tests.support.fake_services import serve


class ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    """Answers a step with compute_us = its step_id, after delays[step_id] seconds; a step whose id is in
    `failures` fails with that status (ending its stream)."""

    def __init__(self, step_stream: bool = True):
        self.step_stream = step_stream
        self.delays: dict[int, float] = {}
        self.failures: dict[int, str] = {}
        self.ran: list[int] = []
        """Step ids answered, in order."""
        self.num_calls = self.num_streams = 0

    async def GetInfo(self, request, context):
        return WorkerInfo("scripted", 8, 4, 64, 32, (), step_stream=self.step_stream).to_pb()

    async def Step(self, request, context):
        self.num_calls += 1
        return await self._answer(request, context)

    async def StepStream(self, request_iterator, context):
        self.num_streams += 1
        async for request in request_iterator:
            yield await self._answer(request, context)

    async def _answer(self, request, context):
        await asyncio.sleep(self.delays.get(request.step_id, 0.0))
        if request.step_id in self.failures:
            await context.abort(grpc.StatusCode[self.failures[request.step_id]], "scripted failure")
        self.ran.append(request.step_id)
        return worker_pb2.StepResponse(compute_us=request.step_id)


async def _client(worker: ScriptedWorker, step_timeout_s: float | None = 10.0):
    server = await serve(worker_pb2_grpc.add_WorkerServicer_to_server, worker)
    client = WorkerClient(f"127.0.0.1:{server.bound_port}", step_timeout_s)
    await client.get_info()
    return server, client


async def _step(client: WorkerClient, step_id: int) -> int:
    return (await client.step(StepRequest(step_id=step_id))).compute_us


@pytest.mark.parametrize("step_stream", [True, False], ids=["stream", "older-worker"])
async def test_concurrent_steps_each_get_their_own_answer(step_stream):
    """Twenty steps under way at once, answered after different delays: each gets its own answer; they go over
    one stream to a worker that serves one, else as a call each."""
    worker = ScriptedWorker(step_stream)
    worker.delays = {i: 0.002 * (i % 5) for i in range(1, 21)}
    server, client = await _client(worker)
    try:
        assert client.is_streamed == step_stream
        answers = await asyncio.gather(*(_step(client, i) for i in range(1, 21)))
    finally:
        await client.close()
        await server.stop(None)
    assert answers == list(range(1, 21))
    assert (worker.num_streams, worker.num_calls) == ((1, 0) if step_stream else (0, 20))


async def test_a_failed_step_fails_the_steps_behind_it_and_the_next_step_opens_a_new_stream():
    worker = ScriptedWorker()
    worker.delays = {2: 0.1}
    worker.failures = {2: "RESOURCE_EXHAUSTED"}
    server, client = await _client(worker)
    try:
        assert await _step(client, 1) == 1
        failed, behind = await asyncio.gather(_step(client, 2), _step(client, 3), return_exceptions=True)
        assert isinstance(failed, WorkerError) and failed.code == "RESOURCE_EXHAUSTED" and not failed.is_unreachable
        assert isinstance(behind, WorkerError)
        assert await _step(client, 4) == 4
    finally:
        await client.close()
        await server.stop(None)
    assert worker.ran == [1, 4]  # step 3, written behind the failed one, never ran
    assert worker.num_streams == 2


async def test_a_step_past_its_deadline_is_unreachable_and_the_next_step_works():
    worker = ScriptedWorker()
    worker.delays = {5: 2.0}
    server, client = await _client(worker, step_timeout_s=0.2)
    try:
        with pytest.raises(WorkerError) as err:
            await _step(client, 5)
        assert err.value.code == "DEADLINE_EXCEEDED" and err.value.is_unreachable
        assert await _step(client, 6) == 6
    finally:
        await client.close()
        await server.stop(None)
    assert worker.ran == [6] and worker.num_streams == 2  # the late step's stream was ended: it never ran


async def test_a_step_its_caller_gave_up_on_leaves_the_next_answer_to_the_next_step():
    """A cancelled step is still answered on the stream; that answer is dropped, not handed to the step after
    it."""
    worker = ScriptedWorker()
    worker.delays = {7: 0.2}
    server, client = await _client(worker)
    try:
        given_up = asyncio.ensure_future(_step(client, 7))
        await asyncio.sleep(0.05)
        given_up.cancel()
        assert await _step(client, 8) == 8
        assert await _step(client, 9) == 9
    finally:
        await client.close()
        await server.stop(None)
    assert given_up.cancelled() and worker.ran == [7, 8, 9] and worker.num_streams == 1


async def test_steps_under_way_when_the_worker_goes_away_fail_unreachable():
    worker = ScriptedWorker()
    worker.delays = {10: 5.0, 11: 0.0}
    server, client = await _client(worker)
    try:
        under_way = asyncio.gather(_step(client, 10), _step(client, 11), return_exceptions=True)
        await asyncio.sleep(0.1)
        await server.stop(None)
        errors = await asyncio.wait_for(under_way, 5.0)
        assert all(isinstance(e, WorkerError) and e.is_unreachable for e in errors), errors
        with pytest.raises(WorkerError) as err:  # nobody listens there now
            await _step(client, 12)
        assert err.value.is_unreachable
    finally:
        await client.close()
