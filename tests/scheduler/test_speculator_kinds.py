"""How the speculator learns a request's segment kind where that may let it draft: at its first decode step, again
after a segment marker, and at most every CLASSIFY_INTERVAL steps (Speculator._to_classify). Scheduler + Speculator
with tests/support/fakes.py's drafter and worker, as in tests/scheduler/test_spec.py."""

from __future__ import annotations

from protos.segserve.v1.sampling import StoppingCriteria
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from scheduler.spec_gate import GateState
from scheduler.spec_policy import SpecPolicy
from scheduler.speculator import CLASSIFY_INTERVAL, Speculator
from tests.support.fake_drafter import FakeDrafter
from tests.support.fakes import FakeWorker
from tests.scheduler.test_scheduler import collect_events
from tests.scheduler.test_spec import EOS, PROMPTS, RULE, VOCAB, make_scheduler, planned, reference, run_all, step


class RecordingDrafter(FakeDrafter):
    """A FakeDrafter that keeps every query but final updates."""

    def __init__(self, *args):
        super().__init__(*args)
        self.queries = []

    def draft_sync(self, queries, finished_ids):
        self.queries += [q for q in queries if not q.is_final]
        return super().draft_sync(queries, finished_ids)


def gated_pair(drafter: FakeDrafter, is_code_open: bool, is_prose_open: bool | None = None
               ) -> tuple[Scheduler, Speculator]:
    """An adaptive speculator whose gate has decided, at every batch size, against the unknown kind "" and for
    or against "code" (and "prose", unless None), exploring none of them for 256 steps."""
    policy = SpecPolicy(6)
    policy.cost.observe(1, 0.01)
    kinds = {"": False, "code": is_code_open} | ({} if is_prose_open is None else {"prose": is_prose_open})
    for bucket in (1, 2, 4, 8):
        for kind, is_open in kinds.items():
            policy.gate.states[(kind, bucket)] = GateState(explore_interval=256, is_open=is_open, is_decided=True)
    speculator = Speculator(drafter, policy, VOCAB)
    return make_scheduler(speculator), speculator


async def test_a_new_request_learns_its_kind_at_its_first_decode_step_where_that_kind_may_draft():
    drafter = RecordingDrafter(RULE, VOCAB, 3, "code")
    scheduler, speculator = gated_pair(drafter, is_code_open=True)
    speculator.policy.node_price = lambda budgets, groups, num_base_tokens: 0.25
    worker = FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=64, block_size=4)
    prompt = PROMPTS["a"]
    scheduler.add(Sequence("a", prompt, stopping=StoppingCriteria(20)))
    results: dict = {}
    await step(scheduler, speculator, worker, results)  # the prefill
    room = scheduler.max_num_batched_tokens - 1
    # "" alone keeps off, but its kind is not known yet: the step may not go ahead of the prefill
    assert not speculator.plan_ahead([scheduler.requests["a"]], 1, room)
    first_decode = await planned(scheduler, speculator)
    collect_events(scheduler.postprocess(first_decode, worker.step_sync(first_decode)), results)
    while scheduler.has_work:
        await step(scheduler, speculator, worker, results)
    assert results["a"][0] == reference(prompt, 20)
    first, second, *_ = drafter.queries
    assert (first.max_nodes, first.num_tokens) == (0, len(prompt) + 1)  # no tree, at its first decode step
    assert second.max_nodes > 0 and second.num_tokens == len(prompt) + 2
    assert speculator.acceptance.segments["code"].num_accepted_tokens > 0
    # a tree is asked for at the step's price of a draft token (SpecPolicy.node_price); an update only, at none
    assert first.min_node_prob == 0 and {q.min_node_prob for q in drafter.queries if q.max_nodes} == {0.25}


async def test_an_output_that_opens_a_segment_drafts_in_its_kind_from_the_step_after_the_marker():
    prompt, max_tokens = PROMPTS["a"], 30
    want = reference(prompt, max_tokens)
    # the marker: a token's first appearance, once a step may ask the drafter again (the first decode step did)
    k = next(i for i in range(CLASSIFY_INTERVAL, max_tokens) if want[i] not in prompt + want[:i])
    drafter = RecordingDrafter(RULE, VOCAB, 3, "prose")
    drafter.markers = {want[k]: "code"}
    scheduler, speculator = gated_pair(drafter, is_code_open=True, is_prose_open=False)
    results, _ = await run_all(scheduler, speculator, {"a": prompt}, max_tokens)
    assert results["a"][0] == want
    # Asked at the first decode step: "prose", closed. Asked again once the marker has come: "code", open.
    asked = [(q.max_nodes, q.num_tokens) for q in drafter.queries[:2]]
    assert asked == [(0, len(prompt) + 1), (0, len(prompt) + k + 1)]
    assert all(q.max_nodes > 0 for q in drafter.queries[2:]) and drafter.queries[2].num_tokens == len(prompt) + k + 2
    assert speculator.acceptance.segments["code"].num_accepted_tokens > 0


async def test_steps_that_ask_about_kinds_alone_come_at_most_every_classify_interval_steps():
    drafter = RecordingDrafter(RULE, VOCAB, 3, "prose")
    scheduler, speculator = gated_pair(drafter, is_code_open=True, is_prose_open=False)
    worker = FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=64, block_size=4)
    results: dict = {}
    asked_at: dict[str, int] = {}  # request id -> the step its first query went with
    calls_at = []
    for index in range(40):
        if index < 4:  # a new request joins at each of the first four steps
            scheduler.add(Sequence("abcd"[index], PROMPTS["abcd"[index]], stopping=StoppingCriteria(30)))
        num_calls = drafter.num_calls
        await step(scheduler, speculator, worker, results)
        if drafter.num_calls > num_calls:
            calls_at.append(index)
        for query in drafter.queries:
            asked_at.setdefault(query.request_id, index)
    assert set(asked_at) == set("abcd") and all(q.max_nodes == 0 for q in drafter.queries)
    assert all(later - earlier >= CLASSIFY_INTERVAL for earlier, later in zip(calls_at, calls_at[1:]))
    assert asked_at["a"] == 1 and max(asked_at.values()) == 1 + CLASSIFY_INTERVAL  # the rest, together


async def test_no_query_for_a_new_request_where_no_kind_may_draft():
    drafter = RecordingDrafter(RULE, VOCAB, 3, "code")
    scheduler, speculator = gated_pair(drafter, is_code_open=False)
    worker = FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=64, block_size=4)
    scheduler.add(Sequence("a", PROMPTS["a"], stopping=StoppingCriteria(20)))
    results: dict = {}
    await step(scheduler, speculator, worker, results)
    # every step may go ahead
    assert speculator.plan_ahead([scheduler.requests["a"]], 1, scheduler.max_num_batched_tokens - 1)
    while scheduler.has_work:
        await step(scheduler, speculator, worker, results)
    assert results["a"][0] == reference(PROMPTS["a"], 20)
    assert drafter.queries == []  # the drafter learns the request from its final update alone
    await speculator.wait_finals_sent()
    assert drafter.finals["a"] == PROMPTS["a"] + results["a"][0]
