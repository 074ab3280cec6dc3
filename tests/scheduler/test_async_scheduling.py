"""Async scheduling: the next decode step goes to the worker before the step in flight has answered.

Three tiers: the pure Scheduler driven step by step against tests/support/fakes.py's FakeWorker (which resolves
continuations like the real worker and checks every step); the Engine over gRPC in front of the fake
(`running_service`); and the real ModelRunner on a tiny model, whose continuations must compute exactly
the tokens an explicit step would. Greedy output must never change.
"""

from __future__ import annotations

import asyncio

import pytest

from protos.segserve.v1.generate import FinishReason
from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import CONTINUATION_REFUSED, NewSequence, ScheduledSequence, StepRequest
from scheduler.scheduler import Scheduler
from tests.support.fakes import FakeWorker, InjectedFailure
from tests.scheduler.test_scheduler import (
    EOS, collect_events, expected_output, make_scheduler, make_seq, make_worker, run_to_completion,
)
from tests.scheduler.test_service import collect, generate_request, idle_stats, make_fake, running_service
from tests.worker.test_model_runner import BLOCK_SIZE, make_runner


def run_pipelined(scheduler: Scheduler, worker: FakeWorker, max_steps: int = 1000,
                  fail_at: dict[int, str] | None = None) -> tuple[dict, int]:
    """Drive the scheduler as the engine does with async scheduling: build the step ahead before the worker
    runs the step in flight, run the steps on the worker in the order they were built. fail_at: worker step
    number -> the status its step fails with. Returns ({request_id: (tokens, reason)}, steps run ahead)."""
    results, num_ahead, num_steps = {}, 0, 0
    plan = None
    for _ in range(max_steps):
        if plan is None:
            if not scheduler.has_work:
                assert worker.problems == []
                return results, num_ahead
            plan = scheduler.schedule()
        ahead = scheduler.schedule_ahead(plan)
        request = plan.request
        num_steps += 1
        if fail_at and num_steps in fail_at:
            worker.step_failures.append(fail_at[num_steps])
        try:
            events = scheduler.postprocess(request, worker.step_sync(request))
        except InjectedFailure as exc:
            events = scheduler.fail_step(request, str(exc))
        collect_events(events, results)
        if ahead is not None and scheduler.current_step is not ahead.request:  # dropped: the worker still runs it
            num_steps += 1
            try:
                worker.step_sync(ahead.request)
            except InjectedFailure:
                pass
            ahead = None
        num_ahead += ahead is not None
        plan = ahead
    raise AssertionError("scheduler did not finish")


def test_steps_ahead_give_every_sequence_its_plain_tokens():
    scheduler, worker = make_scheduler(), make_worker()
    prompts = {"a": [1, 2, 3], "b": [40], "c": [7, 8, 9, 10, 11, 12, 13]}
    for rid, prompt in prompts.items():
        scheduler.add(make_seq(rid, prompt, max_tokens=12))
    results, num_ahead = run_pipelined(scheduler, worker)
    for rid, prompt in prompts.items():
        assert results[rid] == (expected_output(prompt, 12), FinishReason.LENGTH), rid
    assert num_ahead >= 9 and worker.num_continuations >= 9 * 3 - 3
    assert worker.refused_continuations == [] and scheduler.block_manager.num_used_blocks == 0


def test_a_sequence_that_stops_by_eos_while_its_step_ahead_runs_ends_once():
    scheduler, worker = make_scheduler(), make_worker()
    scheduler.add(make_seq("eos", [EOS - 4], max_tokens=20))
    scheduler.add(make_seq("long", [5], max_tokens=10))
    results, num_ahead = run_pipelined(scheduler, worker)
    assert results["eos"] == ([EOS - 3, EOS - 2, EOS - 1, EOS], FinishReason.EOS_TOKEN)
    assert results["long"] == (expected_output([5], 10), FinishReason.LENGTH)
    assert num_ahead > 0 and scheduler.block_manager.num_used_blocks == 0
    assert "eos" in worker.released


