"""Speculation in the scheduler, as pure logic: Scheduler + Speculator with tests/support/fakes.py's drafter and worker.

The fake worker verifies trees by its positional rule, so the only correct
output is plain greedy decoding under that rule; every test compares against
it and checks budget and KV accounting along the way.
"""

from __future__ import annotations

import pytest

from protos.segserve.v1.generate import FinishReason
from protos.segserve.v1.sampling import StoppingCriteria
from protos.segserve.v1.step import ScheduledSequence, StepRequest
from protos.segserve.v1.step_result import StepResult
from scheduler.block_manager import num_blocks_for
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from scheduler.spec_policy import SpecPolicy
from scheduler.speculator import Speculator
from tests.support.fake_drafter import FakeDrafter
from tests.support.fakes import FakeWorker, positional
from tests.support.fakes import reference as rule_reference
from tests.scheduler.test_scheduler import collect_events

VOCAB = 97
EOS = 96
RULE = positional(VOCAB)
PROMPTS = {"a": [5, 6, 7], "b": [40], "c": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], "d": [88, 3]}


def reference(prompt: list[int], max_tokens: int, max_len: int = 10**9) -> list[int]:
    return rule_reference(RULE, prompt, max_tokens, EOS, max_len)


def make_scheduler(speculator: Speculator | None = None, **overrides) -> Scheduler:
    args = dict(num_kv_blocks=64, block_size=4, max_model_len=512, eos_token_ids=[EOS], max_num_seqs=8,
                max_num_batched_tokens=64, on_end=speculator.forget if speculator is not None else None,
                drafting=speculator,
                is_block_table_delta=True)  # as for the real worker (and the fake, which offers them)
    args.update(overrides)
    return Scheduler(**args)


def make_drafter(num_right: int = 3, segment: str = "code") -> FakeDrafter:
    return FakeDrafter(RULE, VOCAB, num_right, segment)


def make_speculator(drafter: FakeDrafter, max_nodes: int = 6) -> Speculator:
    return Speculator(drafter, SpecPolicy(max_nodes, is_adaptive=False), VOCAB)


def make_pair(drafter: FakeDrafter, max_nodes: int = 6, **overrides) -> tuple[Scheduler, Speculator]:
    speculator = make_speculator(drafter, max_nodes)
    return make_scheduler(speculator, **overrides), speculator


async def run_all(scheduler: Scheduler, speculator: Speculator | None, prompts: dict[str, list[int]],
                  max_tokens: int = 20, **stopping) -> tuple[dict, FakeWorker]:
    """Run every prompt to the end; {request_id: (tokens, finish reason)} and the worker."""
    worker = FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=scheduler.block_manager.num_total_blocks,
                        block_size=scheduler.block_manager.block_size)
    for request_id, prompt in prompts.items():
        scheduler.add(Sequence(request_id, prompt, stopping=StoppingCriteria(max_tokens, **stopping)))
    results: dict = {}
    for _ in range(1000):
        if not scheduler.has_work:
            break
        await step(scheduler, speculator, worker, results)
        for seq in scheduler.running:  # rejected draft nodes' blocks went back
            assert len(seq.block_table) == num_blocks_for(seq.num_computed_tokens, scheduler.block_manager.block_size)
    assert not scheduler.has_work and worker.problems == []
    assert scheduler.block_manager.num_used_blocks == 0
    if speculator is not None:
        await speculator.wait_finals_sent()
    return results, worker


async def planned(scheduler: Scheduler, speculator: Speculator | None) -> StepRequest:
    """schedule -> draft -> finish_plan, as the engine does: the step's request, final."""
    plan = scheduler.schedule()
    return scheduler.finish_plan(plan, await speculator.draft(plan) if speculator is not None else {})


async def step(scheduler: Scheduler, speculator: Speculator | None, worker: FakeWorker, results: dict) -> None:
    """schedule -> draft -> worker -> postprocess, as the engine does."""
    request = await planned(scheduler, speculator)
    assert request.num_scheduled_tokens <= scheduler.max_num_batched_tokens
    result = worker.step_sync(request)
    if speculator is not None:
        speculator.observe_step(request, result, 0.01)
    collect_events(scheduler.postprocess(request, result), results)


def expected(prompts: dict[str, list[int]], max_tokens: int = 20) -> dict[str, list[int]]:
    return {rid: reference(p, max_tokens) for rid, p in prompts.items()}


