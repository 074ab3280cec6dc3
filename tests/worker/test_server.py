"""The worker's gRPC tier, in process: GetInfo, Health, Steps, bad steps as INVALID_ARGUMENT and bad
sequences as error outputs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import threading
import time

import grpc
import pytest

from protos.segserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from protos.segserve.v1.info import Health, WorkerInfo
from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from protos.segserve.v1.step_result import StepResult
from protos.segserve.v1.tree import CandidateTree
from tests.support.devices import TEST_DEVICE
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner
from worker.server import WorkerServicer, serve, start_server

GREEDY = common_pb2.SamplingParams(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)


@pytest.fixture(scope="module")
def runner(tiny_gemma3_dir):
    runner = ModelRunner(WorkerConfig(model=str(tiny_gemma3_dir), num_kv_blocks=32, block_size=4, dtype="float32",
                                      device=TEST_DEVICE))
    runner.warm_up()
    return runner


@pytest.fixture
async def served():
    """A server with no model yet, and a stub talking to it over localhost."""
    servicer = WorkerServicer()
    server, port = await start_server(servicer, "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield servicer, worker_pb2_grpc.WorkerStub(channel)
    await channel.close()
    await server.stop(grace=None)


async def test_a_taken_port_stops_a_second_worker():
    """Not shared with SO_REUSEPORT: a scheduler's steps would otherwise reach the two workers by turns."""
    first, port = await start_server(WorkerServicer(), "127.0.0.1", 0)
    try:
        with pytest.raises(OSError, match=f"cannot bind the worker to 127.0.0.1:{port}"):
            await start_server(WorkerServicer(), "127.0.0.1", port)
    finally:
        await first.stop(grace=None)


def _new(seq_id: str, num_prompt: int, sampling=GREEDY) -> worker_pb2.NewSequence:
    return worker_pb2.NewSequence(seq_id=seq_id, sampling=sampling, num_prompt_tokens=num_prompt)


async def test_health_and_info_follow_loading(served, runner):
    servicer, stub = served
    health = Health.from_pb(await stub.Health(common_pb2.HealthRequest()))
    assert not health.is_ready and "loading" in health.detail
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.GetInfo(common_pb2.WorkerInfoRequest())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    servicer.attach(runner)
    assert Health.from_pb(await stub.Health(common_pb2.HealthRequest())).is_ready
    info = WorkerInfo.from_pb(await stub.GetInfo(common_pb2.WorkerInfoRequest()))
    assert info == dataclasses.replace(runner.info(), packed_steps=True, step_stream=True)  # the server's wire
    assert (info.num_kv_blocks, info.block_size, info.vocab_size) == (32, 4, 400)


@pytest.mark.parametrize("packed", [False, True], ids=["per-sequence", "packed"])
async def test_steps_decode_and_match_in_process_runner(served, runner, packed):
    servicer, stub = served
    servicer.attach(runner)
    prompt = [1, 40, 41, 42, 43, 44]
    first = worker_pb2.StepRequest(
        new_sequences=[_new("a", len(prompt))],
        sequences=[worker_pb2.ScheduledSequence(seq_id="a", token_ids=prompt, block_table=[3, 7], sample_indices=[5])],
    )
    reply = StepResult.from_pb(await stub.Step(first))
    assert [o.seq_id for o in reply.outputs] == ["a"] and reply.compute_us > 0
    tokens = list(reply.outputs[0].token_ids)
    for _ in range(3):
        step = ScheduledSequence("a", (tokens[-1],), len(prompt) + len(tokens) - 1, (3, 7, 9), sample_indices=(0,))
        answer = await stub.Step(StepRequest([step]).to_pb(packed=packed))
        assert answer.HasField("packed_outputs") == packed  # a packed step is answered packed
        tokens += StepResult.from_pb(answer).outputs[0].token_ids
    await stub.Step(worker_pb2.StepRequest(finished_seq_ids=["a"]))
    # A tree step over the wire: the root and two drafts under it; the answer is a path plus one token.
    tree = CandidateTree((6, 7), (-1, -1))
    work = ScheduledSequence("b", (5,), 0, (0,), draft=tree)
    reply = StepResult.from_pb(await stub.Step(
        StepRequest([work], [NewSequence("b", SamplingParams(), 1)]).to_pb(packed=packed)))
    (out,) = reply.outputs
    assert not out.error and tree.is_path(out.token_ids) and len(out.scores) == len(out.token_ids)
    await stub.Step(worker_pb2.StepRequest(finished_seq_ids=["b"]))
    # Greedy decoding over gRPC equals the runner driven in process (stale state was dropped above).
    expected = _decode_in_process(runner, prompt, 4)
    assert tokens == expected