def test_no_step_ahead_while_requests_wait_before_a_step_succeeded_or_short_of_blocks():
    scheduler, worker = make_scheduler(max_num_seqs=1), make_worker()
    scheduler.add(make_seq("a", [1, 2], max_tokens=8))
    first = scheduler.schedule()
    assert scheduler.schedule_ahead(first) is None  # no step has succeeded yet
    scheduler.postprocess(first.request, worker.step_sync(first.request))
    second = scheduler.schedule()
    scheduler.add(make_seq("b", [3], max_tokens=8))  # waits: max_num_seqs is 1
    assert scheduler.schedule_ahead(second) is None
    scheduler.abort("b")
    assert scheduler.schedule_ahead(second) is not None

    tight, worker = make_scheduler(num_kv_blocks=1, block_size=4), make_worker()
    tight.add(make_seq("a", [1, 2, 3], max_tokens=8))  # its 4th token needs a block the pool does not have
    request = tight.schedule().request
    tight.postprocess(request, worker.step_sync(request))
    assert tight.schedule_ahead(tight.schedule()) is None


def test_a_sequence_reaching_max_tokens_is_left_out_of_the_step_ahead():
    scheduler, worker = make_scheduler(), make_worker()
    scheduler.add(make_seq("short", [1], max_tokens=2))
    scheduler.add(make_seq("long", [50], max_tokens=6))
    request = scheduler.schedule().request
    scheduler.postprocess(request, worker.step_sync(request))  # first tokens; "short" needs one more
    ahead = scheduler.schedule_ahead(scheduler.schedule()).request
    assert [work.seq_id for work in ahead.sequences] == ["long"]
    assert all(work.is_continuation and work.token_ids == (0,) for work in ahead.sequences)


@pytest.mark.parametrize("status", ["RESOURCE_EXHAUSTED", "INTERNAL"])
def test_a_failed_step_drops_its_step_ahead_and_every_request_still_gets_its_tokens(status):
    scheduler, worker = make_scheduler(), make_worker()
    prompts = {f"r{i}": [10 * i + 1] for i in range(4)}
    for rid, prompt in prompts.items():
        scheduler.add(make_seq(rid, prompt, max_tokens=10))
    results, _ = run_pipelined(scheduler, worker, fail_at={4: status, 9: status})
    for rid, prompt in prompts.items():
        assert results[rid] == (expected_output(prompt, 10), FinishReason.LENGTH), rid
    assert scheduler.num_failed_steps == 2 and scheduler.block_manager.num_used_blocks == 0
    assert worker.refused_continuations  # the dropped steps ahead found no token to continue from


def test_a_continuation_the_worker_refuses_is_recomputed_not_failed():
    scheduler, worker = make_scheduler(), make_worker()
    scheduler.add(make_seq("a", [1, 2], max_tokens=6))
    results: dict = {}
    request = scheduler.schedule().request
    collect_events(scheduler.postprocess(request, worker.step_sync(request)), results)
    plan = scheduler.schedule()
    request, ahead = plan.request, scheduler.schedule_ahead(plan).request
    refused = worker.step_sync(ahead)  # out of order: the worker has not run `request` yet
    assert refused.outputs[0].error.endswith(CONTINUATION_REFUSED)
    collect_events(scheduler.postprocess(request, worker.step_sync(request)), results)
    collect_events(scheduler.postprocess(ahead, refused), results)  # recomputed, not ended
    assert results == {"a": (expected_output([1, 2], 2), None)} and scheduler.num_preemptions == 1
    run_to_completion(scheduler, worker, results)
    assert results["a"] == (expected_output([1, 2], 6), FinishReason.LENGTH)


