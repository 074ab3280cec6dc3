"""In-process gRPC tier of speculation: the real Engine and Scheduler service, DrafterClient and
WorkerClient, in front of tests/support/fakes.py's FakeWorker and FakeDrafter served over gRPC.

Whatever the drafter does (good trees, killed mid-stream, slow, garbage), every
stream must complete with exactly plain greedy decoding's tokens.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from protos.segserve.v1 import drafter_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc, worker_pb2_grpc
from protos.segserve.v1.generate import FinishReason, GenerateComplete
from scheduler.config import SchedulerConfig
from scheduler.servicer import start_server, stop_server
from scheduler.spec_gate import GateDecision
from scheduler.spec_policy import SpecPolicy
from tests.support.fake_drafter import FakeDrafter
from tests.support.fake_services import FakeDrafterServicer, FakeWorkerServicer, serve
from tests.support.fakes import FakeWorker
from tests.scheduler.test_service import collect, generate_request, wait_until
from tests.scheduler.test_spec import EOS, RULE, VOCAB, reference


@contextlib.asynccontextmanager
async def spec_stack(max_decode_steps: int = 1, **config):
    """(scheduler stub, fake worker, fake drafter servicer, drafter server, the worker's engine)."""
    worker = FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=128, max_model_len=256, max_decode_steps=max_decode_steps)
    drafter = FakeDrafterServicer(FakeDrafter(RULE, VOCAB, num_right=5))
    worker_server = await serve(worker_pb2_grpc.add_WorkerServicer_to_server, FakeWorkerServicer(worker))
    drafter_server = await serve(drafter_pb2_grpc.add_DrafterServicer_to_server, drafter)
    config = SchedulerConfig(worker_address=f"127.0.0.1:{worker_server.bound_port}", port=0,
                             drafter_addresses=[f"127.0.0.1:{drafter_server.bound_port}"], **config)
    server, engine = await start_server(config)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
            await wait_until(lambda: engine.is_connected)
            (lane,) = engine.connected  # the one worker's Engine
            yield scheduler_pb2_grpc.SchedulerStub(channel), worker, drafter, drafter_server, lane
    finally:
        await stop_server(server, engine)
        await drafter_server.stop(None)
        await worker_server.stop(None)


PROMPTS = {f"q{i}": [3 * i + 1, i + 2] for i in range(5)}


async def generate_all(stub, max_tokens: int = 30) -> dict[str, list[int]]:
    results = await asyncio.gather(*(collect(stub, generate_request(rid, p, max_tokens=max_tokens))
                                     for rid, p in PROMPTS.items()))
    for _, last in results:
        assert isinstance(last, GenerateComplete) and last.finish_reason is not FinishReason.ERROR, last
    return {rid: tokens for rid, (tokens, _) in zip(PROMPTS, results)}


def expected(max_tokens: int = 30) -> dict[str, list[int]]:
    return {rid: reference(p, max_tokens) for rid, p in PROMPTS.items()}


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
        task = asyncio.ensure_future(generate_all(stub, max_tokens=60))
        await wait_until(lambda: engine.stats().spec.num_verified >= 5)
        await server.stop(None)
        assert await task == expected(60)
        assert engine.speculator.drafter.num_failures > 0 and worker.problems == []


async def test_a_slow_drafter_misses_its_deadline_and_decoding_goes_on():
    async with spec_stack(draft_timeout_ms=20, is_spec_adaptive=False, drafter_retry_s=0.05) as stack:
        stub, worker, drafter, _, engine = stack
        drafter.drafter.delay_s = 0.2
        assert await generate_all(stub, max_tokens=8) == expected(8)
        assert engine.stats().spec.num_verified == 0 and engine.speculator.drafter.num_failures > 0
        drafter.drafter.delay_s = 0.0  # once back in time, after the backoff, speculation resumes
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
        first, last = await collect(stub, generate_request("first", PROMPTS["q0"], max_tokens=6))
        assert isinstance(last, GenerateComplete)
        drafter.drafter.delay_s = 0.5  # the idle flush of "first" now takes a while
        await wait_until(lambda: not engine.scheduler.has_work)
        await asyncio.sleep(0.1)  # the flush is under way
        tokens, last = await asyncio.wait_for(
            collect(stub, generate_request("second", PROMPTS["q1"], max_tokens=6)), timeout=10)
        assert isinstance(last, GenerateComplete) and tokens == reference(PROMPTS["q1"], 6)