async def test_outputs_match_plain_decoding_with_several_tokens_per_step():
    plain, plain_worker = await run_all(make_scheduler(), None, PROMPTS)
    drafter = make_drafter(num_right=4)
    spec, spec_worker = await run_all(*make_pair(drafter), PROMPTS)
    want = expected(PROMPTS)
    assert {rid: tokens for rid, (tokens, _) in plain.items()} == want
    assert {rid: tokens for rid, (tokens, _) in spec.items()} == want
    assert {rid: reason for rid, (_, reason) in spec.items()} == {rid: r for rid, (_, r) in plain.items()}
    assert len(spec_worker.requests) < len(plain_worker.requests) / 2
    assert sorted(drafter.finished) == sorted(PROMPTS)  # every request's drafter state released, once


async def test_acceptance_stats_per_segment_and_depth():
    scheduler, speculator = make_pair(make_drafter(num_right=2, segment="json"))
    await run_all(scheduler, speculator, {"a": [5, 6, 7]}, 40)
    stats = speculator.acceptance.segments["json"]
    assert stats is not None and stats.num_verified > 0
    rates = stats.acceptance_rate_by_depth
    # The chain is right for 2 nodes, then wrong: depths 1-2 always accepted, depth 3 never.
    assert rates[:2] == [1.0, 1.0] and rates[2] == 0.0
    assert stats.num_accepted_tokens == 2 * stats.num_verified
    assert speculator.acceptance.total.num_verified == stats.num_verified


async def test_token_chunks_say_which_tokens_were_drafts_of_which_tree_and_segment():
    scheduler, speculator = make_pair(make_drafter(num_right=2, segment="json"), max_nodes=6)
    worker = FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=64, block_size=4)
    scheduler.add(Sequence("a", [5, 6, 7], stopping=StoppingCriteria(30)))
    chunks = []
    while scheduler.has_work:
        request = await planned(scheduler, speculator)
        result = worker.step_sync(request)
        speculator.observe_step(request, result, 0.01)
        chunks += [e.event for e in scheduler.postprocess(request, result) if not e.is_terminal]
    first, *rest = chunks
    assert (first.segment, first.num_draft_tokens, first.draft_depth, first.num_accepted_draft_tokens) == ("", 0, 0, 0)
    # A wrong sibling and a chain of 5 of which the first 2 are right: 2 drafts, then the model's own token.
    assert [(c.num_draft_tokens, c.draft_depth, c.num_accepted_draft_tokens, len(c.token_ids)) for c in rest[:3]] \
        == [(6, 5, 2, 3)] * 3
    assert all(c.segment == "json" for c in rest)
    assert all(c.num_accepted_draft_tokens <= len(c.token_ids) for c in chunks)
    assert [t for c in chunks for t in c.token_ids] == reference([5, 6, 7], 30)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9])
async def test_multi_token_acceptance_stops_exactly_at_max_tokens(max_tokens):
    prompts = {"a": [5, 6, 7], "b": [40]}
    results, _ = await run_all(*make_pair(make_drafter(num_right=8), 8), prompts, max_tokens)
    for rid, prompt in prompts.items():
        tokens, reason = results[rid]
        assert tokens == reference(prompt, max_tokens) and len(tokens) == max_tokens
        assert reason is FinishReason.LENGTH


async def test_multi_token_acceptance_stops_exactly_at_eos_and_at_a_stop_token():
    # Find a prompt whose greedy continuation hits EOS a few tokens in.
    prompt = next([t] for t in range(VOCAB) if EOS in reference([t], 12)[2:8])
    want = reference(prompt, 50)
    assert want[-1] == EOS and len(want) < 50
    results, _ = await run_all(*make_pair(make_drafter(num_right=12), 12), {"e": prompt}, 50)
    assert results["e"] == (want, FinishReason.EOS_TOKEN)
    stop = reference([3], 10)[4]
    results, _ = await run_all(*make_pair(make_drafter(num_right=12), 12), {"s": [3]}, 50, stop_token_ids=(stop,))
    tokens, reason = results["s"]
    assert tokens[-1] == stop and stop not in tokens[:-1] and reason is FinishReason.STOP_TOKEN
    assert tokens == reference([3], 50)[:len(tokens)]


async def test_context_length_is_not_overrun_by_drafts():
    results, _ = await run_all(*make_pair(make_drafter(num_right=10), 10, max_model_len=12), {"a": [5, 6, 7]}, 50)
    tokens, reason = results["a"]
    assert len(tokens) == 12 - 3 and tokens == reference([5, 6, 7], 9) and reason is FinishReason.CONTEXT_LENGTH


