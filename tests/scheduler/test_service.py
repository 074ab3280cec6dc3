"""In-process gRPC tier: the real Engine and Scheduler service in front of tests/support/fakes.py's FakeWorker,
served over gRPC (so the WorkerClient and every conversion run too).

The fake worker's model is next token = (last token + 1) % VOCAB; it checks
every StepRequest (known sequences, KV accounting, block-table sizes, no shared
blocks) and refuses a bad one, so scheduler bugs surface as failed requests
and in `fake.problems`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time

import grpc
import pytest

from protos.segserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2_grpc
from protos.segserve.v1.generate import (
    FinishReason,
    GenerateComplete,
    GenerateError,
    GenerateEvent,
    GenerateRequest,
    TokenChunk,
    event_from_pb,
)
from protos.segserve.v1.sampling import SamplingParams, StoppingCriteria
from scheduler.config import SchedulerConfig
from scheduler.servicer import start_server, stop_server
from common.ports import free_port
from tests.support.fake_services import FakeWorkerServicer, serve
from tests.support.fakes import FakeWorker, increment

VOCAB = 300
EOS = 299


def make_fake(**kwargs) -> FakeWorker:
    return FakeWorker(increment(VOCAB), VOCAB, [EOS], **kwargs)


@contextlib.asynccontextmanager
async def running_service(fake: FakeWorker, servicer: FakeWorkerServicer | None = None, **config):
    """(scheduler stub, fake worker, engine), all on the running event loop; `servicer` serves `fake`."""
    worker_server = await serve(worker_pb2_grpc.add_WorkerServicer_to_server, servicer or FakeWorkerServicer(fake))
    config = SchedulerConfig(**{"worker_address": f"127.0.0.1:{worker_server.bound_port}", "port": 0,
                                "max_num_batched_tokens": 32, **config})
    server, engine = await start_server(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
            await wait_until(lambda: engine.is_connected)
            yield scheduler_pb2_grpc.SchedulerStub(channel), fake, engine
    finally:
        await stop_server(server, engine)
        await worker_server.stop(None)


@pytest.fixture
async def service():
    async with running_service(make_fake()) as stack:
        yield stack


async def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await _call(predicate):
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def _call(predicate):
    result = predicate()
    return await result if asyncio.iscoroutine(result) else result


def generate_request(request_id: str, prompt: list[int], max_tokens: int = 5,
                     **sampling) -> scheduler_pb2.GenerateRequest:
    return GenerateRequest(request_id, tuple(prompt), SamplingParams(**sampling),
                           StoppingCriteria(max_tokens=max_tokens)).to_pb()


async def collect(stub, request) -> tuple[list[int], GenerateEvent]:
    """All streamed token ids and the terminal event (GenerateComplete or GenerateError)."""
    tokens = []
    async for response in stub.Generate(request):
        event = event_from_pb(response)
        if not isinstance(event, TokenChunk):
            return tokens, event
        tokens += event.token_ids
    raise AssertionError("stream ended without complete or error")


async def idle_stats(stub) -> tuple[int, int, int]:
    stats = await stub.GetStats(scheduler_pb2.StatsRequest())
    return stats.num_running, stats.num_waiting, stats.num_used_kv_blocks


async def test_generate_streams_tokens_then_complete_with_metrics(service):
    stub, fake, _ = service
    tokens, last = await collect(stub, generate_request("r1", [10, 11, 12], max_tokens=5))
    assert tokens == [13, 14, 15, 16, 17]
    assert isinstance(last, GenerateComplete) and last.finish_reason is FinishReason.LENGTH
    assert (last.num_prompt_tokens, last.num_generated_tokens, last.max_batch_size) == (3, 5, 1)
    assert 0 < last.first_token_us and 0 < last.decode_us and last.queue_wait_us <= last.first_token_us
    assert last.error_message == ""
    tokens, last = await collect(stub, generate_request("r2", [296], max_tokens=10))
    assert (tokens, last.finish_reason) == ([297, 298, EOS], FinishReason.EOS_TOKEN)
    assert fake.problems == []


@pytest.mark.parametrize("packed_steps", [True, False], ids=["packed", "older-worker"])
async def test_steps_go_packed_and_tables_as_deltas_only_to_a_worker_that_reads_them(packed_steps):
    """A worker that offers packed steps gets them, and answers them packed, with outputs that carry top
    log-probabilities one message each in the same step; one that predates them (and would refuse them) gets
    one message per sequence. The same for block-table deltas (the fake fails a step that sends one to a
    worker that did not offer them), and for StepStream (an older worker gets a Step call per step). Either
    way every request gets its tokens."""
    fake = make_fake()
    fake.info = dataclasses.replace(fake.info, block_table_deltas=packed_steps)
    fake.step_delay_s = 0.005  # the requests share steps
    servicer = FakeWorkerServicer(fake, packed_steps=packed_steps, step_stream=packed_steps)
    async with running_service(fake, servicer) as (stub, _, _):
        results = await asyncio.gather(*(collect(stub, generate_request(
            f"p{i}", [10 * i + 1, 10 * i + 2], max_tokens=4, num_top_logprobs=2 * (i % 2))) for i in range(4)))
    assert [last.finish_reason for _, last in results] == [FinishReason.LENGTH] * 4
    assert [tokens for tokens, _ in results] == [[10 * i + 3 + k for k in range(4)] for i in range(4)]
    assert fake.max_batch > 1 and fake.problems == []
    assert (servicer.num_packed > 0, servicer.num_unpacked > 0) == (packed_steps, not packed_steps)
    assert (servicer.num_streamed > 0, servicer.num_called > 0) == (packed_steps, not packed_steps)
    assert servicer.num_streams == packed_steps  # every step of the run on one stream
    assert any(work.block_table_start for step in fake.requests for work in step.sequences) == packed_steps


async def test_an_absent_sampling_message_means_greedy_defaults(service):
    stub, _, _ = service
    request = scheduler_pb2.GenerateRequest(request_id="bare", prompt_token_ids=[4],
                                            stopping=common_pb2.StoppingCriteria(max_tokens=2))
    tokens, last = await collect(stub, request)
    assert tokens == [5, 6] and last.finish_reason is FinishReason.LENGTH


async def test_concurrent_requests_are_batched_and_each_gets_its_own_tokens(service):
    stub, fake, _ = service
    fake.step_delay_s = 0.005
    prompts = {f"c{i}": [20 * i + j for j in range(1 + i % 7)] for i in range(10)}
    results = await asyncio.gather(*(collect(stub, generate_request(rid, p, max_tokens=6))
                                     for rid, p in prompts.items()))
    for (rid, prompt), (tokens, last) in zip(prompts.items(), results):
        assert tokens == [prompt[-1] + 1 + k for k in range(6)], rid
        assert last.finish_reason is FinishReason.LENGTH
    assert fake.max_batch > 1 and max(last.max_batch_size for _, last in results) > 1
    assert fake.problems == []
    assert await idle_stats(stub) == (0, 0, 0)
    stats = await stub.GetStats(scheduler_pb2.StatsRequest())
    assert stats.num_total_kv_blocks == 64 and stats.num_steps >= 6


async def test_client_cancellation_frees_the_slot_and_releases_the_worker_state(service):
    stub, fake, _ = service
    fake.step_delay_s = 0.02
    call = stub.Generate(generate_request("cancel-me", [1, 2, 3], max_tokens=100))
    num_chunks = 0
    async for response in call:
        num_chunks += response.HasField("chunk")
        if num_chunks == 3:
            break
    stats = await stub.GetStats(scheduler_pb2.StatsRequest())
    assert stats.num_running == 1 and stats.num_used_kv_blocks > 0
    call.cancel()

    async def is_idle():
        return await idle_stats(stub) == (0, 0, 0)

    await wait_until(is_idle, timeout_s=2.0)
    # The worker is told to drop the sequence with the next step that runs.
    await collect(stub, generate_request("next", [5], max_tokens=1))
    assert "cancel-me" in fake.released


@pytest.mark.parametrize("request_kwargs, message", [
    (dict(prompt=[]), "prompt_token_ids: must not be empty"),
    (dict(prompt=[1] * 128), "prompt_token_ids: has 128 tokens"),
    (dict(prompt=[1], max_tokens=0), "max_tokens: must be in [1, "),
    (dict(prompt=[VOCAB]), "prompt_token_ids: holds id 300"),
    (dict(prompt=[1], temperature=0.0), "temperature: must be in (0, "),
    (dict(prompt=[1], temperature=math.inf), "temperature: must be a finite number (got inf)"),
    (dict(prompt=[1], temperature=math.nan), "temperature: must be a finite number (got nan)"),
    (dict(prompt=[1], top_p=0.0), "top_p: must be in (0, 1] (got 0.0)"),
    (dict(prompt=[1], top_p=1.5), "top_p: must be in (0, 1]"),
    (dict(prompt=[1], top_k=VOCAB), f"top_k: must be below the vocabulary size {VOCAB} (got {VOCAB})"),
    (dict(prompt=[1], top_k=10**6), "top_k: must be below the vocabulary size"),
    (dict(prompt=[1], repetition_penalty=math.inf), "repetition_penalty: must be a finite number (got inf)"),
    (dict(prompt=[1], logit_bias={5: 100.5}), "logit_bias: token 5: must be in [-100, 100]"),
    (dict(prompt=[1], logit_bias={5: -math.inf}), "logit_bias: token 5: must be a finite number"),
    (dict(prompt=[1], logit_bias={VOCAB: 1.0}), f"logit_bias: token ids must be integers in [0, {VOCAB})"),
])
async def test_invalid_requests_get_invalid_argument_naming_the_field(service, request_kwargs, message):
    stub, fake, engine = service
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, generate_request("bad", **request_kwargs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(message), info.value.details()
    assert fake.requests == [] and engine.stats().num_waiting == 0  # nothing reached a batch


async def test_prompt_larger_than_the_kv_cache_is_rejected_and_one_that_fills_it_ends_at_context_length():
    async with running_service(make_fake(num_kv_blocks=4, block_size=4)) as (stub, fake, engine):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, generate_request("huge", [1] * 17, max_tokens=1))  # 16 KV slots
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("prompt_token_ids: has 17 tokens")
        tokens, last = await collect(stub, generate_request("full", [1] * 16, max_tokens=5))
        assert (tokens, last.finish_reason) == ([2], FinishReason.CONTEXT_LENGTH)
        assert engine.stats().num_waiting == 0 and fake.problems == []


async def test_an_unreachable_worker_ends_the_step_with_an_error_and_serving_continues(service):
    """The only worker lost: its request ends with a clean error; once the worker answers again, the scheduler
    reconnects, tells it to drop what it held, and serves."""
    stub, fake, engine = service
    fake.failing_code = "UNAVAILABLE"
    tokens, last = await asyncio.wait_for(collect(stub, generate_request("doomed", [1, 2], max_tokens=5)), 5)
    assert tokens == [] and isinstance(last, GenerateError) and last.code == "unavailable"
    assert "UNAVAILABLE" in last.message and "injected worker failure" in last.message
    fake.failing_code = None
    await wait_until(lambda: engine.is_connected)
    tokens, last = await collect(stub, generate_request("fine", [7], max_tokens=2))
    assert tokens == [8, 9] and isinstance(last, GenerateComplete)
    assert "doomed" in fake.released
    assert await idle_stats(stub) == (0, 0, 0)


# Faults the scheduler retries or isolates (8 co-batched requests, greedy: every output is known).

BATCH = {f"b{i}": [10 * i + 1, 10 * i + 2] for i in range(8)}


async def generate_batch(stub, max_tokens: int = 8) -> dict[str, tuple[list[int], GenerateEvent]]:
    results = await asyncio.wait_for(asyncio.gather(
        *(collect(stub, generate_request(rid, prompt, max_tokens=max_tokens)) for rid, prompt in BATCH.items())), 20)
    return dict(zip(BATCH, results))


def plain(prompt: list[int], max_tokens: int = 8) -> list[int]:
    return [prompt[-1] + 1 + k for k in range(max_tokens)]


async def test_one_failing_sequence_ends_alone_with_finish_reason_error():
    async with running_service(make_fake()) as (stub, fake, engine):
        fake.step_delay_s = 0.002
        fake.sequence_errors["b3"] = 3  # three tokens, then an error output
        results = await generate_batch(stub)
        for rid, prompt in BATCH.items():
            tokens, last = results[rid]
            if rid == "b3":
                assert tokens == plain(prompt)[:3] and isinstance(last, GenerateComplete)
                assert last.finish_reason is FinishReason.ERROR and last.num_generated_tokens == 3
                assert last.error_message == "non-finite logits for b3"
            else:
                assert (tokens, last.finish_reason) == (plain(prompt), FinishReason.LENGTH), rid
        assert fake.max_batch == 8 and engine.stats().num_failed_steps == 0
        assert await idle_stats(stub) == (0, 0, 0) and fake.problems == []


@pytest.mark.parametrize("code", ["RESOURCE_EXHAUSTED", "INTERNAL"])
async def test_a_step_that_fails_once_is_retried_and_every_request_gets_identical_tokens(code):
    async with running_service(make_fake()) as (stub, fake, engine):
        fake.step_delay_s = 0.002
        fake.fail_once_at_batch = (len(BATCH), code)
        results = await generate_batch(stub)
        for rid, prompt in BATCH.items():
            assert (results[rid][0], results[rid][1].finish_reason) == (plain(prompt), FinishReason.LENGTH), rid
        stats = engine.stats()
        assert stats.num_failed_steps == 1 and stats.num_preemptions == len(BATCH)
        assert await idle_stats(stub) == (0, 0, 0) and fake.problems == []


async def test_a_malformed_worker_answer_is_retried_like_a_failed_step():
    async with running_service(make_fake()) as (stub, fake, engine):
        fake.step_delay_s = 0.002
        fake.num_malformed_answers = 1
        results = await generate_batch(stub)
        assert {rid: tokens for rid, (tokens, _) in results.items()} == {r: plain(p) for r, p in BATCH.items()}
        assert engine.stats().num_failed_steps == 1


async def test_a_sequence_that_breaks_every_batch_it_is_in_ends_with_an_error_and_the_rest_finish():
    async with running_service(make_fake()) as (stub, fake, engine):
        fake.step_delay_s = 0.002
        fake.poison_seq_ids.add("b6")
        results = await generate_batch(stub)
        for rid, prompt in BATCH.items():
            tokens, last = results[rid]
            if rid == "b6":
                assert tokens == [] and last.finish_reason is FinishReason.ERROR
                assert "RESOURCE_EXHAUSTED" not in last.error_message and "INTERNAL" in last.error_message
            else:
                assert (tokens, last.finish_reason) == (plain(prompt), FinishReason.LENGTH), rid
        assert await idle_stats(stub) == (0, 0, 0) and fake.problems == []


async def test_a_permanently_failing_worker_ends_every_request_with_an_error_in_bounded_time():
    async with running_service(make_fake()) as (stub, fake, engine):
        fake.failing_code = "RESOURCE_EXHAUSTED"
        start = time.monotonic()
        results = await generate_batch(stub)
        assert time.monotonic() - start < 10
        for tokens, last in results.values():
            assert tokens == [] and isinstance(last, GenerateComplete) and last.finish_reason is FinishReason.ERROR
            assert "RESOURCE_EXHAUSTED" in last.error_message
        assert len(fake.requests) <= 2 * len(BATCH)
        assert await idle_stats(stub) == (0, 0, 0)
        assert (engine.stats().num_running, engine.stats().num_waiting) == (0, 0)
        fake.failing_code = None  # the worker recovers: so does serving
        tokens, last = await collect(stub, generate_request("after", [3], max_tokens=2))
        assert tokens == [4, 5] and last.finish_reason is FinishReason.LENGTH


async def test_prompt_logprobs_are_streamed_and_requests_that_did_not_ask_get_none():
    async with running_service(make_fake(), max_num_batched_tokens=8) as (stub, fake, _):
        prompt = list(range(1, 21))
        chunks = [event_from_pb(r) async for r in stub.Generate(
            generate_request("echo", prompt, max_tokens=2, num_prompt_logprobs=2))]
        prompt_chunks = [c.prompt_logprobs for c in chunks[:-1] if c.prompt_logprobs is not None]
        assert chunks[0].token_ids == () and chunks[0].prompt_logprobs.start == 1  # before the first token
        assert [i for p in prompt_chunks for i in range(p.start, p.start + len(p.logprobs))] == list(range(1, 20))
        assert all(len(top.token_ids) == 2 for p in prompt_chunks for top in p.top_logprobs)
        assert [t for c in chunks[:-1] for t in c.token_ids] == [21, 22]
        plain_chunks = [event_from_pb(r) async for r in stub.Generate(generate_request("plain", prompt, max_tokens=2))]
        assert all(c.prompt_logprobs is None for c in plain_chunks[:-1])
        assert [t for c in plain_chunks[:-1] for t in c.token_ids] == [21, 22]


async def test_get_info_and_health_pass_the_worker_through(service):
    stub, _, _ = service
    info = await stub.GetInfo(scheduler_pb2.SchedulerInfoRequest())
    assert (info.worker.model_name, info.worker.max_model_len, list(info.worker.eos_token_ids)) == ("fake", 128, [EOS])
    assert (await stub.Health(common_pb2.HealthRequest())).ready


async def test_the_ray_actor_serves_generate_over_its_grpc_port():
    import ray

    from scheduler.actor import SchedulerActor
    from scheduler.main import init_local_ray

    # Ray first: it forks its node processes (running Python in the child before exec), which is only safe
    # while no gRPC server of this test has threads inside gRPC (once, its raylet never started).
    init_local_ray()
    worker_server = None
    try:
        worker_server = await serve(worker_pb2_grpc.add_WorkerServicer_to_server, FakeWorkerServicer(make_fake()))
        actor = SchedulerActor.remote()
        port = await actor.start.remote(SchedulerConfig(worker_address=f"127.0.0.1:{worker_server.bound_port}",
                                                        port=0))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)

            async def ready():
                return (await stub.Health(common_pb2.HealthRequest())).ready

            await wait_until(ready, timeout_s=30)
            tokens, last = await collect(stub, generate_request("ray", [40, 41], max_tokens=4))
        assert tokens == [42, 43, 44, 45] and isinstance(last, GenerateComplete)
        assert (await actor.stats.remote())["num_steps"] >= 4
        await actor.stop.remote()
    finally:
        ray.shutdown()
        if worker_server is not None:
            await worker_server.stop(None)


def engine_request(request_id: str, prompt: list[int], max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id, tuple(prompt), stopping=StoppingCriteria(max_tokens=max_tokens))


async def test_engine_abort_ends_the_stream_with_cancelled(service):
    _, fake, engine = service
    fake.step_delay_s = 0.02
    stream = engine.add_request(engine_request("api-abort", [1, 2], 100))
    first = await stream.__anext__()
    assert first.token_ids == (3,)
    assert engine.abort("api-abort") and not engine.abort("api-abort")
    events = [event async for event in stream]
    assert isinstance(events[-1], GenerateError) and events[-1].code == "cancelled"
    assert engine.stats().num_used_kv_blocks == 0


async def test_a_taken_port_stops_a_second_scheduler():
    config = SchedulerConfig(worker_address=f"127.0.0.1:{free_port()}", port=0)
    server, engine = await start_server(config)
    taken = server.bound_port
    try:
        with pytest.raises(OSError, match=f"cannot bind the scheduler's gRPC server to 127.0.0.1:{taken}"):
            await start_server(SchedulerConfig(worker_address=config.worker_address, port=taken))
    finally:
        await stop_server(server, engine)


async def test_without_a_worker_health_is_not_ready_and_generate_is_unavailable():
    config = SchedulerConfig(worker_address=f"127.0.0.1:{free_port()}", port=0)
    server, engine = await start_server(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            health = await stub.Health(common_pb2.HealthRequest())
            assert not health.ready and "worker" in health.detail
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(stub, generate_request("early", [1]))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await stop_server(server, engine)


async def test_a_full_waiting_queue_refuses_with_resource_exhausted():
    async with running_service(make_fake(), max_num_waiting=1, max_num_seqs=1) as (stub, fake, engine):
        fake.step_delay_s = 0.02
        for request_id in ("running", "queued"):
            engine.add_request(engine_request(request_id, [1], 100))
            await wait_until(lambda: engine.stats().num_running == 1)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, generate_request("refused", [2]))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "waiting" in info.value.details()
        assert engine.abort("running") and engine.abort("queued")