async def test_a_failed_worker_step_while_speculating_is_retried_losslessly():
    async with spec_stack(draft_timeout_ms=2000, is_spec_adaptive=False) as (stub, worker, drafter, _, engine):
        worker.step_delay_s = 0.002
        worker.fail_once_at_batch = (len(PROMPTS), "RESOURCE_EXHAUSTED")
        assert await generate_all(stub) == expected()
        stats = engine.stats()
        assert stats.num_failed_steps == 1 and stats.spec.num_verified > 0 and worker.problems == []
        await wait_until(lambda: sorted(drafter.drafter.finished) == sorted(PROMPTS))
        assert len(drafter.drafter.finished) == len(PROMPTS)  # each released once


async def test_get_stats_shows_each_segments_drafting_state_and_the_gates_decision():
    async with spec_stack(draft_timeout_ms=2000) as (stub, worker, drafter, _, engine):
        assert await generate_all(stub) == expected()
        stats = await stub.GetStats(scheduler_pb2.StatsRequest())
        policy = engine.speculator.policy
        budgets = {s.segment: (s.is_drafting, s.num_budget_nodes) for s in stats.spec_segments}
        assert budgets == {name: (b > 0, b) for name, b in policy.last_budgets.items()} and "code" in budgets
        bucket, is_open = policy.gate.last_decision
        assert (stats.spec.gate_batch_bucket, stats.spec.is_drafting) == (bucket, is_open) and bucket >= 1
    async with spec_stack(draft_timeout_ms=2000, is_spec_adaptive=False) as (stub, worker, drafter, _, engine):
        assert await generate_all(stub) == expected()
        stats = await stub.GetStats(scheduler_pb2.StatsRequest())
        (code,) = [s for s in stats.spec_segments if s.segment == "code"]
        assert (code.is_drafting, code.num_budget_nodes) == (True, 16)  # the fixed policy: max_draft_nodes
        assert stats.spec.gate_batch_bucket == 0  # the gate only decides for the adaptive policy


async def test_get_stats_reports_each_drafter_replica_its_corpus_and_its_health():
    async with spec_stack(draft_timeout_ms=2000, is_spec_adaptive=False, drafter_retry_s=30) as stack:
        stub, worker, drafter, server, engine = stack
        address = engine.drafter.addresses[0]
        worker.step_delay_s = 0.01
        task = asyncio.ensure_future(generate_all(stub, max_tokens=60))
        await wait_until(lambda: len(drafter.drafter.state) == len(PROMPTS))
        (replica,) = (await stub.GetStats(scheduler_pb2.StatsRequest())).drafters
        assert (replica.address, replica.is_live, replica.HasField("stats")) == (address, True, True)
        (code,) = replica.stats.segments
        assert code.segment == "code" and code.num_corpus_entries > 0 and replica.stats.num_requests > 0
        assert code.num_corpus_bytes == 10 * code.num_corpus_entries
        await server.stop(None)  # the replica dies: the next Draft fails and it backs off
        assert await task == expected(60)
        (replica,) = (await stub.GetStats(scheduler_pb2.StatsRequest())).drafters
        assert (replica.address, replica.is_live, replica.HasField("stats")) == (address, False, False)


async def test_a_drafter_too_slow_for_get_stats_shows_without_stats_and_get_stats_stays_quick():
    async with spec_stack(draft_timeout_ms=2000, is_spec_adaptive=False) as (stub, worker, drafter, _, engine):
        drafter.drafter.mode = "down"  # its GetStats sleeps past the scheduler's deadline
        loop = asyncio.get_running_loop()
        start = loop.time()
        (replica,) = (await stub.GetStats(scheduler_pb2.StatsRequest())).drafters
        assert loop.time() - start < 2.0
        assert replica.is_live and not replica.HasField("stats")


async def test_with_max_draft_nodes_0_the_drafter_learns_every_request_and_drafts_nothing():
    """--no-speculation: the launcher passes max_draft_nodes 0 with the drafters; the engine asks for no tree
    (async scheduling stays on), and every request's whole sequence reaches the drafter when it ends."""
    async with spec_stack(max_draft_nodes=0, is_async_scheduling=True) as (stub, worker, drafter, _, lane):
        assert await generate_all(stub) == expected()
        await wait_until(lambda: len(drafter.drafter.finals) == len(PROMPTS))
        assert drafter.drafter.finals == {rid: p + reference(p, 30) for rid, p in PROMPTS.items()}
        assert lane.speculator is not None and not lane.speculator.is_drafting and worker.num_continuations > 0
        assert drafter.drafter.state == {} and lane.stats().spec.num_verified == 0


