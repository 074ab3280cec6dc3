"""Speculation in the scheduler, as pure logic: Scheduler + Speculator with a fake drafter and worker.

The fake worker verifies trees by the rule of tests/fake_spec.py, so the only
correct output is plain greedy decoding under that rule; every test compares
against it and checks budget and KV accounting along the way.
"""

from __future__ import annotations

import pytest

from scheduler.block_manager import num_blocks_for
from scheduler.draft_trees import is_tree_path, prune_tree, tree_problem
from scheduler.outputs import DraftTree
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence, StoppingCriteria
from scheduler.spec_policy import SpecPolicy
from scheduler.speculator import Speculator
from tests.fake_spec import EOS, VOCAB, FakeDrafter, FakeTreeWorker, reference, rule

PROMPTS = {"a": [5, 6, 7], "b": [40], "c": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], "d": [88, 3]}


def make_scheduler(**overrides) -> Scheduler:
    args = dict(num_kv_blocks=64, block_size=4, max_model_len=512, eos_token_ids=[EOS], max_num_seqs=8,
                max_num_batched_tokens=64)
    args.update(overrides)
    return Scheduler(**args)


def make_speculator(drafter: FakeDrafter, max_nodes: int = 6) -> Speculator:
    return Speculator(drafter, SpecPolicy(max_nodes, is_adaptive=False), VOCAB)


async def run_all(scheduler: Scheduler, speculator: Speculator | None, prompts: dict[str, list[int]],
                  max_new_tokens: int = 20, **stopping) -> tuple[dict, FakeTreeWorker]:
    """Run every prompt to the end; {request_id: (tokens, finish status)} and the worker."""
    worker = FakeTreeWorker(scheduler.block_manager.block_size)
    for request_id, prompt in prompts.items():
        scheduler.add(Sequence(request_id, prompt, stopping=StoppingCriteria(max_new_tokens, **stopping)))
    results: dict = {}
    for _ in range(1000):
        if not scheduler.has_work:
            break
        output = scheduler.schedule()
        if speculator is not None:
            await speculator.propose(scheduler, output)
        assert output.num_scheduled_tokens <= scheduler.max_num_batched_tokens
        for out in scheduler.postprocess(output, worker.step(output)):
            tokens, _ = results.get(out.request_id, ([], None))
            results[out.request_id] = (tokens + out.token_ids, out.finish_status)
        for seq in scheduler.running:  # rejected draft nodes' blocks went back
            assert len(seq.block_table) == num_blocks_for(seq.num_computed_tokens, scheduler.block_manager.block_size)
    assert not scheduler.has_work
    assert scheduler.block_manager.num_used_blocks == 0
    if speculator is not None:
        await speculator.flush_finished(scheduler)
    return results, worker


def expected(prompts: dict[str, list[int]], max_new_tokens: int = 20) -> dict[str, list[int]]:
    return {rid: reference(p, max_new_tokens) for rid, p in prompts.items()}


async def test_outputs_match_plain_decoding_with_several_tokens_per_step():
    plain, plain_worker = await run_all(make_scheduler(), None, PROMPTS)
    drafter = FakeDrafter(num_right=4)
    spec, spec_worker = await run_all(make_scheduler(), make_speculator(drafter), PROMPTS)
    want = expected(PROMPTS)
    assert {rid: tokens for rid, (tokens, _) in plain.items()} == want
    assert {rid: tokens for rid, (tokens, _) in spec.items()} == want
    assert {rid: status for rid, (_, status) in spec.items()} == {rid: s for rid, (_, s) in plain.items()}
    assert spec_worker.num_steps < plain_worker.num_steps / 2
    assert sorted(drafter.finished) == sorted(PROMPTS)  # every request's drafter state released


async def test_acceptance_stats_per_segment_and_depth():
    scheduler = make_scheduler()
    await run_all(scheduler, make_speculator(FakeDrafter(num_right=2, segment="json")), {"a": [5, 6, 7]}, 40)
    stats = scheduler.acceptance.segments["json"]
    assert stats is not None and stats.num_verified > 0
    rates = stats.acceptance_rate_by_depth
    # The chain is right for 2 nodes, then wrong: depths 1-2 always accepted, depth 3 never.
    assert rates[:2] == [1.0, 1.0] and rates[2] == 0.0
    assert stats.num_accepted_tokens == 2 * stats.num_verified
    assert scheduler.acceptance.total.num_verified == stats.num_verified


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 9])
async def test_multi_token_acceptance_stops_exactly_at_max_new_tokens(max_new_tokens):
    prompts = {"a": [5, 6, 7], "b": [40]}
    results, _ = await run_all(make_scheduler(), make_speculator(FakeDrafter(num_right=8), 8), prompts,
                               max_new_tokens)
    for rid, prompt in prompts.items():
        tokens, status = results[rid]
        assert tokens == reference(prompt, max_new_tokens) and len(tokens) == max_new_tokens
        assert status.name == "FINISHED_LENGTH"


async def test_multi_token_acceptance_stops_exactly_at_eos_and_at_a_stop_token():
    # Find a prompt whose greedy continuation hits EOS a few tokens in.
    prompt = next([t] for t in range(VOCAB) if EOS in reference([t], 12)[2:8])
    want = reference(prompt, 50)
    assert want[-1] == EOS and len(want) < 50
    results, _ = await run_all(make_scheduler(), make_speculator(FakeDrafter(num_right=12), 12), {"e": prompt}, 50)
    assert results["e"] == (want, results["e"][1]) and results["e"][1].name == "FINISHED_EOS_TOKEN"
    stop = reference([3], 10)[4]
    results, _ = await run_all(make_scheduler(), make_speculator(FakeDrafter(num_right=12), 12), {"s": [3]}, 50,
                               stop_token_ids=(stop,))
    tokens, status = results["s"]
    assert tokens[-1] == stop and stop not in tokens[:-1] and status.name == "FINISHED_STOP_TOKEN"
    assert tokens == reference([3], 50)[:len(tokens)]