async def test_a_stream_of_steps_decodes_like_step_calls_and_a_malformed_step_ends_it(served, runner):
    """StepStream answers each step in turn with what a Step call would have; a malformed step ends the stream
    with INVALID_ARGUMENT (the scheduler opens a new one), and a new stream carries on."""
    servicer, stub = served
    servicer.attach(runner)
    prompt = [1, 40, 41, 42, 43, 44]
    expected = _decode_in_process(runner, prompt, 4)
    call = stub.StepStream()
    await call.write(worker_pb2.StepRequest(
        new_sequences=[_new("a", len(prompt))],
        sequences=[worker_pb2.ScheduledSequence(seq_id="a", token_ids=prompt, block_table=[3, 7], sample_indices=[5])]))
    tokens = list(StepResult.from_pb(await call.read()).outputs[0].token_ids)
    for packed in (False, True, True):
        step = ScheduledSequence("a", (tokens[-1],), len(prompt) + len(tokens) - 1, (3, 7, 9), sample_indices=(0,))
        await call.write(StepRequest([step]).to_pb(packed=packed))
        answer = await call.read()
        assert answer.HasField("packed_outputs") == packed
        tokens += StepResult.from_pb(answer).outputs[0].token_ids
    assert tokens == expected
    twice = ScheduledSequence("a", (tokens[-1],), len(prompt) + len(tokens) - 1, (3, 7, 9), sample_indices=(0,))
    await call.write(StepRequest([twice, twice]).to_pb())
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "twice" in err.value.details()
    call = stub.StepStream()
    await call.write(StepRequest(finished_seq_ids=["a"]).to_pb())
    assert StepResult.from_pb(await call.read()).outputs == []
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def test_a_step_stream_is_read_ahead_while_a_step_runs():
    """The step after the running one is taken off the stream before the running one ends (a step sent ahead is
    there to start at once), and the answers keep the steps' order."""
    servicer = WorkerServicer()
    pulled: list[int] = []

    async def requests():
        for step_id in (1, 2, 3):
            pulled.append(step_id)
            yield worker_pb2.StepRequest(step_id=step_id)

    async def step(request):
        if request.step_id == 1:
            async with asyncio.timeout(2.0):
                while 2 not in pulled:
                    await asyncio.sleep(0.001)
        return worker_pb2.StepResponse(compute_us=request.step_id)

    servicer._step = step
    answers = [response.compute_us async for response in servicer.StepStream(requests(), context=None)]
    assert answers == [1, 2, 3]


def _decode_in_process(runner: ModelRunner, prompt: list[int], num_new: int) -> list[int]:
    work = ScheduledSequence("c", prompt, 0, (20, 21, 22), sample_indices=(len(prompt) - 1,))
    tokens = list(runner.step(StepRequest([work], [NewSequence("c", SamplingParams(), len(prompt))]))[0].token_ids)
    while len(tokens) < num_new:
        work = ScheduledSequence("c", (tokens[-1],), len(prompt) + len(tokens) - 1, (20, 21, 22), sample_indices=(0,))
        tokens += runner.step(StepRequest([work]))[0].token_ids
    runner.step(StepRequest(finished_seq_ids=["c"]))
    return tokens


