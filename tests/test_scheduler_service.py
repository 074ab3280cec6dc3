"""In-process gRPC tier: the real Engine and Scheduler service in front of a fake Worker server.

The fake worker's model is next token = (last token + 1) % VOCAB; it checks
every StepRequest (known sequences, KV accounting, block-table sizes, no shared
blocks) and refuses a bad one, so scheduler bugs surface as failed requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from protos.segserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from scheduler.config import SchedulerConfig
from scheduler.sequence import SamplingParams, StoppingCriteria
from scheduler.servicer import start_server, stop_server
from segserve.launcher import free_port

VOCAB = 300
EOS = 299


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, num_kv_blocks: int = 64, block_size: int = 4, max_model_len: int = 128):
        self.info = worker_pb2.WorkerInfo(model_name="fake", num_kv_blocks=num_kv_blocks, block_size=block_size,
                                          max_model_len=max_model_len, vocab_size=VOCAB, eos_token_ids=[EOS],
                                          device="cpu", dtype="float32")
        self.step_delay_s = 0.0
        self.fail_steps: grpc.StatusCode | None = None
        self.kv: dict[str, list[int]] = {}
        self.released: list[str] = []
        self.max_batch = 0
        self.violations: list[str] = []

    async def GetInfo(self, request, context):
        return self.info

    async def Health(self, request, context):
        return worker_pb2.HealthResponse(ready=True)

    async def Step(self, request: worker_pb2.StepRequest, context):
        await asyncio.sleep(self.step_delay_s)
        if self.fail_steps is not None:
            await context.abort(self.fail_steps, "injected worker failure")
        problem = self._apply(request)
        if problem:
            self.violations.append(problem)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        self.max_batch = max(self.max_batch, len(request.sequences))
        return worker_pb2.StepResponse(outputs=[
            worker_pb2.SequenceOutput(seq_id=s.seq_id, token_ids=[(s.token_ids[-1] + 1) % VOCAB], scores=[0.5])
            for s in request.sequences if s.sample_indices])

    def _apply(self, request: worker_pb2.StepRequest) -> str | None:
        for seq_id in request.finished_seq_ids:
            self.released.append(seq_id)
            self.kv.pop(seq_id, None)
        for new in request.new_sequences:
            self.kv[new.seq_id] = []
        used: set[int] = set()
        for s in request.sequences:
            if s.seq_id not in self.kv:
                return f"unknown sequence {s.seq_id}"
            cache = [] if s.num_computed_tokens == 0 else self.kv[s.seq_id]
            if len(cache) != s.num_computed_tokens:
                return f"{s.seq_id}: {len(cache)} cached, num_computed_tokens {s.num_computed_tokens}"
            self.kv[s.seq_id] = cache + list(s.token_ids)
            if len(s.block_table) * self.info.block_size < len(self.kv[s.seq_id]):
                return f"{s.seq_id}: block table too short"
            if used & set(s.block_table):
                return f"{s.seq_id}: shares a KV block"
            used |= set(s.block_table)
        return None


@contextlib.asynccontextmanager
async def running_service(fake: FakeWorker):
    """(scheduler stub, fake worker, engine), all on the running event loop."""
    worker_server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(fake, worker_server)
    worker_port = worker_server.add_insecure_port("127.0.0.1:0")
    await worker_server.start()
    config = SchedulerConfig(worker_address=f"127.0.0.1:{worker_port}", port=0, max_num_batched_tokens=32)
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
    async with running_service(FakeWorker()) as stack:
        yield stack


async def wait_until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await _call(predicate):
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def _call(predicate):
    result = predicate()
    return await result if asyncio.iscoroutine(result) else result


def generate_request(request_id: str, prompt: list[int], max_new_tokens: int = 5, **sampling) -> scheduler_pb2.GenerateRequest:
    params = dict(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)
    params.update(sampling)
    return scheduler_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                                         sampling=common_pb2.SamplingParams(**params),
                                         stopping=common_pb2.StoppingCriteria(max_new_tokens=max_new_tokens))


async def collect(stub, request) -> tuple[list[int], scheduler_pb2.GenerateResponse]:
    """All streamed token ids and the last message (complete or error)."""
    tokens = []
    async for response in stub.Generate(request):
        if response.HasField("chunk"):
            tokens += response.chunk.token_ids
        else:
            return tokens, response
    raise AssertionError("stream ended without complete or error")


async def test_generate_streams_tokens_then_complete_with_metrics(service):
    stub, fake, _ = service
    tokens, last = await collect(stub, generate_request("r1", [10, 11, 12], max_new_tokens=5))
    assert tokens == [13, 14, 15, 16, 17]
    complete = last.complete
    assert complete.finish_reason == scheduler_pb2.FINISH_REASON_LENGTH
    assert (complete.num_prompt_tokens, complete.num_generated_tokens, complete.max_batch_size) == (3, 5, 1)
    assert 0 < complete.first_token_us and 0 < complete.decode_us and complete.queue_wait_us <= complete.first_token_us
    tokens, last = await collect(stub, generate_request("r2", [296], max_new_tokens=10))
    assert (tokens, last.complete.finish_reason) == ([297, 298, EOS], scheduler_pb2.FINISH_REASON_EOS_TOKEN)
    assert fake.violations == []


async def test_concurrent_requests_are_batched_and_each_gets_its_own_tokens(service):
    stub, fake, engine = service
    fake.step_delay_s = 0.005
    prompts = {f"c{i}": [20 * i + j for j in range(1 + i % 7)] for i in range(10)}
    results = await asyncio.gather(*(collect(stub, generate_request(rid, p, max_new_tokens=6))
                                     for rid, p in prompts.items()))
    for (rid, prompt), (tokens, last) in zip(prompts.items(), results):
        assert tokens == [prompt[-1] + 1 + k for k in range(6)], rid
        assert last.complete.finish_reason == scheduler_pb2.FINISH_REASON_LENGTH
    assert fake.max_batch > 1 and max(last.complete.max_batch_size for _, last in results) > 1
    assert fake.violations == []
    stats = await stub.GetStats(scheduler_pb2.StatsRequest())
    assert (stats.num_running, stats.num_waiting, stats.num_used_kv_blocks) == (0, 0, 0)
    assert stats.num_total_kv_blocks == 64 and stats.num_steps >= 6


async def test_client_cancellation_frees_the_slot_and_releases_the_worker_state(service):
    stub, fake, _ = service
    fake.step_delay_s = 0.02
    call = stub.Generate(generate_request("cancel-me", [1, 2, 3], max_new_tokens=100))
    num_chunks = 0
    async for response in call:
        num_chunks += response.HasField("chunk")
        if num_chunks == 3:
            break
    stats = await stub.GetStats(scheduler_pb2.StatsRequest())
    assert stats.num_running == 1 and stats.num_used_kv_blocks > 0
    call.cancel()

    async def is_idle():
        stats = await stub.GetStats(scheduler_pb2.StatsRequest())
        return (stats.num_running, stats.num_waiting, stats.num_used_kv_blocks) == (0, 0, 0)

    await wait_until(is_idle, timeout_s=2.0)
    # The worker is told to drop the sequence with the next step that runs.
    await collect(stub, generate_request("next", [5], max_new_tokens=1))
    assert "cancel-me" in fake.released


@pytest.mark.parametrize("request_kwargs, field", [
    (dict(prompt=[]), "prompt_token_ids"),
    (dict(prompt=[1] * 128), "prompt_token_ids"),
    (dict(prompt=[1], max_new_tokens=0), "max_new_tokens"),
    (dict(prompt=[VOCAB]), "prompt_token_ids"),
    (dict(prompt=[1], temperature=0.0), "temperature"),
    (dict(prompt=[1], top_p=1.5), "top_p"),
])
async def test_invalid_requests_get_invalid_argument_naming_the_field(service, request_kwargs, field):
    stub, _, _ = service
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, generate_request("bad", **request_kwargs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()


async def test_prompt_larger_than_the_kv_cache_is_rejected_and_one_that_fills_it_ends_at_context_length():
    async with running_service(FakeWorker(num_kv_blocks=4, block_size=4)) as (stub, fake, engine):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub, generate_request("huge", [1] * 17, max_new_tokens=1))  # 16 KV slots
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt_token_ids" in info.value.details()
        tokens, last = await collect(stub, generate_request("full", [1] * 16, max_new_tokens=5))
        assert (tokens, last.complete.finish_reason) == ([2], scheduler_pb2.FINISH_REASON_CONTEXT_LENGTH)
        assert engine.stats().num_waiting == 0 and fake.violations == []


async def test_worker_failure_ends_the_stream_with_an_error_and_serving_continues(service):
    stub, fake, _ = service
    fake.fail_steps = grpc.StatusCode.UNAVAILABLE
    tokens, last = await asyncio.wait_for(collect(stub, generate_request("doomed", [1, 2], max_new_tokens=5)), 5)
    assert tokens == [] and last.HasField("error")
    assert last.error.code == "internal"
    assert "UNAVAILABLE" in last.error.message and "injected worker failure" in last.error.message
    fake.fail_steps = None
    tokens, last = await collect(stub, generate_request("fine", [7], max_new_tokens=2))
    assert tokens == [8, 9] and last.HasField("complete")
    assert "doomed" in fake.released
    stats = await stub.GetStats(scheduler_pb2.StatsRequest())
    assert (stats.num_running, stats.num_used_kv_blocks) == (0, 0)


async def test_get_info_and_health_pass_the_worker_through(service):
    stub, _, _ = service
    info = await stub.GetInfo(scheduler_pb2.SchedulerInfoRequest())
    assert (info.worker.model_name, info.worker.max_model_len, list(info.worker.eos_token_ids)) == ("fake", 128, [EOS])
    assert (await stub.Health(worker_pb2.HealthRequest())).ready


async def test_the_ray_actor_serves_generate_over_its_grpc_port():
    import ray

    from scheduler.actor import SchedulerActor
    from scheduler.main import init_local_ray

    fake = FakeWorker()
    worker_server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(fake, worker_server)
    worker_port = worker_server.add_insecure_port("127.0.0.1:0")
    await worker_server.start()
    init_local_ray()
    try:
        actor = SchedulerActor.remote()
        port = await actor.start.remote(SchedulerConfig(worker_address=f"127.0.0.1:{worker_port}", port=0))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            async def ready():
                return (await stub.Health(worker_pb2.HealthRequest())).ready

            await wait_until(ready, timeout_s=30)
            tokens, last = await collect(stub, generate_request("ray", [40, 41], max_new_tokens=4))
        assert tokens == [42, 43, 44, 45] and last.HasField("complete")
        assert (await actor.stats.remote())["num_steps"] >= 4
        await actor.stop.remote()
    finally:
        ray.shutdown()
        await worker_server.stop(None)


async def test_engine_abort_ends_the_stream_with_cancelled(service):
    _, fake, engine = service
    fake.step_delay_s = 0.02
    stream = engine.add_request("api-abort", [1, 2], SamplingParams(), StoppingCriteria(max_new_tokens=100))
    first = await stream.__anext__()
    assert first.token_ids == [3]
    assert engine.abort("api-abort") and not engine.abort("api-abort")
    events = [event async for event in stream]
    assert events[-1].code == "cancelled"
    assert engine.stats().num_used_kv_blocks == 0


async def test_without_a_worker_health_is_not_ready_and_generate_is_unavailable():
    config = SchedulerConfig(worker_address=f"127.0.0.1:{free_port()}", port=0)
    server, engine = await start_server(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            health = await stub.Health(worker_pb2.HealthRequest())
            assert not health.ready and "worker" in health.detail
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(stub, generate_request("early", [1]))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await stop_server(server, engine)


async def test_a_full_waiting_queue_refuses_with_resource_exhausted(service):
    stub, fake, engine = service
    engine.scheduler.max_num_waiting = 1
    engine.scheduler.max_num_seqs = 1
    fake.step_delay_s = 0.02
    for request_id in ("running", "queued"):
        engine.add_request(request_id, [1], SamplingParams(), StoppingCriteria(max_new_tokens=100))
        await wait_until(lambda: engine.stats().num_running == 1)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(stub, generate_request("refused", [2]))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "waiting" in info.value.details()
    assert engine.abort("running") and engine.abort("queued")
