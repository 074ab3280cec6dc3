"""Structured outputs in the scheduler: a sequence with a structured_output is drafted for like any other (the worker
cuts its tree to what its grammar allows), and the span its grammar forces, which the worker returns with its
tokens, becomes the first chain of its next tree for free: fresh only at the output length it came at, merged with
the drafter's tree, within the step's budget, and left out of the drafter's acceptance stats. It stops on EOS as any
sequence does.

The fake worker follows its rule (tests/support/fakes.py); `forcing` makes it answer a constrained sequence with the
rule's next tokens as its forced span, as a grammar that forces them would."""

from __future__ import annotations

import dataclasses

from protos.segserve.v1.generate import FinishReason
from protos.segserve.v1.info import WorkerInfo
from protos.segserve.v1.sampling import (
    SamplingParams,
    StoppingCriteria,
    StructuredKind,
    StructuredOutput,
)
from protos.segserve.v1.step import StepRequest
from protos.segserve.v1.step_result import StepResult
from protos.segserve.v1.tree import ROOT, CandidateTree
from scheduler.config import SchedulerConfig
from scheduler.drafting import forced_first, with_forced_spans
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from scheduler.speculator import Speculator, corpus_key
from scheduler.worker_link import WorkerLink, new_speculator
from tests.scheduler.test_scheduler import collect_events
from tests.scheduler.test_spec import (
    EOS,
    RULE,
    VOCAB,
    make_drafter,
    make_pair,
    make_speculator,
    planned,
    reference,
)
from tests.support.fakes import FakeWorker

CONSTRAINED = SamplingParams(structured_output=StructuredOutput(StructuredKind.REGEX, "[a-z]+"))


def forcing(worker: FakeWorker, request: StepRequest, num_forced: int) -> StepResult:
    """The worker's answer, each constrained sequence's output carrying the rule's next num_forced tokens after it
    as its forced span (a grammar forcing the right ones)."""
    result = worker.step_sync(request)
    for output in result.outputs:
        if output.token_ids and worker.sampling[output.seq_id].structured_output is not None:
            tokens = worker.kv[output.seq_id] + [output.token_ids[-1]]
            for _ in range(num_forced):
                tokens.append(RULE(tokens))
            output.forced_token_ids = tuple(tokens[-num_forced:])
    return result


async def run(scheduler: Scheduler, speculator: Speculator, worker: FakeWorker, num_forced: int = 0
              ) -> tuple[dict, dict[str, list[int]], list]:
    """Step to the end as the engine does; (results, per request the tokens of each of its steps, the plans)."""
    results: dict = {}
    per_step: dict[str, list[int]] = {}
    plans = []
    while scheduler.has_work:
        plan = scheduler.schedule()
        request = scheduler.finish_plan(plan, await speculator.draft(plan))
        plans.append(plan)
        result = forcing(worker, request, num_forced)
        speculator.observe_step(request, result, 0.01, plan.forced_seq_ids)
        for output in result.outputs:
            if output.token_ids:
                per_step.setdefault(output.seq_id, []).append(len(output.token_ids))
        collect_events(scheduler.postprocess(request, result), results)
    return results, per_step, plans


async def test_a_constrained_sequence_is_drafted_for_like_its_neighbour():
    scheduler, speculator = make_pair(make_drafter(num_right=4))
    worker = FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=64, block_size=4)
    scheduler.add(Sequence("json", [5, 6, 7], CONSTRAINED, StoppingCriteria(20)))
    scheduler.add(Sequence("free", [40], stopping=StoppingCriteria(20)))
    trees: dict[str, int] = {"json": 0, "free": 0}
    results: dict = {}
    while scheduler.has_work:
        request = await planned(scheduler, speculator)
        for work in request.sequences:
            trees[work.seq_id] += work.draft is not None
        result = worker.step_sync(request)
        speculator.observe_step(request, result, 0.01)
        collect_events(scheduler.postprocess(request, result), results)
    assert trees["json"] > 0 and trees["free"] > 0
    assert results["json"][0] == reference([5, 6, 7], 20) and results["free"][0] == reference([40], 20)