@pytest.mark.parametrize("request_pb", [
    worker_pb2.StepRequest(new_sequences=[_new("s", 2), _new("t", 2)],
                           sequences=[worker_pb2.ScheduledSequence(seq_id="s", token_ids=[1, 2], block_table=[0]),
                                      worker_pb2.ScheduledSequence(seq_id="t", token_ids=[3, 4], block_table=[0])]),
    worker_pb2.StepRequest(new_sequences=[_new("s", 2)],
                           sequences=[worker_pb2.ScheduledSequence(seq_id="s", token_ids=[1, 2], block_table=[0]),
                                      worker_pb2.ScheduledSequence(seq_id="s", token_ids=[1, 2], block_table=[1])]),
    worker_pb2.StepRequest(new_sequences=[_new("s", 2)], packed_sequences=worker_pb2.PackedSequences(
        seq_ids=["s"], num_computed_tokens=[0], num_token_ids=[2], token_ids=[1], num_blocks=[1], block_tables=[0],
        num_sample_indices=[0])),
    worker_pb2.StepRequest(new_sequences=[worker_pb2.NewSequence(
        seq_id="s", num_prompt_tokens=2, sampling=common_pb2.SamplingParams(
            structured_output=common_pb2.StructuredOutput(kind=common_pb2.StructuredOutput.KIND_UNSPECIFIED)))],
        sequences=[worker_pb2.ScheduledSequence(seq_id="s", token_ids=[1, 2], block_table=[0])]),
], ids=["shared-kv-slot", "scheduled-twice", "packed-columns-disagree", "unknown-structured-kind"])
async def test_malformed_steps_are_invalid_argument(served, runner, request_pb):
    servicer, stub = served
    servicer.attach(runner)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Step(request_pb)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await stub.Health(common_pb2.HealthRequest())).ready


@pytest.mark.parametrize("work, message", [
    (worker_pb2.ScheduledSequence(seq_id="ghost", token_ids=[1], block_table=[0], sample_indices=[0]), "unknown"),
    (worker_pb2.ScheduledSequence(seq_id="s", token_ids=[1, 2, 3, 4, 5], block_table=[0]), "block_table"),
    (worker_pb2.ScheduledSequence(seq_id="s", token_ids=[1, 9999], block_table=[0]), "token_ids"),
    (worker_pb2.ScheduledSequence(seq_id="s", token_ids=[1], block_table=[0],
                                  draft=common_pb2.CandidateTree(token_ids=[2, 3], parents=[-1, 7])), "tree"),
], ids=["unknown-seq", "short-block-table", "out-of-vocab", "bad-tree"])
@pytest.mark.parametrize("packed", [False, True], ids=["per-sequence", "packed"])
async def test_bad_sequences_fail_alone(served, runner, work, message, packed):
    servicer, stub = served
    servicer.attach(runner)
    good = worker_pb2.ScheduledSequence(seq_id="ok", token_ids=[1, 2, 3], block_table=[5], sample_indices=[2])
    request = worker_pb2.StepRequest(new_sequences=[_new("s", 2), _new("ok", 3)], sequences=[work, good],
                                     finished_seq_ids=[])
    if packed:  # the same step as columns; the answer comes back with the error output first either way
        request = StepRequest.from_pb(request).to_pb(packed=True)
    reply = StepResult.from_pb(await stub.Step(request))
    bad, ok = reply.outputs
    assert (bad.seq_id, ok.seq_id) == (work.seq_id, "ok")
    assert message in bad.error and bad.token_ids == () and not ok.error and len(ok.token_ids) == 1
    await stub.Step(worker_pb2.StepRequest(finished_seq_ids=["s", "ok", work.seq_id]))


async def test_a_step_ahead_that_arrives_first_runs_after_the_step_it_follows(served, runner):
    """Async scheduling: the step ahead reaches the worker before the step it follows. The worker holds it
    back, and its continuation computes the token that step samples instead of being refused."""
    servicer, stub = served
    servicer.attach(runner)
    servicer.order.arrival_timeout_s = 60  # it waits for step 11 however slow this machine is
    prompt = [1, 40, 41, 42, 43, 44]
    first = StepRequest([ScheduledSequence("d", tuple(prompt), 0, (3, 7), (len(prompt) - 1,))],
                        [NewSequence("d", SamplingParams(), len(prompt))], step_id=11)
    ahead = StepRequest([ScheduledSequence("d", (0,), len(prompt), (3, 7), (0,), is_continuation=True)],
                        step_id=12, follows_step_id=11)
    ahead_call = asyncio.ensure_future(stub.Step(ahead.to_pb()))
    while not servicer.order.has_arrived(12):
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    assert not ahead_call.done()  # waiting for step 11, not refused
    (first_out,) = StepResult.from_pb(await stub.Step(first.to_pb())).outputs
    (ahead_out,) = StepResult.from_pb(await asyncio.wait_for(ahead_call, 30)).outputs
    assert not first_out.error and not ahead_out.error, ahead_out.error
    await stub.Step(worker_pb2.StepRequest(finished_seq_ids=["d"]))
    assert [*first_out.token_ids, *ahead_out.token_ids] == _decode_in_process(runner, prompt, 2)


