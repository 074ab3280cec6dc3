"""In-process gRPC tier of speculation: the real Engine and Scheduler service, DrafterClient and
WorkerClient, in front of fake Worker and Drafter servers (tests/fake_spec.py's rule and drafter).

Whatever the drafter does (good trees, killed mid-stream, slow, garbage), every
stream must complete with exactly plain greedy decoding's tokens.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from protos.segserve.v1 import (
    drafter_pb2,
    drafter_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from scheduler.config import SchedulerConfig
from scheduler.drafter_client import DraftQuery
from scheduler.outputs import NewSequence, ScheduledSequence, SchedulerOutput
from scheduler.sequence import SamplingParams
from scheduler.servicer import start_server, stop_server
from tests.fake_spec import EOS, VOCAB, FakeDrafter, FakeTreeWorker, reference
from tests.test_scheduler_service import collect, generate_request, wait_until


class FakeWorkerServer(worker_pb2_grpc.WorkerServicer):
    def __init__(self):
        self.model = FakeTreeWorker(block_size=4)
        self.step_delay_s = 0.0
        self.problems: list[str] = []

    async def GetInfo(self, request, context):
        return worker_pb2.WorkerInfo(model_name="fake", num_kv_blocks=128, block_size=4, max_model_len=256,
                                     vocab_size=VOCAB, eos_token_ids=[EOS])

    async def Health(self, request, context):
        return worker_pb2.HealthResponse(ready=True)

    async def Step(self, request, context):
        await asyncio.sleep(self.step_delay_s)
        output = SchedulerOutput(
            scheduled=[ScheduledSequence(s.seq_id, list(s.token_ids), s.num_computed_tokens, list(s.block_table),
                                         list(s.sample_indices), list(s.position_ids), s.attention_mask,
                                         list(s.draft_parents)) for s in request.sequences],
            new_sequences=[NewSequence(n.seq_id, SamplingParams(), n.num_prompt_tokens) for n in request.new_sequences],
            finished_seq_ids=list(request.finished_seq_ids))
        try:
            sampled = self.model.step(output)
        except (AssertionError, KeyError) as exc:
            self.problems.append(repr(exc))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, repr(exc))
        return worker_pb2.StepResponse(outputs=[worker_pb2.SequenceOutput(seq_id=i, token_ids=s.token_ids,
                                                                          scores=s.scores)
                                                for i, s in sampled.items()])


class FakeDrafterServer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self):
        self.drafter = FakeDrafter(num_right=5)
        self.delay_s = 0.0
        self.is_garbage = False

    async def Draft(self, request, context):
        await asyncio.sleep(self.delay_s)
        queries = [DraftQuery(q.request_id, list(q.new_token_ids), q.num_tokens, q.num_prompt_tokens, q.max_nodes)
                   for q in request.queries]
        replies = self.drafter.draft_sync(queries, list(request.finished_request_ids))
        trees = [drafter_pb2.DraftTree(request_id="someone-else" if self.is_garbage else q.request_id,
                                       token_ids=replies[q.request_id].tree.token_ids,
                                       parents=replies[q.request_id].tree.parents,
                                       segment=replies[q.request_id].tree.segment,
                                       needs_resync=replies[q.request_id].needs_resync) for q in queries]
        return drafter_pb2.DraftResponse(trees=trees)


async def serve(add, servicer) -> grpc.aio.Server:
    server = grpc.aio.server()
    add(servicer, server)
    server.bound_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server


@contextlib.asynccontextmanager
async def spec_stack(**config):
    """(scheduler stub, fake worker, fake drafter, drafter server, engine)."""
    worker, drafter = FakeWorkerServer(), FakeDrafterServer()
    worker_server = await serve(worker_pb2_grpc.add_WorkerServicer_to_server, worker)
    drafter_server = await serve(drafter_pb2_grpc.add_DrafterServicer_to_server, drafter)
    config = SchedulerConfig(worker_address=f"127.0.0.1:{worker_server.bound_port}", port=0,
                             drafter_addresses=[f"127.0.0.1:{drafter_server.bound_port}"], **config)
    server, engine = await start_server(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
            await wait_until(lambda: engine.is_connected)
            yield scheduler_pb2_grpc.SchedulerStub(channel), worker, drafter, drafter_server, engine
    finally:
        await stop_server(server, engine)
        await drafter_server.stop(None)
        await worker_server.stop(None)


PROMPTS = {f"q{i}": [3 * i + 1, i + 2] for i in range(5)}


async def generate_all(stub, max_new_tokens: int = 30) -> dict[str, list[int]]:
    results = await asyncio.gather(*(collect(stub, generate_request(rid, p, max_new_tokens=max_new_tokens))
                                     for rid, p in PROMPTS.items()))
    for _, last in results:
        assert last.HasField("complete"), last
    return {rid: tokens for rid, (tokens, _) in zip(PROMPTS, results)}


def expected(max_new_tokens: int = 30) -> dict[str, list[int]]:
    return {rid: reference(p, max_new_tokens) for rid, p in PROMPTS.items()}


async def test_speculation_over_grpc_is_lossless_and_reports_acceptance():
    async with spec_stack(draft_timeout_ms=2000, is_spec_adaptive=False) as (stub, worker, drafter, _, engine):
        assert await generate_all(stub) == expected()
        stats = await stub.GetStats(scheduler_pb2.StatsRequest())
        assert stats.spec.num_verified > 0 and stats.spec.num_accepted_tokens > stats.spec.num_verified
        (code,) = [s for s in stats.spec_segments if s.segment == "code"]
        assert code.acceptance_rate_by_depth[0] == 1.0 and code.num_draft_tokens >= code.num_accepted_tokens
        assert (stats.num_running, stats.num_used_kv_blocks) == (0, 0)
        assert worker.problems == []
        await wait_until(lambda: sorted(drafter.drafter.finished) == sorted(PROMPTS))


async def test_the_adaptive_policy_is_lossless_too():
    async with spec_stack(draft_timeout_ms=2000) as (stub, worker, drafter, _, engine):
        for _ in range(2):
            assert await generate_all(stub) == expected()
        assert engine.speculator.policy.cost.is_fitted and worker.problems == []


async def test_killing_the_drafter_mid_stream_fails_no_request():
    async with spec_stack(draft_timeout_ms=2000, is_spec_adaptive=False) as (stub, worker, drafter, server, engine):
        worker.step_delay_s = 0.005
        task = asyncio.ensure_future(generate_all(stub, max_new_tokens=60))
        await wait_until(lambda: engine.stats().spec.num_verified >= 5)
        await server.stop(None)
        assert await task == expected(60)
        assert engine.speculator.drafter.num_failures > 0 and worker.problems == []


async def test_a_slow_drafter_misses_its_deadline_and_decoding_goes_on():
    async with spec_stack(draft_timeout_ms=20, is_spec_adaptive=False, drafter_retry_s=0.05) as stack:
        stub, worker, drafter, _, engine = stack
        drafter.delay_s = 0.2
        assert await generate_all(stub, max_new_tokens=8) == expected(8)
        assert engine.stats().spec.num_verified == 0 and engine.speculator.drafter.num_failures > 0
        drafter.delay_s = 0.0  # once back in time, after the backoff, speculation resumes
        await asyncio.sleep(0.1)
        assert await generate_all(stub) == expected()
        assert engine.stats().spec.num_verified > 0 and worker.problems == []


async def test_a_drafter_answering_for_other_requests_is_ignored():
    async with spec_stack(draft_timeout_ms=2000, is_spec_adaptive=False) as (stub, worker, drafter, _, engine):
        drafter.is_garbage = True
        assert await generate_all(stub) == expected()
        assert engine.stats().spec.num_verified == 0 and worker.problems == []


async def test_a_request_arriving_while_finished_ids_are_flushed_is_not_forgotten():
    """The engine tells the drafter about ended requests when it goes idle (an await); a request
    added during that call must still run (it used to wait forever: a lost wake-up)."""
    async with spec_stack(draft_timeout_ms=2000, is_spec_adaptive=False) as (stub, worker, drafter, _, engine):
        first, last = await collect(stub, generate_request("first", PROMPTS["q0"], max_new_tokens=6))
        assert last.HasField("complete")
        drafter.delay_s = 0.5  # the idle flush of "first" now takes a while
        await wait_until(lambda: not engine.scheduler.has_work)
        await asyncio.sleep(0.1)  # the flush is under way
        tokens, last = await asyncio.wait_for(
            collect(stub, generate_request("second", PROMPTS["q1"], max_new_tokens=6)), timeout=10)
        assert last.HasField("complete") and tokens == reference(PROMPTS["q1"], 6)