async def test_forced_spans_are_free_drafts_of_constrained_sequences_only():
    """A drafter with no trees: the constrained sequence still takes 1 + 3 tokens per step from its forced spans,
    which are announced only for it, never counted as the drafter's acceptance, and its output is unchanged."""
    drafter = make_drafter()
    drafter.mode = "empty"
    scheduler, speculator = make_pair(drafter, is_drafting_forced_spans=True)
    worker = FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=64, block_size=4)
    scheduler.add(Sequence("json", [5, 6, 7], CONSTRAINED, StoppingCriteria(20)))
    scheduler.add(Sequence("free", [40], stopping=StoppingCriteria(20)))
    results, per_step, plans = await run(scheduler, speculator, worker, num_forced=3)
    assert results["json"][0] == reference([5, 6, 7], 20) and results["free"][0] == reference([40], 20)
    assert per_step["free"] == [1] * 20
    assert per_step["json"] == [1] + [4] * 4 + [3]  # the first token, then the span and the bonus; max_tokens cuts
    announced = {new.seq_id: new.is_drafting_forced_spans for r in worker.requests for new in r.new_sequences}
    assert announced == {"json": True, "free": False}
    assert any("json" in plan.forced_seq_ids for plan in plans)
    assert speculator.acceptance.total.num_verified == 0  # the drafter drafted nothing


async def test_forced_spans_stay_off_without_speculation_on():
    drafter = make_drafter()
    drafter.mode = "empty"
    scheduler, speculator = make_pair(drafter)  # is_drafting_forced_spans=False: as with --no-speculation
    worker = FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=64, block_size=4)
    scheduler.add(Sequence("json", [5, 6, 7], CONSTRAINED, StoppingCriteria(8)))
    results, per_step, _ = await run(scheduler, speculator, worker, num_forced=3)
    assert results["json"][0] == reference([5, 6, 7], 8) and per_step["json"] == [1] * 8
    assert not any(new.is_drafting_forced_spans for r in worker.requests for new in r.new_sequences)


async def test_the_step_budget_bounds_a_forced_span():
    """A forced span costs no drafter call, but verification slots: 3 tokens per step leave 2 nodes for it."""
    drafter = make_drafter()
    drafter.mode = "empty"
    scheduler, speculator = make_pair(drafter, is_drafting_forced_spans=True, max_num_batched_tokens=3)
    worker = FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=64, block_size=4)
    scheduler.add(Sequence("json", [5, 6], CONSTRAINED, StoppingCriteria(13)))
    results, per_step, _ = await run(scheduler, speculator, worker, num_forced=5)
    assert results["json"][0] == reference([5, 6], 13) and per_step["json"] == [1] + [3] * 4
    assert max(r.num_scheduled_tokens for r in worker.requests) <= 3


def test_a_forced_span_is_drafted_only_at_the_length_it_came_at():
    seq = Sequence("json", [5, 6], CONSTRAINED)
    seq.token_ids += [7, 8]
    seq.forced_span, seq.forced_span_at = (9, 10), 2
    trees, ids = with_forced_spans({}, {"json": seq}, ())
    assert trees == {"json": CandidateTree((9, 10), (ROOT, 0))} and ids == {"json"}
    seq.token_ids.append(9)  # a step that did not take it (e.g. built ahead of its answer) went on meanwhile
    assert with_forced_spans({}, {"json": seq}, ()) == ({}, frozenset())


def test_the_drafters_tree_is_merged_after_the_forced_chain():
    # the drafter predicted the span's first two tokens, then went on (3, 4), and a sibling (7) at the root
    drafted = CandidateTree((1, 2, 3, 4, 7), (ROOT, 0, 1, 2, ROOT))
    merged = forced_first((1, 2, 3), drafted)
    assert merged == CandidateTree((1, 2, 3, 4, 7), (ROOT, 0, 1, 2, ROOT))  # 4 continues after the span
    diverged = forced_first((1, 5), drafted)
    assert diverged == CandidateTree((1, 5, 2, 3, 4, 7), (ROOT, 0, 0, 2, 3, ROOT))
    assert forced_first((1, 5), None) == CandidateTree((1, 5), (ROOT, 0))
    seq = Sequence("json", [5], CONSTRAINED)
    seq.token_ids.append(6)
    seq.forced_span, seq.forced_span_at = (1, 5), 1
    trees, _ = with_forced_spans({"json": drafted}, {"json": seq}, ((seq, 3),))
    assert trees["json"] == CandidateTree((1, 5, 2), (ROOT, 0, 0))  # the span first, then the drafter's budget


