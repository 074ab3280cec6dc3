"""The drafter learns from every request: a segment closing in a request's final step, one generated while the
gate keeps drafting off, and every request with speculation off (no policy: `--no-speculation`) are learned.

Pure scheduler + Speculator + tests/support/fakes.py's worker, with the real drafter servicer called in process.
"""

from __future__ import annotations

import pytest

from drafter.config import DrafterConfig
from drafter.segments import parse_segments
from drafter.server import build_servicer
from protos.segserve.v1.sampling import StoppingCriteria
from protos.segserve.v1.draft import DraftQuery, DraftReply
from scheduler.sequence import Sequence
from scheduler.spec_policy import SpecPolicy
from scheduler.speculator import Speculator
from tests.support.fake_drafter import FakeDrafter
from tests.support.fakes import FakeWorker
from tests.scheduler.test_spec import EOS, RULE, VOCAB, make_drafter, make_pair, make_scheduler, reference, step

MAX_TOKENS = 12


class InProcessDrafter:
    """The Drafter servicer's batch logic behind the speculator's Drafter interface (no network)."""

    def __init__(self, segments: dict):
        self.servicer = build_servicer(DrafterConfig(), parse_segments(segments))
        self.queries: list[DraftQuery] = []

    async def draft(self, queries, finished_ids) -> dict[str, DraftReply]:
        self.queries += queries
        replies = self.servicer.draft_batch(list(queries), list(finished_ids))
        return {reply.request_id: DraftReply.from_pb(reply) for reply in replies}

    def proposal(self, context: list[int]) -> list[int]:
        """What a later request whose tokens end with `context` gets drafted."""
        assert self.servicer.planner.wait_learned(10)
        (reply,) = self.servicer.draft_batch([DraftQuery("later", context, len(context), 1, 8)], [])
        return list(reply.tree.token_ids)


def _a_prompt_whose_output_closes_a_segment_at_its_last_token() -> tuple[list[int], list[int]]:
    """A prompt whose output's second token opens a segment that only its last token closes."""
    for first in range(2, VOCAB):
        prompt = [first, 3]
        output = reference(prompt, MAX_TOKENS)
        start, end = output[1], output[-1]
        if (len(output) == MAX_TOKENS and start != end and EOS not in output and start not in output[2:]
                and end not in prompt + output[:-1] and start not in prompt):
            return prompt, output
    raise AssertionError("no such prompt under the rule")


PROMPT, OUTPUT = _a_prompt_whose_output_closes_a_segment_at_its_last_token()
SEGMENTS = {"default": {"max_nodes": 6},
            "segment": [{"name": "code", "start": OUTPUT[1], "end": OUTPUT[-1], "max_nodes": 8, "max_depth": 8}]}


class _ClosedGate(SpecPolicy):
    """A policy whose gate keeps drafting off for every segment kind."""

    def choose(self, groups, num_base_tokens, token_room):
        return {segment: 0 for segment in groups}


@pytest.mark.parametrize("mode", ["drafting", "gate_off", "speculation_off"])
async def test_a_segment_closing_in_the_final_step_is_learned_and_proposed_later(mode):
    drafter = InProcessDrafter(SEGMENTS)
    policy = {"drafting": SpecPolicy(6, is_adaptive=False), "gate_off": _ClosedGate(6),
              "speculation_off": None}[mode]
    speculator = Speculator(drafter, policy, VOCAB)
    scheduler = make_scheduler(speculator)
    scheduler.add(Sequence("a", PROMPT, stopping=StoppingCriteria(MAX_TOKENS)))
    worker, results = FakeWorker(RULE, VOCAB, [EOS]), {}
    while scheduler.has_work:
        await step(scheduler, speculator, worker, results)
    assert results["a"][0] == OUTPUT
    await speculator.wait_finals_sent()
    (final,) = [q for q in drafter.queries if q.is_final]
    assert final.request_id == "a" and final.num_tokens == len(PROMPT) + MAX_TOKENS
    if mode != "drafting":  # the drafter never saw it: the whole sequence, and no query asked for a tree
        assert final.new_token_ids == PROMPT + OUTPUT and drafter.queries == [final]
    assert len(drafter.servicer.states) == 0  # the final update released the request
    segment = OUTPUT[1:]  # markers included
    assert drafter.proposal([9, *segment[:2]])[:6] == segment[2:8]


async def test_the_final_update_goes_in_the_background_not_on_the_step():
    drafter = make_drafter()
    drafter.delay_s = 0.05
    scheduler, speculator = make_pair(drafter)
    worker, results = FakeWorker(RULE, VOCAB, [EOS]), {}
    scheduler.add(Sequence("short", [5], stopping=StoppingCriteria(3)))
    scheduler.add(Sequence("long", [6, 7], stopping=StoppingCriteria(40)))
    while "short" in scheduler.requests:
        await step(scheduler, speculator, worker, results)
    assert speculator.num_ended_pending == 1
    calls = drafter.num_calls
    await step(scheduler, speculator, worker, results)  # starts the background call after its own
    assert drafter.num_calls == calls + 1 and drafter.finished == []  # the step awaited its own call only
    await speculator.wait_finals_sent()
    assert drafter.finished == ["short"] and drafter.finals["short"] == [5, *results["short"][0]]


async def test_learning_only_never_asks_for_a_tree_and_ends_every_request():
    drafter: FakeDrafter = make_drafter()
    speculator = Speculator(drafter, None, VOCAB)
    scheduler = make_scheduler(speculator)
    prompts = {"a": [5, 6, 7], "b": [40], "c": [1, 2, 3]}
    for rid, prompt in prompts.items():
        scheduler.add(Sequence(rid, prompt, stopping=StoppingCriteria(15)))
    worker, results = FakeWorker(RULE, VOCAB, [EOS]), {}
    while scheduler.has_work:
        await step(scheduler, speculator, worker, results)
    await speculator.wait_finals_sent()
    assert {rid: tokens for rid, (tokens, _) in results.items()} == {r: reference(p, 15) for r, p in prompts.items()}
    assert drafter.finals == {rid: prompt + results[rid][0] for rid, prompt in prompts.items()}
    assert speculator.acceptance.total.num_verified == 0 and drafter.state == {}
