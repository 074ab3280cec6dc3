"""Structured outputs in the scheduler: a sequence with a structured_output never carries a candidate tree (the
worker does not prune trees by grammar yet), while its neighbours still do; it stops on EOS as any sequence does."""

from __future__ import annotations

from protos.segserve.v1.generate import FinishReason
from protos.segserve.v1.sampling import SamplingParams, StoppingCriteria, StructuredKind, StructuredOutput
from protos.segserve.v1.tree import CandidateTree
from scheduler.drafting import attach_drafts
from scheduler.sequence import Sequence
from tests.scheduler.test_scheduler import collect_events
from tests.scheduler.test_spec import EOS, RULE, VOCAB, make_drafter, make_pair, planned, reference
from tests.support.fakes import FakeWorker

CONSTRAINED = SamplingParams(structured_output=StructuredOutput(StructuredKind.REGEX, "[a-z]+"))


async def test_a_constrained_sequence_gets_no_tree_and_its_neighbour_does():
    scheduler, speculator = make_pair(make_drafter(num_right=4))
    worker = FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=64, block_size=4)
    scheduler.add(Sequence("json", [5, 6, 7], CONSTRAINED, StoppingCriteria(20)))
    scheduler.add(Sequence("free", [40], stopping=StoppingCriteria(20)))
    results: dict = {}
    trees: dict[str, int] = {"json": 0, "free": 0}
    while scheduler.has_work:
        request = await planned(scheduler, speculator)
        for work in request.sequences:
            trees[work.seq_id] += work.draft is not None
        result = worker.step_sync(request)
        speculator.observe_step(request, result, 0.01)
        collect_events(scheduler.postprocess(request, result), results)
    assert trees["json"] == 0 and trees["free"] > 0
    assert results["json"][0] == reference([5, 6, 7], 20) and results["free"][0] == reference([40], 20)


async def test_only_constrained_sequences_do_not_call_the_drafter_for_trees():
    scheduler, speculator = make_pair(make_drafter(num_right=4))
    worker = FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=64, block_size=4)
    scheduler.add(Sequence("json", [5, 6, 7], CONSTRAINED, StoppingCriteria(12)))
    while scheduler.has_work:
        plan = scheduler.schedule()
        assert all(num_nodes == 0 for _, num_nodes in plan.queries) and not plan.is_drafting
        request = scheduler.finish_plan(plan, await speculator.draft(plan))
        scheduler.postprocess(request, worker.step_sync(request))


def test_attach_drafts_leaves_a_constrained_sequence_without_its_tree():
    scheduler, _ = make_pair(make_drafter())
    scheduler.add(Sequence("json", [5, 6, 7], CONSTRAINED, StoppingCriteria(20)))
    worker = FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=64, block_size=4)
    request = scheduler.schedule().request  # the prefill
    scheduler.postprocess(request, worker.step_sync(request))
    request = scheduler.schedule().request  # a decode step
    in_flight = {seq.request_id: seq for seq in scheduler.running}
    attach_drafts(request, {"json": CandidateTree((1, 2), (-1, 0))}, in_flight, 100, 512, scheduler.block_manager)
    assert [work.draft for work in request.sequences] == [None]


async def test_eos_ends_a_constrained_sequence_as_any_other():
    """The worker's grammar allows only EOS once it is complete: the scheduler reports it as an EOS stop."""
    scheduler, speculator = make_pair(make_drafter())
    worker = FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=64, block_size=4)
    prompt = next([p] for p in range(VOCAB) if reference([p], 40)[-1] == EOS)
    scheduler.add(Sequence("json", prompt, CONSTRAINED, StoppingCriteria(40)))
    results: dict = {}
    while scheduler.has_work:
        request = await planned(scheduler, speculator)
        collect_events(scheduler.postprocess(request, worker.step_sync(request)), results)
    assert results["json"] == (reference(prompt, 40), FinishReason.EOS_TOKEN)