async def test_a_step_with_a_constrained_sequence_is_not_built_ahead():
    """Its forced span comes with the answer of the step in flight: a step built before it could not draft it."""
    scheduler, speculator = make_pair(make_drafter())
    speculator.policy.keeps_off = lambda groups: True  # the gate keeps every kind off: steps may go ahead
    free, constrained = Sequence("free", [40]), Sequence("json", [5], CONSTRAINED)
    assert speculator.plan_ahead([free], 1, 10)
    assert not speculator.plan_ahead([free, constrained], 2, 10)


async def test_eos_ends_a_constrained_sequence_as_any_other():
    """The worker's grammar allows only EOS once it is complete: the scheduler reports it as an EOS stop."""
    scheduler, speculator = make_pair(make_drafter(), is_drafting_forced_spans=True)
    worker = FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=64, block_size=4)
    prompt = next([p] for p in range(VOCAB) if reference([p], 40)[-1] == EOS)
    scheduler.add(Sequence("json", prompt, CONSTRAINED, StoppingCriteria(40)))
    results, _, _ = await run(scheduler, speculator, worker, num_forced=2)
    assert results["json"] == (reference(prompt, 40), FinishReason.EOS_TOKEN)


def test_the_grammar_drafts_switch_turns_forced_spans_off():
    link = WorkerLink(worker=None, address="w", is_watched=False, health_interval_s=1.0)
    info = WorkerInfo("m", num_kv_blocks=64, block_size=4, max_model_len=64, vocab_size=VOCAB, eos_token_ids=(EOS,))
    speculator = make_speculator(make_drafter())
    assert link.new_scheduler(SchedulerConfig(), info, speculator).is_drafting_forced_spans
    assert not link.new_scheduler(SchedulerConfig(is_grammar_drafts=False), info, speculator).is_drafting_forced_spans
    assert not link.new_scheduler(SchedulerConfig(), info, None).is_drafting_forced_spans


def test_a_worker_whose_model_keeps_state_per_sequence_gets_drafts_but_no_shared_prefixes():
    """WorkerInfo.sequence_state_reason (LFM2's convolutions, Mamba mixers): drafts and forced spans as for any
    model (the worker keeps a tree's accepted path's state), but the block manager shares no prefix."""
    link = WorkerLink(worker=None, address="w", is_watched=False, health_interval_s=1.0)
    plain = WorkerInfo("m", num_kv_blocks=64, block_size=4, max_model_len=64, vocab_size=VOCAB, eos_token_ids=(EOS,))
    stateful = dataclasses.replace(plain, sequence_state_reason="its layers [0] (Lfm2ShortConv) keep a state")
    config = SchedulerConfig()
    speculator = new_speculator(config, make_drafter(), stateful)
    assert speculator.is_drafting
    scheduler = link.new_scheduler(config, stateful, speculator)
    assert scheduler.is_drafting_forced_spans and not scheduler.block_manager.is_prefix_caching
    assert link.new_scheduler(config, plain, speculator).block_manager.is_prefix_caching


async def test_a_constrained_sequence_names_its_schemas_corpus_in_every_query():
    drafter = make_drafter()
    keys: dict[str, set[str]] = {}
    answer = drafter.draft_sync

    def recording(queries, finished_ids):
        for query in queries:
            keys.setdefault(query.request_id, set()).add(query.corpus_key)
        return answer(queries, finished_ids)

    drafter.draft_sync = recording
    scheduler, speculator = make_pair(drafter)
    worker = FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=64, block_size=4)
    other = SamplingParams(structured_output=StructuredOutput(StructuredKind.REGEX, "[a-z]*"))
    for request_id, sampling in (("json", CONSTRAINED), ("again", CONSTRAINED), ("other", other), ("free", None)):
        scheduler.add(Sequence(request_id, [5, 6, 7], sampling or SamplingParams(), StoppingCriteria(12)))
    await run(scheduler, speculator, worker)
    await speculator.wait_finals_sent()
    assert keys["json"] == keys["again"] == {corpus_key(Sequence("x", [1], CONSTRAINED, StoppingCriteria(1)))}
    (key,), (other_key,) = keys["json"], keys["other"]
    assert key.startswith("schema:") and len(key) == len("schema:") + 16 and other_key not in ("", key)
    assert keys["free"] == {""}
    assert set(drafter.finals) == {"json", "again", "other", "free"}  # the finals were among the recorded queries