async def test_drafts_fit_the_token_budget_and_never_preempt():
    prompts = {f"r{i}": [i + 1, 2 * i] for i in range(4)}
    plain_scheduler = make_scheduler(num_kv_blocks=10, block_size=2, max_num_batched_tokens=7)
    plain, _ = await run_all(plain_scheduler, None, prompts, 6)
    scheduler, speculator = make_pair(make_drafter(num_right=4), 8, num_kv_blocks=10, block_size=2,
                                      max_num_batched_tokens=7)
    spec, worker = await run_all(scheduler, speculator, prompts, 6)
    assert spec == plain
    assert worker.max_tokens_per_step <= 7
    assert scheduler.num_preemptions <= plain_scheduler.num_preemptions
    assert speculator.acceptance.total.num_verified > 0


@pytest.mark.parametrize("mode", ["down", "raise", "empty", "oov", "bad_parents", "too_many", "forget"])
async def test_a_failing_or_garbage_drafter_never_changes_the_output(mode):
    drafter = make_drafter(num_right=3)
    scheduler, speculator = make_pair(drafter)
    drafter.mode = mode
    results, _ = await run_all(scheduler, speculator, PROMPTS)
    assert {rid: tokens for rid, (tokens, _) in results.items()} == expected(PROMPTS)
    if mode in ("oov", "bad_parents", "too_many"):
        assert speculator.num_garbage_trees > 0
    if mode == "forget":
        assert drafter.num_resyncs > 0 and speculator.acceptance.total.num_verified > 0


async def test_resync_after_the_drafter_lost_state_sends_the_whole_sequence():
    drafter = make_drafter()
    scheduler, speculator = make_pair(drafter)
    scheduler.add(Sequence("a", [5, 6, 7], stopping=StoppingCriteria(30)))
    worker, results = FakeWorker(RULE, VOCAB, [EOS]), {}
    for _ in range(3):
        await step(scheduler, speculator, worker, results)
    drafter.state.clear()
    for _ in range(2):  # the first call answers needs_resync, the second resends all and gets a tree
        await step(scheduler, speculator, worker, results)
    seq = scheduler.requests["a"]
    assert drafter.num_resyncs == 1 and drafter.state["a"] == seq.token_ids[:len(drafter.state["a"])]
    assert results["a"][0] == reference([5, 6, 7], 30)[:len(results["a"][0])]


async def test_cancellation_releases_the_drafter_state():
    drafter = make_drafter()
    scheduler, speculator = make_pair(drafter)
    for rid in ("keep", "gone"):
        scheduler.add(Sequence(rid, [5, 6], stopping=StoppingCriteria(40)))
    worker, results = FakeWorker(RULE, VOCAB, [EOS]), {}
    for _ in range(3):
        await step(scheduler, speculator, worker, results)
    assert "gone" in drafter.state
    scheduler.abort("gone")
    await step(scheduler, speculator, worker, results)
    await speculator.wait_finals_sent()  # the final update goes in the background
    assert drafter.finished == ["gone"] and "gone" not in drafter.state
    scheduler.abort("keep")
    assert scheduler.block_manager.num_used_blocks == 0


async def test_ended_ids_reach_the_drafter_exactly_once_through_the_speculator_alone():
    """The scheduler only reports ends (on_end); the speculator keeps the backlog and releases each
    id once with its final update (in the background, or the idle flush), and the scheduler
    exposes nothing for it to swap."""
    drafter = make_drafter()
    scheduler, speculator = make_pair(drafter)
    worker, results = FakeWorker(RULE, VOCAB, [EOS]), {}
    prompts = {"short": [5], "long": [6, 7], "never-drafted": [8, 9]}
    scheduler.add(Sequence("short", [5], stopping=StoppingCriteria(3)))
    scheduler.add(Sequence("long", [6, 7], stopping=StoppingCriteria(30)))
    while "short" in scheduler.requests:
        await step(scheduler, speculator, worker, results)
    assert speculator.num_ended_pending == 1 and drafter.finished == []  # told with the next call
    scheduler.add(Sequence("never-drafted", [8, 9], stopping=StoppingCriteria(1)))  # a prefill only
    while scheduler.has_work:
        await step(scheduler, speculator, worker, results)
    await speculator.wait_finals_sent()
    assert drafter.finished.count("short") == 1
    await speculator.wait_finals_sent()
    assert sorted(drafter.finished) == ["long", "never-drafted", "short"]  # every request, once
    assert drafter.finals["long"] == [6, 7, *results["long"][0]]  # the final step's tokens included
    assert drafter.finals["never-drafted"] == [8, 9, *results["never-drafted"][0]]  # the whole sequence
    assert speculator.num_ended_pending == 0
    assert {rid: tokens for rid, (tokens, _) in results.items()} == {
        rid: reference(p, n) for (rid, p), n in zip(prompts.items(), (3, 30, 1))}
    assert not any(name.startswith(("finished", "ended")) for name in vars(scheduler))