async def test_a_step_ahead_whose_step_never_comes_runs_after_the_arrival_timeout(served, runner):
    """The step it names never reaches the worker (a cancelled RPC): it waits arrival_timeout_s, not forever,
    then runs with what the worker has (here the sequence's last step did sample, so it continues)."""
    servicer, stub = served
    servicer.attach(runner)
    servicer.order.arrival_timeout_s = 0.3
    prompt = [1, 40, 41]
    first = StepRequest([ScheduledSequence("e", tuple(prompt), 0, (3,), (len(prompt) - 1,))],
                        [NewSequence("e", SamplingParams(), len(prompt))])
    (first_out,) = StepResult.from_pb(await stub.Step(first.to_pb())).outputs
    ahead = StepRequest([ScheduledSequence("e", (0,), len(prompt), (3,), (0,), is_continuation=True)],
                        step_id=22, follows_step_id=21)
    started = asyncio.get_running_loop().time()
    (out,) = StepResult.from_pb(await asyncio.wait_for(stub.Step(ahead.to_pb()), 30)).outputs
    assert asyncio.get_running_loop().time() - started >= 0.3 and servicer.order.num_timed_out == 1
    await stub.Step(worker_pb2.StepRequest(finished_seq_ids=["e"]))
    assert not out.error and [*first_out.token_ids, *out.token_ids] == _decode_in_process(runner, prompt, 2)


async def test_serve_binds_loads_and_becomes_ready(tiny_gemma3_dir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = WorkerConfig(model=str(tiny_gemma3_dir), num_kv_blocks=8, block_size=4, port=port, device=TEST_DEVICE)
    task = asyncio.create_task(serve(config))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for _ in range(300):
            with contextlib.suppress(grpc.aio.AioRpcError):
                if (await stub.Health(common_pb2.HealthRequest(), timeout=1)).ready:
                    break
            assert not task.done(), task.exception()
            await asyncio.sleep(0.1)
        info = await stub.GetInfo(common_pb2.WorkerInfoRequest())
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert (info.num_kv_blocks, info.block_size) == (8, 4)


class _TimedRunner:
    """Stands in for a ModelRunner: each step takes `seconds` and records the thread it ran on."""

    is_ready = True

    def __init__(self, seconds: float):
        self.seconds, self.threads = seconds, []

    def step(self, request: StepRequest):
        self.threads.append(threading.current_thread())
        time.sleep(self.seconds)
        return []


@pytest.mark.parametrize("seconds", [0.0, 0.3])
async def test_a_short_step_runs_on_the_loop_and_a_long_one_lets_health_answer(served, seconds):
    servicer, stub = served
    runner = _TimedRunner(seconds)
    servicer.attach(runner)
    step = worker_pb2.StepRequest(finished_seq_ids=["x"], sequences=[
        worker_pb2.ScheduledSequence(seq_id="x", token_ids=[1], block_table=[0])])
    await stub.Step(step)  # nothing measured yet: a thread
    call = asyncio.ensure_future(stub.Step(step))
    await asyncio.sleep(0.05)
    started = asyncio.get_running_loop().time()
    assert (await stub.Health(common_pb2.HealthRequest(), timeout=5)).ready
    answered_after = asyncio.get_running_loop().time() - started
    await call
    assert runner.threads[0] is not threading.current_thread()
    if seconds:  # measured long: a thread again, and Health answered while it slept
        assert runner.threads[1] is not threading.current_thread() and answered_after < seconds / 2
    else:
        assert runner.threads[1] is threading.current_thread()


async def test_long_steps_all_run_on_one_compute_thread(served):
    """Every long step runs on the same thread, never the loop's: each thread that runs torch's parallel ops gets
    an intra-op team of its own, so steps spread over an executor's threads would compute on several teams."""
    servicer, stub = served
    runner = _TimedRunner(0.03)
    servicer.attach(runner)
    step = worker_pb2.StepRequest(finished_seq_ids=["x"], sequences=[
        worker_pb2.ScheduledSequence(seq_id="x", token_ids=[1], block_table=[0])])
    for _ in range(8):  # three at a time: steps sent ahead wait behind the running one
        await asyncio.gather(stub.Step(step), stub.Step(step), stub.Step(step))
    assert len(runner.threads) == 24 and len(set(runner.threads)) == 1
    assert runner.threads[0] is not threading.current_thread()
