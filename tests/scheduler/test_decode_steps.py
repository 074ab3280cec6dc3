"""Multi-step decoding: one request to the worker of several decode steps (StepRequest.num_steps).

Four tiers: the pure Scheduler against tests/support/fakes.py's FakeWorker (which runs the steps like the real worker
and checks every one against its KV slots); the Engine over gRPC in front of the fake; the real ModelRunner on
a tiny model, whose steps in one request must give exactly the tokens, scores and top log-probabilities that
as many requests give; and the whole stack, started with --num-decode-steps. Greedy output must never change.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as futures

import pytest
from openai import OpenAI

from protos.segserve.v1 import worker_pb2
from protos.segserve.v1.generate import FinishReason, GenerateComplete
from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import MAX_DECODE_STEPS, NewSequence, ScheduledSequence, StepRequest, multi_step_problem
from protos.segserve.v1.step_result import SequenceOutput, output_problem
from protos.segserve.v1.tree import CandidateTree
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from scheduler.step_plan import DraftChoice
from tests.support.e2e_helpers import scheduler_stats, tiny_stack
from tests.support.fakes import FakeWorker, InjectedFailure, increment
from tests.e2e.test_stack import PROMPTS
from tests.e2e.test_scale_out import references, timed_stream  # noqa: F401 (a fixture)
from tests.scheduler.test_scheduler import EOS, VOCAB, collect_events, expected_output, make_scheduler, make_seq
from tests.scheduler.test_service import collect, generate_request, idle_stats, running_service
from tests.worker.test_model_runner import BLOCK_SIZE, make_runner
from worker.validation import InvalidRequest


def multi_worker(max_decode_steps: int = MAX_DECODE_STEPS) -> FakeWorker:
    return FakeWorker(increment(VOCAB), VOCAB, [EOS], max_decode_steps=max_decode_steps)


def run_engine_like(scheduler: Scheduler, worker: FakeWorker, is_ahead: bool = True, max_steps: int = 1000
                    ) -> tuple[dict, list[int]]:
    """Drive the scheduler as the engine does: schedule(), finish_plan() (no drafter: no trees), and with
    is_ahead the step ahead built before the worker runs the one in flight. Returns ({request_id: (tokens,
    reason)}, each request's num_steps in the order run)."""
    results, num_steps, plan = {}, [], None
    for _ in range(max_steps):
        if plan is None:
            if not scheduler.has_work:
                assert worker.problems == []
                return results, num_steps
            plan = scheduler.schedule()
            scheduler.finish_plan(plan, {})
        ahead = scheduler.schedule_ahead(plan) if is_ahead else None
        request = plan.request
        num_steps.append(request.num_steps)
        try:
            events = scheduler.postprocess(request, worker.step_sync(request))
        except InjectedFailure as exc:
            events = scheduler.fail_step(request, str(exc))
        collect_events(events, results)
        if ahead is not None and scheduler.current_step is not ahead.request:  # dropped
            ahead = None
        plan = ahead
    raise AssertionError("scheduler did not finish")


def finished(scheduler: Scheduler) -> StepRequest:
    """The next step's request as the engine sends it without a drafter: schedule(), then finish_plan()."""
    return scheduler.finish_plan(scheduler.schedule(), {})


def timed(worker: FakeWorker, decode_step_us: list[int]) -> FakeWorker:
    """The worker's results carry compute times: decode_step_us[0] per plain decode step, a second for any other
    step (a prefill), which must not count."""
    real = worker.step_sync

    def step_sync(request: StepRequest):
        result = real(request)
        is_plain = request.num_scheduled_tokens == len(request.sequences)
        result.compute_us = decode_step_us[0] * request.num_steps if is_plain else 1_000_000
        return result

    worker.step_sync = step_sync
    return worker


@pytest.mark.parametrize("is_ahead", [False, True], ids=["one-at-a-time", "steps-ahead"])
def test_a_requests_decode_steps_fit_decode_steps_s_at_the_workers_time_per_step(is_ahead):
    decode_step_us = [3000]
    scheduler = make_scheduler(num_decode_steps=8, decode_steps_s=0.010)
    worker = timed(multi_worker(), decode_step_us)
    scheduler.add(make_seq("a", [1, 2, 3], max_tokens=40))
    results, num_steps = run_engine_like(scheduler, worker, is_ahead)
    assert results["a"] == (expected_output([1, 2, 3], 40), FinishReason.LENGTH)
    # the prefill, then one step until a plain decode step is measured, then 10 ms / 3 ms = 3 at a time
    assert num_steps[:2] == [1, 1] and max(num_steps) == 3 and num_steps.count(3) >= 10, num_steps

    decode_step_us[0] = 12_000  # longer than half the bound: one step per request, once the average follows
    scheduler.add(make_seq("b", [5, 6, 7], max_tokens=14))
    results, num_steps = run_engine_like(scheduler, worker, is_ahead)
    assert results["b"] == (expected_output([5, 6, 7], 14), FinishReason.LENGTH)
    assert num_steps[-6:] == [1] * 6 and num_steps.count(3) <= 2, num_steps


def test_a_sequence_cancelled_while_its_step_is_drafted_gets_no_more_blocks():
    """The scheduler adds decode steps and trees after the drafter's call (finish_plan), and a cancellation can
    land during it: the ended sequence must not take blocks again (its table is empty once freed, so it would take
    them all)."""
    scheduler, worker = make_scheduler(num_decode_steps=8), multi_worker()

    def decode_step_with_one_cancelled(is_tree: bool) -> None:
        for rid, prompt in {"a": [1, 2, 3, 4, 5, 6], "b": [7, 8]}.items():
            scheduler.add(make_seq(rid, prompt, max_tokens=40))
        request = scheduler.schedule().request  # the prefills
        scheduler.postprocess(request, worker.step_sync(request))
        plan = scheduler.schedule()  # decode
        scheduler.abort("a")  # as the router's cancellation while the drafter answers
        request = scheduler.finish_plan(plan, {"a": CandidateTree((9, 10), (-1, 0))} if is_tree else {})
        assert request.num_steps == 1 and request.num_draft_tokens == 0  # an ended sequence: one plain step
        scheduler.postprocess(request, worker.step_sync(request))
        scheduler.abort("b")
        assert scheduler.block_manager.num_used_blocks == 0 and worker.problems == []

    decode_step_with_one_cancelled(is_tree=True)
    decode_step_with_one_cancelled(is_tree=False)


def test_without_a_bound_every_request_takes_num_decode_steps():
    scheduler = make_scheduler(num_decode_steps=8, decode_steps_s=0.0)
    worker = timed(multi_worker(), [50_000])
    scheduler.add(make_seq("a", [1, 2, 3], max_tokens=25))
    results, num_steps = run_engine_like(scheduler, worker, is_ahead=False)
    assert results["a"] == (expected_output([1, 2, 3], 25), FinishReason.LENGTH)
    assert num_steps == [1, 8, 8, 8]


@pytest.mark.parametrize("is_ahead", [False, True], ids=["one-at-a-time", "steps-ahead"])
def test_several_decode_steps_per_request_give_every_sequence_its_plain_tokens(is_ahead):
    scheduler, worker = make_scheduler(num_decode_steps=4), multi_worker()
    prompts = {"a": [1, 2, 3], "b": [40], "c": [7, 8, 9, 10, 11, 12, 13]}
    max_tokens = {"a": 13, "b": 7, "c": 22}  # none a multiple of 4: the last request takes fewer steps
    for rid, prompt in prompts.items():
        scheduler.add(make_seq(rid, prompt, max_tokens=max_tokens[rid]))
    results, num_steps = run_engine_like(scheduler, worker, is_ahead)
    for rid, prompt in prompts.items():
        assert results[rid] == (expected_output(prompt, max_tokens[rid]), FinishReason.LENGTH), rid
    assert max(num_steps) == 4 and worker.num_multi_steps >= 4
    assert len(num_steps) < 22 - 1  # fewer requests than the longest sequence has tokens after its first
    assert scheduler.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("is_ahead", [False, True], ids=["one-at-a-time", "steps-ahead"])
def test_a_stop_inside_the_steps_cuts_the_tokens_there(is_ahead):
    scheduler, worker = make_scheduler(num_decode_steps=8), multi_worker()
    scheduler.add(make_seq("eos", [EOS - 6], max_tokens=40))  # EOS is its 6th token: inside the first 8 steps
    scheduler.add(make_seq("stop", [20], max_tokens=40, stop_token_ids=(24,)))
    scheduler.add(make_seq("long", [50], max_tokens=30))
    results, num_steps = run_engine_like(scheduler, worker, is_ahead)
    assert results["eos"] == ([EOS - 5, EOS - 4, EOS - 3, EOS - 2, EOS - 1, EOS], FinishReason.EOS_TOKEN)
    assert results["stop"][0] == [21, 22, 23, 24] and results["stop"][1] == FinishReason.STOP_TOKEN
    assert results["long"] == (expected_output([50], 30), FinishReason.LENGTH)
    assert max(num_steps) == 8 and scheduler.block_manager.num_used_blocks == 0
    assert {"eos", "stop"} <= set(worker.released)


def test_one_step_per_request_while_anyone_waits_a_tree_runs_or_blocks_are_short():
    scheduler, worker = make_scheduler(num_decode_steps=4, max_num_seqs=1), multi_worker()
    scheduler.add(make_seq("a", [1, 2], max_tokens=12))
    first = finished(scheduler)
    assert first.num_steps == 1  # a prefill
    scheduler.postprocess(first, worker.step_sync(first))
    second = scheduler.schedule()
    scheduler.add(make_seq("b", [3], max_tokens=8))  # waits: max_num_seqs is 1
    assert scheduler.finish_plan(second, {}).num_steps == 1
    scheduler.abort("b")
    scheduler.postprocess(second.request, worker.step_sync(second.request))
    third = finished(scheduler)
    assert third.num_steps == 4
    assert len(third.sequences[0].block_table) + third.sequences[0].block_table_start == 2  # 7 positions

    tight, worker = make_scheduler(num_decode_steps=4, num_kv_blocks=4, block_size=4), multi_worker()
    for rid, first in (("a", 1), ("b", 11)):  # 2 blocks each; positions 6..9 need a third, and none is free
        tight.add(make_seq(rid, list(range(first, first + 6)), max_tokens=8))
    request = tight.schedule().request
    tight.postprocess(request, worker.step_sync(request))
    request = finished(tight)
    assert request.num_steps == 2  # positions 6 and 7: the slots their blocks have
    assert [work.block_table for work in request.sequences] == [(), ()]
    results, _ = run_engine_like(tight, worker)
    assert tight.block_manager.num_used_blocks == 0


class _AsksForTrees:
    """A drafting chooser (scheduler/drafting.py) that lets every decode sequence draft, or none."""

    def __init__(self, is_drafting: bool):
        self.is_drafting = is_drafting

    def choose(self, candidates, num_scheduled_tokens, room):
        queries = tuple((seq, 4 if self.is_drafting else 0) for seq in candidates)
        return DraftChoice(queries, self.is_drafting and bool(queries), None)

    def plan_ahead(self, candidates, num_base_tokens, room):
        return not self.is_drafting

    def take_planned(self):
        return None


@pytest.mark.parametrize("is_drafting", [False, True], ids=["kept-off", "let-draft"])
def test_a_step_the_drafter_is_asked_trees_for_takes_one_decode_step_though_none_comes(is_drafting):
    scheduler, worker = make_scheduler(num_decode_steps=4, drafting=_AsksForTrees(is_drafting)), multi_worker()
    scheduler.add(make_seq("a", [1, 2], max_tokens=12))
    request = scheduler.schedule().request
    scheduler.postprocess(request, worker.step_sync(request))
    plan = scheduler.schedule()
    assert [(seq.request_id, budget) for seq, budget in plan.queries] == [("a", 4 if is_drafting else 0)]
    assert scheduler.finish_plan(plan, {}).num_steps == (1 if is_drafting else 4)  # the drafter found no tree
    assert (scheduler.schedule_ahead(plan) is None) is is_drafting  # a tree needs the tokens of the step before


def test_the_steps_ahead_of_a_request_of_several_start_after_all_of_its_tokens():
    scheduler, worker = make_scheduler(num_decode_steps=3), multi_worker()
    scheduler.add(make_seq("a", [10], max_tokens=20))
    request = scheduler.schedule().request
    scheduler.postprocess(request, worker.step_sync(request))  # prefill: 1 token, 11
    plan = scheduler.schedule()
    request = scheduler.finish_plan(plan, {})
    assert request.num_steps == 3
    ahead = scheduler.schedule_ahead(plan).request
    assert ahead.num_steps == 3
    (work,) = ahead.sequences
    assert work.is_continuation and work.num_computed_tokens == 1 + 3  # the prompt, then the 3 steps' inputs
    results: dict = {}
    collect_events(scheduler.postprocess(request, worker.step_sync(request)), results)
    collect_events(scheduler.postprocess(ahead, worker.step_sync(ahead)), results)
    assert results["a"] == (expected_output([10], 7)[1:], None)  # 3 + 3 tokens after the prefill's first
    assert worker.problems == []


def test_a_sequence_that_fails_inside_the_steps_ends_alone():
    scheduler, worker = make_scheduler(num_decode_steps=4), multi_worker()
    worker.sequence_errors["bad"] = 3  # its 4th sampled token fails: the 3rd step of the first request of 4
    scheduler.add(make_seq("bad", [1, 2], max_tokens=20))
    scheduler.add(make_seq("good", [30, 31], max_tokens=20))
    results, num_steps = run_engine_like(scheduler, worker)
    assert num_steps[:2] == [1, 4]  # the prefill, then 4 steps
    assert results["bad"] == (expected_output([1, 2], 1), FinishReason.ERROR)  # the failed request's tokens: none
    assert results["good"] == (expected_output([30, 31], 20), FinishReason.LENGTH)
    assert scheduler.block_manager.num_used_blocks == 0


def test_under_preemption_outputs_stay_the_same():
    scheduler, worker = make_scheduler(num_decode_steps=4, num_kv_blocks=12, block_size=4), multi_worker()
    prompts = {f"r{i}": [5 * i + 1, 5 * i + 2] for i in range(6)}
    for rid, prompt in prompts.items():
        scheduler.add(make_seq(rid, prompt, max_tokens=14))
    results, num_steps = run_engine_like(scheduler, worker)
    for rid, prompt in prompts.items():
        assert results[rid] == (expected_output(prompt, 14), FinishReason.LENGTH), rid
    assert scheduler.num_preemptions > 0 and max(num_steps) > 1
    assert scheduler.block_manager.num_used_blocks == 0


def test_the_contract_carries_num_steps_and_checks_it():
    work = ScheduledSequence("a", (7,), 3, (0, 1), (0,))
    request = StepRequest([work], num_steps=5)
    for packed in (False, True):
        assert StepRequest.from_pb(worker_pb2.StepRequest.FromString(
            request.to_pb(packed).SerializeToString())).num_steps == 5
    assert StepRequest.from_pb(StepRequest([work]).to_pb()).num_steps == 1
    assert multi_step_problem(request) is None
    assert "outside" in multi_step_problem(StepRequest([work], num_steps=MAX_DECODE_STEPS + 1))
    assert "outside" in multi_step_problem(StepRequest([work], num_steps=0))
    prefill = ScheduledSequence("p", (1, 2, 3), 0, (0,), (2,))
    assert "'p' does not decode one token" in multi_step_problem(StepRequest([work, prefill], num_steps=2))
    assert multi_step_problem(StepRequest([prefill])) is None
    assert output_problem(work, SequenceOutput("a", (1, 2, 3, 4, 5), (0.0,) * 5), 5) is None
    assert "expected 5" in output_problem(work, SequenceOutput("a", (1,), (0.0,)), 5)
    for bad in (0, MAX_DECODE_STEPS + 1):
        with pytest.raises(ValueError, match="num_decode_steps"):
            SchedulerConfig(num_decode_steps=bad)


@pytest.mark.parametrize("offered", [1, 8])
async def test_the_engine_sends_several_steps_only_to_a_worker_that_offers_them(offered):
    fake = multi_worker(max_decode_steps=offered)
    async with running_service(fake, num_decode_steps=8) as (stub, fake, _):
        outcomes = await asyncio.wait_for(asyncio.gather(
            *(collect(stub, generate_request(f"r{i}", [10 * i + 1], max_tokens=21)) for i in range(3))), 30)
        for i, (tokens, end) in enumerate(outcomes):
            assert tokens == expected_output([10 * i + 1], 21)
            assert isinstance(end, GenerateComplete) and end.finish_reason is FinishReason.LENGTH
        assert await idle_stats(stub) == (0, 0, 0)
    assert fake.problems == []
    assert (fake.num_multi_steps > 0) is (offered > 1)
    assert max(request.num_steps for request in fake.requests) == min(offered, 8)


def _step_by_step(runner, prompt, sampling, num_steps, steps_per_request):
    """(tokens, scores, top log-probabilities) of num_steps decode steps after the prefill, steps_per_request at
    a time (the last request takes what is left)."""
    new = [NewSequence("s", sampling, len(prompt), tuple(prompt))]
    blocks = tuple(range(-(-(len(prompt) + num_steps) // BLOCK_SIZE)))
    (out,) = runner.step(StepRequest([ScheduledSequence("s", tuple(prompt), 0, blocks, (len(prompt) - 1,))], new))
    tokens, scores, tops = list(out.token_ids), list(out.scores), list(out.top_logprobs)
    while len(tokens) < num_steps + 1:
        count = min(steps_per_request, num_steps + 1 - len(tokens))
        position = len(prompt) + len(tokens) - 1
        request = StepRequest([ScheduledSequence("s", (tokens[-1],), position, blocks, (0,))], num_steps=count)
        (out,) = runner.step(request)
        assert not out.error, out.error
        assert len(out.token_ids) == count
        tokens += out.token_ids
        scores += out.scores
        tops += out.top_logprobs
    runner.step(StepRequest(finished_seq_ids=["s"]))
    return tokens, scores, tops


@pytest.mark.parametrize("sampling", [
    SamplingParams(),
    SamplingParams(temperature=0.9, top_p=0.95, seed=7, repetition_penalty=1.3, frequency_penalty=0.2,
                   num_top_logprobs=2),
], ids=["greedy", "seeded-sampling-with-penalties"])
def test_the_real_worker_runs_the_steps_of_one_request_as_it_runs_them_one_by_one(tiny_gemma3_dir, sampling):
    runner = make_runner(tiny_gemma3_dir)
    prompt = [5, 9, 13, 2, 7, 5, 9]
    one_by_one = _step_by_step(runner, prompt, sampling, 12, 1)
    assert _step_by_step(runner, prompt, sampling, 12, 5) == one_by_one  # 5 + 5 + 2
    assert _step_by_step(runner, prompt, sampling, 12, 12) == one_by_one


def test_the_real_worker_refuses_several_steps_for_a_prefill_and_a_table_too_short_fails_the_sequence(
        tiny_gemma3_dir):
    runner = make_runner(tiny_gemma3_dir)
    prompt = (5, 9, 13)
    new = [NewSequence("s", SamplingParams(), len(prompt), prompt)]
    with pytest.raises(InvalidRequest, match="does not decode one token"):
        runner.step(StepRequest([ScheduledSequence("s", prompt, 0, (0,), (2,))], new, num_steps=3))
    (out,) = runner.step(StepRequest([ScheduledSequence("s", prompt, 0, (0,), (2,))], new))  # state unchanged
    assert not out.error
    # block 0 holds positions 0..3 (BLOCK_SIZE 4): the 3rd of 4 steps, at position 4, has no slot
    assert BLOCK_SIZE == 4
    (out,) = runner.step(StepRequest([ScheduledSequence("s", (out.token_ids[0],), 3, (0,), (0,))], num_steps=4))
    assert out.error and not out.token_ids


@pytest.mark.e2e
def test_the_stack_with_several_decode_steps_streams_every_greedy_token(tiny_gemma3_dir, references, tmp_path):
    # a budget no step reaches: all 8 steps every time, however slow this machine is
    with tiny_stack(tiny_gemma3_dir, tmp_path, is_speculative=False,
                    scheduler={"num_decode_steps": 8, "decode_steps_ms": 60_000}) as stack:
        client = OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        with futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # 8 concurrent streams of 48 tokens
            texts = list(pool.map(lambda p: timed_stream(client, model, p)[0], PROMPTS))
        assert texts == [references[p] for p in PROMPTS]
        stats = scheduler_stats(stack)
        # one step per token would be 48 steps and more; 8 per request, with the prefills and stragglers, far fewer
        assert stats.num_steps < 24 and (stats.num_running, stats.num_used_kv_blocks) == (0, 0)