class _GateExploresEveryFourthStep(SpecPolicy):
    """A policy whose gate keeps every segment kind off but lets them all draft at every fourth step it is asked
    about (use it with is_adaptive=False: its decisions are not the real gate's, which must not observe them)."""

    def keeps_off(self, groups):
        return (self.num_steps + 1) % 4 != 0

    def _choose(self, groups, num_base_tokens, token_room):
        self.num_steps += 1
        is_drafting = self.num_steps % 4 == 0
        self.last_gate_decision = GateDecision(1, {segment: is_drafting for segment in groups}, None)
        return {segment: self.max_nodes if is_drafting else 0 for segment in groups}


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
async def test_a_step_that_asks_the_drafter_for_trees_takes_one_decode_step_though_none_comes(is_async):
    """A drafter that finds no tree at one step may find one at the next, which several decode steps in one
    request would skip: with every kind let draft (the fixed policy), every request is one step."""
    async with spec_stack(max_decode_steps=8, num_decode_steps=4, draft_timeout_ms=2000, is_spec_adaptive=False,
                          is_async_scheduling=is_async) as (stub, worker, drafter, _, lane):
        drafter.drafter.mode = "empty"
        assert await generate_all(stub, max_tokens=40) == expected(40)
        assert worker.problems == [] and drafter.drafter.num_calls >= 39
        assert {request.num_steps for request in worker.requests} == {1}


class _GateOpenNoTree(SpecPolicy):
    """A policy whose gate lets every kind draft (keeps_off() is False) and whose cost model never gives a tree."""

    def _choose(self, groups, num_base_tokens, token_room):
        self.last_gate_decision = GateDecision(1, {segment: True for segment in groups}, None)
        return {segment: 0 for segment in groups}


async def test_with_speculation_on_steps_go_ahead_while_the_gate_keeps_drafting_off():
    """Async scheduling with a drafting policy: the policy is asked about every step; a step where the gate keeps
    drafting off goes ahead of the step before it, and a step it drafts in waits for that step's tokens."""
    async with spec_stack(draft_timeout_ms=2000, is_async_scheduling=True) as (stub, worker, drafter, _, lane):
        worker.step_delay_s = 0.002
        lane.speculator.policy = policy = _GateExploresEveryFourthStep(8, is_adaptive=False)
        assert await generate_all(stub, max_tokens=60) == expected(60)
        stats = lane.stats()
        assert worker.num_continuations > 0 and stats.spec.num_verified > 0 and worker.problems == []
        # one decision per step: every step with decode sequences was either sent ahead or proposed
        num_drafting = sum(request.num_draft_tokens > 0 for request in worker.requests)
        assert 0 < num_drafting <= policy.num_steps // 4
        ahead = [request for request in worker.requests if request.follows_step_id]
        assert ahead and not any(request.num_draft_tokens for request in ahead)
    async with spec_stack(draft_timeout_ms=2000, is_async_scheduling=True,
                          is_spec_adaptive=False) as (stub, worker, drafter, _, lane):
        assert await generate_all(stub) == expected()
        assert worker.num_continuations == 0 and lane.stats().spec.num_verified > 0  # it drafts at every step
    async with spec_stack(draft_timeout_ms=2000, is_async_scheduling=True) as (stub, worker, drafter, _, lane):
        lane.speculator.policy = _GateOpenNoTree(8, is_adaptive=False)
        assert await generate_all(stub) == expected()
        assert worker.num_continuations == 0 and lane.stats().spec.num_verified == 0  # open gate: round trips



@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
async def test_steps_the_gate_keeps_drafting_off_take_several_decode_steps_and_trees_one(is_async):
    async with spec_stack(max_decode_steps=8, num_decode_steps=4, draft_timeout_ms=2000,
                          is_async_scheduling=is_async) as (stub, worker, drafter, _, lane):
        lane.speculator.policy = _GateExploresEveryFourthStep(8, is_adaptive=False)
        assert await generate_all(stub, max_tokens=60) == expected(60)
        assert worker.problems == [] and lane.stats().spec.num_verified > 0
        assert max(request.num_steps for request in worker.requests) == 4 and worker.num_multi_steps > 0
        assert not any(request.num_steps > 1 and request.num_draft_tokens for request in worker.requests)