def test_a_refused_continuation_with_a_step_ahead_of_it_skips_that_step_too():
    scheduler, worker = make_scheduler(), make_worker()
    scheduler.add(make_seq("a", [1, 2], max_tokens=8))
    results: dict = {}
    request = scheduler.schedule().request
    collect_events(scheduler.postprocess(request, worker.step_sync(request)), results)
    plan = scheduler.schedule()
    request, first_ahead = plan.request, scheduler.schedule_ahead(plan)
    refused = worker.step_sync(first_ahead.request)  # it overtook `request` on its way to the worker
    collect_events(scheduler.postprocess(request, worker.step_sync(request)), results)
    second_ahead = scheduler.schedule_ahead(first_ahead)  # built while first_ahead runs, as the engine does
    assert second_ahead is not None
    collect_events(scheduler.postprocess(first_ahead.request, refused), results)  # "a" is preempted: recomputed
    second = second_ahead.request
    assert scheduler.current_step is second and scheduler.num_preemptions == 1
    collect_events(scheduler.postprocess(second, worker.step_sync(second)), results)  # skipped
    run_to_completion(scheduler, worker, results)
    assert results["a"] == (expected_output([1, 2], 8), FinishReason.LENGTH)
    assert scheduler.block_manager.num_used_blocks == 0


def test_async_scheduling_is_on_unless_turned_off():
    from scheduler.config import SchedulerConfig

    assert SchedulerConfig().is_async_scheduling is True


@pytest.mark.parametrize("is_async", [True, False])
async def test_the_engine_pipelines_decode_steps_only_when_asked(is_async):
    async with running_service(make_fake(), is_async_scheduling=is_async) as (stub, fake, _):
        fake.step_delay_s = 0.002
        prompts = {f"p{i}": [20 * i + 1, 20 * i + 2] for i in range(6)}
        results = await asyncio.wait_for(asyncio.gather(
            *(collect(stub, generate_request(rid, prompt, max_tokens=12)) for rid, prompt in prompts.items())), 30)
        for (rid, prompt), (tokens, last) in zip(prompts.items(), results):
            assert (tokens, last.finish_reason) == ([prompt[-1] + 1 + k for k in range(12)], FinishReason.LENGTH)
        assert (fake.num_continuations > 0) == is_async and fake.problems == []
        # every step ahead named the step it follows (the fake checks it is the one before it)
        assert any(request.follows_step_id for request in fake.requests) == is_async
        assert await idle_stats(stub) == (0, 0, 0)


async def test_cancelled_streams_leave_nothing_behind_with_steps_ahead():
    async with running_service(make_fake(), is_async_scheduling=True) as (stub, fake, _):
        fake.step_delay_s = 0.003
        calls = [stub.Generate(generate_request(f"x{i}", [i + 1], max_tokens=200)) for i in range(6)]

        async def read_some(call, n):
            count = 0
            async for _ in call:
                count += 1
                if count == n:
                    call.cancel()
                    return

        await asyncio.wait_for(asyncio.gather(*(read_some(call, 5 + i) for i, call in enumerate(calls))), 30)
        deadline = asyncio.get_running_loop().time() + 5
        while await idle_stats(stub) != (0, 0, 0):
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        assert fake.num_continuations > 0 and fake.problems == []


def test_the_real_worker_continues_with_the_token_it_sampled(tiny_gemma3_dir):
    explicit, continued = make_runner(tiny_gemma3_dir), make_runner(tiny_gemma3_dir)
    prompt = [5, 9, 13, 2, 7]
    new = [NewSequence("s", SamplingParams(), len(prompt), tuple(prompt))]
    first = StepRequest([ScheduledSequence("s", tuple(prompt), 0, (0, 1), (len(prompt) - 1,))], new)
    tokens = {}
    for name, runner in (("explicit", explicit), ("continued", continued)):
        (out,) = runner.step(first)
        assert not out.error, out.error
        tokens[name] = [out.token_ids[0]]
    for step in range(6):
        position = len(prompt) + step
        blocks = tuple(range(position // BLOCK_SIZE + 1))
        (out,) = explicit.step(StepRequest([ScheduledSequence("s", (tokens["explicit"][-1],), position, blocks,
                                                              (0,))]))
        tokens["explicit"].append(out.token_ids[0])
        (out,) = continued.step(StepRequest([ScheduledSequence("s", (0,), position, blocks, (0,),
                                                               is_continuation=True)]))
        tokens["continued"].append(out.token_ids[0])
    assert tokens["continued"] == tokens["explicit"]
    (out,) = continued.step(StepRequest([ScheduledSequence("s", (0,), 3, (0,), (0,), is_continuation=True)]))
    assert out.error.endswith(CONTINUATION_REFUSED) and not out.token_ids  # not where its last token goes