async def test_a_reused_request_id_is_not_released_after_its_new_first_query():
    drafter = make_drafter()
    scheduler, speculator = make_pair(drafter)
    worker, results = FakeWorker(RULE, VOCAB, [EOS]), {}
    scheduler.add(Sequence("same", [5], stopping=StoppingCriteria(3)))
    while scheduler.has_work:
        await step(scheduler, speculator, worker, results)
    scheduler.add(Sequence("same", [9, 10], stopping=StoppingCriteria(12)))
    results.clear()
    while scheduler.has_work:
        await step(scheduler, speculator, worker, results)
    assert results["same"] == (reference([9, 10], 12), FinishReason.LENGTH)
    assert drafter.num_resyncs <= 1 and speculator.acceptance.total.num_verified > 0


async def test_a_failed_step_with_trees_is_retried_and_stays_lossless():
    drafter = make_drafter(num_right=4)
    scheduler, speculator = make_pair(drafter)
    worker = FakeWorker(RULE, VOCAB, [EOS])
    for request_id, prompt in PROMPTS.items():
        scheduler.add(Sequence(request_id, prompt, stopping=StoppingCriteria(20)))
    results: dict = {}
    for index in range(200):
        if not scheduler.has_work:
            break
        request = await planned(scheduler, speculator)
        if index in (3, 4, 9):
            assert index != 3 or request.num_draft_tokens > 0
            collect_events(scheduler.fail_step(request, "injected"), results)
            continue
        collect_events(scheduler.postprocess(request, worker.step_sync(request)), results)
    assert {rid: tokens for rid, (tokens, _) in results.items()} == expected(PROMPTS)
    assert scheduler.block_manager.num_used_blocks == 0 and worker.problems == []


def test_fit_tree_prunes_to_the_budget_the_free_slots_and_the_stop_conditions():
    from protos.segserve.v1.tree import CandidateTree
    from scheduler.block_manager import BlockManager
    from scheduler.drafting import fit_tree

    tree = CandidateTree((10, 11, 12, 13, 14), (-1, -1, 0, 2, 1))  # depths 1, 1, 2, 3, 2
    seq = Sequence("a", [1, 2, 3], stopping=StoppingCriteria(max_tokens=10))
    blocks = BlockManager(num_blocks=8, block_size=4)
    assert fit_tree(tree, seq, 10, 100, blocks) == tree
    assert fit_tree(tree, seq, 3, 100, blocks) == CandidateTree((10, 11, 12), (-1, -1, 0))
    assert fit_tree(tree, seq, 10, 6, blocks) == CandidateTree((10, 11, 12, 14), (-1, -1, 0, 1))  # depth <= 2
    seq.token_ids += [4] * 9  # 9 of 10 tokens generated: only the target's own token fits
    assert fit_tree(tree, seq, 10, 100, blocks) == CandidateTree()
    small = BlockManager(num_blocks=1, block_size=4)  # 4 slots: the root and 3 drafts
    assert len(fit_tree(tree, Sequence("b", [1]), 10, 100, small)) == 3


def test_a_step_sent_ahead_is_priced_as_its_compute_time_plus_a_measured_round_trip():
    """The cost model prices steps as round trips; a step ahead waited at the worker for the step before it,
    so its own round trip says nothing: it counts as its compute time plus the round trip's measured rest."""
    policy = SpecPolicy(8)
    speculator = Speculator(make_drafter(), policy, VOCAB)

    def decode_step(num_sequences: int) -> StepRequest:
        return StepRequest([ScheduledSequence(f"s{i}", (1,), 4, (i,), sample_indices=(0,))
                            for i in range(num_sequences)])

    speculator.observe_step(decode_step(1), StepResult([], compute_us=3000), 0.005)  # 2 ms beyond its compute
    speculator.observe_step(decode_step(2), StepResult([], compute_us=4000), None)  # sent ahead
    assert policy.cost.estimate(1) == pytest.approx(0.005) and policy.cost.estimate(2) == pytest.approx(0.006)