async def test_context_length_is_not_overrun_by_drafts():
    scheduler = make_scheduler(max_model_len=12)
    results, _ = await run_all(scheduler, make_speculator(FakeDrafter(num_right=10), 10), {"a": [5, 6, 7]}, 50)
    tokens, status = results["a"]
    assert len(tokens) == 12 - 3 and tokens == reference([5, 6, 7], 9) and status.name == "FINISHED_CONTEXT_LENGTH"


async def test_drafts_fit_the_token_budget_and_never_preempt():
    prompts = {f"r{i}": [i + 1, 2 * i] for i in range(4)}
    plain_scheduler = make_scheduler(num_kv_blocks=10, block_size=2, max_num_batched_tokens=7)
    plain, _ = await run_all(plain_scheduler, None, prompts, 6)
    scheduler = make_scheduler(num_kv_blocks=10, block_size=2, max_num_batched_tokens=7)
    spec, worker = await run_all(scheduler, make_speculator(FakeDrafter(num_right=4), 8), prompts, 6)
    assert spec == plain
    assert worker.max_tokens_per_step <= 7
    assert scheduler.num_preemptions <= plain_scheduler.num_preemptions
    assert scheduler.acceptance.total.num_verified > 0


@pytest.mark.parametrize("mode", ["down", "raise", "empty", "oov", "bad_parents", "too_many", "forget"])
async def test_a_failing_or_garbage_drafter_never_changes_the_output(mode):
    drafter = FakeDrafter(num_right=3)
    speculator = make_speculator(drafter)
    drafter.mode = mode
    scheduler = make_scheduler()
    results, _ = await run_all(scheduler, speculator, PROMPTS)
    assert {rid: tokens for rid, (tokens, _) in results.items()} == expected(PROMPTS)
    if mode in ("oov", "bad_parents", "too_many"):
        assert speculator.num_garbage_trees > 0
    if mode == "forget":
        assert drafter.num_resyncs > 0 and scheduler.acceptance.total.num_verified > 0


async def test_resync_after_the_drafter_lost_state_sends_the_whole_sequence():
    drafter = FakeDrafter()
    scheduler, speculator = make_scheduler(), make_speculator(drafter)
    scheduler.add(Sequence("a", [5, 6, 7], stopping=StoppingCriteria(30)))
    worker = FakeTreeWorker(4)
    for _ in range(3):
        output = scheduler.schedule()
        await speculator.propose(scheduler, output)
        scheduler.postprocess(output, worker.step(output))
    drafter.state.clear()
    for _ in range(2):  # the first call answers needs_resync, the second resends all and gets a tree
        output = scheduler.schedule()
        await speculator.propose(scheduler, output)
        scheduler.postprocess(output, worker.step(output))
    seq = scheduler.requests["a"]
    assert drafter.num_resyncs == 1 and drafter.state["a"] == seq.token_ids[:len(drafter.state["a"])]
    assert seq.num_drafter_tokens == len(drafter.state["a"])


async def test_cancellation_releases_the_drafter_state():
    drafter = FakeDrafter()
    scheduler, speculator = make_scheduler(), make_speculator(drafter)
    for rid in ("keep", "gone"):
        scheduler.add(Sequence(rid, [5, 6], stopping=StoppingCriteria(40)))
    worker = FakeTreeWorker(4)
    for _ in range(3):
        output = scheduler.schedule()
        await speculator.propose(scheduler, output)
        scheduler.postprocess(output, worker.step(output))
    assert "gone" in drafter.state
    scheduler.abort("gone")
    output = scheduler.schedule()
    await speculator.propose(scheduler, output)
    assert drafter.finished == ["gone"] and "gone" not in drafter.state
    scheduler.postprocess(output, worker.step(output))
    scheduler.abort("keep")
    assert scheduler.block_manager.num_used_blocks == 0


def test_tree_helpers_prune_validate_and_check_paths():
    tree = DraftTree([10, 11, 12, 13, 14], [-1, -1, 0, 2, 1], "x")
    assert tree.depths == [1, 1, 2, 3, 2]
    assert prune_tree(tree, 10, 2) == DraftTree([10, 11, 12, 14], [-1, -1, 0, 1], "x")
    assert prune_tree(tree, 3, 5) == DraftTree([10, 11, 12], [-1, -1, 0], "x")
    assert tree_problem(tree, 100, 5) is None
    assert "vocabulary" in tree_problem(tree, 14, 5) and "more than" in tree_problem(tree, 100, 4)
    assert "parent" in tree_problem(DraftTree([1, 2], [-1, 1]), 100, 5)
    parents = [0, 0, 1, 3, 2]  # the worker's form of `tree`
    assert is_tree_path([10, 12, 13, 77], [10, 11, 12, 13, 14], parents)
    assert is_tree_path([77], [10, 11, 12, 13, 14], parents)
    assert not is_tree_path([10, 13, 77], [10, 11, 12, 13, 14], parents)
    assert rule([1, 2]) == (7 * 2 + 2) % VOCAB
