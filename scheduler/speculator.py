"""Speculation for one step: choose whom the drafter is asked about, ask it, and return the usable trees.

Two halves. For the Scheduler (its DraftChooser, pure logic): choose() decides, by the
policy, which decode sequences of the step schedule() just built the drafter is asked
about and for how many nodes; plan_ahead() / take_planned() decide whether the next step
may go ahead of the one in flight. For the engine's draft stage: draft(plan) asks the
drafter and returns the usable trees by request id, which Scheduler.finish_plan() fits
into the step. The speculator owns all drafter-side state: each request's sync point
(tokens the drafter holds), its segment, the final updates of ended requests, and the
acceptance stats. The scheduler tells it when a request ends (`forget`, its on_end
callback); it reads the step's sequences and never changes them. It drops garbage trees
and never raises: any failure means this step runs without speculation.

The drafter learns from every request, drafting or not: steps that draft
nothing (the gate is off, or no policy: learning only, `--no-speculation`) send
nothing, and when a request ends its tokens since the last sync go as a final
update (the whole sequence if the drafter never saw it; with the count of
tokens a drafter already received, so nothing is learned twice). Final updates
are batched and sent by a background task, one call at a time, never awaited
by a step.

With async scheduling the next step may go ahead of the step in flight only
where the gate keeps drafting off for every kind in it (`plan_ahead`) and no
sequence in it has a structured output (its grammar's forced span, a free draft
the scheduler adds to its tree, comes with the step's answer); anywhere else it
waits for the tokens its trees would start from.

A sequence with a structured output is drafted for like any other (the worker
cuts its tree to what its grammar allows); the trees that start with a forced
span are left out of the acceptance stats, which measure the drafter.

A request's segment kind is what the drafter reports; until its first query it
is "", a kind of its own at the gate. Where the gate keeps every kind of a step
off but another kind is open, the step asks the drafter, for no tree, about its
sequences never asked about or with a segment marker (the drafter lists their
tokens) among their tokens since (`_to_classify`), at most every CLASSIFY_INTERVAL
steps: a code edit whose prompt opens a code block drafts as code from its second
decode step, and an answer that opens one soon after the fence.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Container, Sequence
from contextvars import Context
from typing import Protocol

from protos.segserve.v1.draft import DraftQuery, DraftReply
from protos.segserve.v1.step import StepRequest
from protos.segserve.v1.step_result import StepResult, output_problem
from protos.segserve.v1.tree import CandidateTree
from scheduler.sequence import Sequence as Seq
from scheduler.spec_gate import GateDecision
from scheduler.spec_policy import AcceptanceStats, SpecPolicy
from scheduler.step_plan import NO_DRAFTS, DraftChoice, StepPlan

logger = logging.getLogger(__name__)

_LOG_EVERY = 100
CLASSIFY_INTERVAL = 8
"""Steps at least between two steps that ask the drafter about kinds alone (Speculator._to_classify)."""
_MAX_FINALS = 4096  # final updates waiting for the background call; past it the oldest are dropped


class Drafter(Protocol):
    """What the speculator needs from the drafter (DrafterClient, or a fake in tests)."""

    async def draft(self, queries: Sequence[DraftQuery], finished_ids: Sequence[str]) -> dict[str, DraftReply]: ...


class Speculator:
    """policy None = learning only: no tree is ever asked for, the drafter still learns every request."""

    def __init__(self, drafter: Drafter, policy: SpecPolicy | None, vocab_size: int,
                 clock: Callable[[], float] = time.perf_counter, classify_interval: int = CLASSIFY_INTERVAL):
        self.drafter = drafter
        self.policy = policy
        self.vocab_size = vocab_size
        self.clock = clock
        self.classify_interval = classify_interval
        self._num_steps_since_classify = classify_interval
        """Worker steps since the last step that asked about kinds alone (it waited for the drafter, and was not
        sent ahead): such a step comes at most every classify_interval steps, with all the requests due by then."""
        self.num_garbage_trees = 0
        self.num_errors = 0
        self.num_finals_dropped = 0
        """Final updates dropped because _MAX_FINALS waited already (their segments go unlearned)."""
        self._seqs: dict[str, Seq] = {}
        """Request id -> its sequence, for every request seen running (its final update reads its tokens)."""
        self._num_synced: dict[str, int] = {}
        """Request id -> tokens the drafter holds for it (0 = send the whole sequence); keys = requests
        the drafter has state for."""
        self._num_known: dict[str, int] = {}
        """Request id -> tokens a drafter acknowledged (and learned from), kept across resyncs."""
        self._segments: dict[str, str] = {}
        """Request id -> the segment kind the drafter last reported."""
        self._num_classified: dict[str, int] = {}
        """Request id -> its tokens when the drafter was last asked about it (it told, or failed to tell, its
        kind), or when they were last found free of segment markers (_to_classify)."""
        self._markers: frozenset[int] = frozenset()
        """The tokens of the drafters' segment markers, as their replies list them."""
        self._finals: list[DraftQuery] = []
        """Final updates of ended requests, for the background call."""
        self._sending: asyncio.Task | None = None
        self._planned: GateDecision | None = None
        """The gate's decision for the next step, made by plan_ahead() before the step in flight answered (it keeps
        drafting off for every kind)."""

    @property
    def is_drafting(self) -> bool:
        """Whether trees are ever asked for (False: learning only)."""
        return self.policy is not None

    @property
    def acceptance(self) -> AcceptanceStats:
        return self.policy.acceptance if self.policy is not None else AcceptanceStats()

    @property
    def num_ended_pending(self) -> int:
        """Ended requests whose final update has not been sent yet."""
        return len(self._finals)

    def forget(self, request_id: str) -> None:
        """A request ended (the scheduler's on_end): its final update goes with the next background call."""
        self._segments.pop(request_id, None)
        self._num_classified.pop(request_id, None)
        seq = self._seqs.pop(request_id, None)
        num_synced = self._num_synced.pop(request_id, 0)
        num_known = self._num_known.pop(request_id, 0)
        if seq is None:
            return  # never seen running (it ended while waiting): it generated nothing
        self._finals.append(DraftQuery(request_id, seq.token_ids[num_synced:], seq.num_tokens,
                                       seq.num_prompt_tokens, 0, num_known, is_final=True, tenant=seq.tenant,
                                       corpus_key=corpus_key(seq)))
        if len(self._finals) > _MAX_FINALS:
            del self._finals[0]
            self.num_finals_dropped += 1

    def choose(self, candidates: list[Seq], num_scheduled_tokens: int, room: int) -> DraftChoice:
        """Whom the drafter is asked about in a step schedule() built (candidates: its decode sequences), for how
        many nodes each, and the gate's decision (DraftChooser.choose). On any failure: nobody."""
        planned, self._planned = self._planned, None
        try:
            return self._choose(candidates, num_scheduled_tokens, room, planned)
        except Exception:  # a bug here must cost speed, never a request
            self._count_error()
            return NO_DRAFTS

    def plan_ahead(self, candidates: list[Seq], num_base_tokens: int, room: int) -> bool:
        """Async scheduling: whether the step after the one in flight (candidates: its decode sequences) may be
        built and sent now, before that one has answered. Only where the gate keeps drafting off for every kind in
        it (and explores none) and none of them has a structured output (whose forced span, a draft even with
        drafting off, comes with the answer): the policy then decides that step now (take_planned() gives its
        gate decision). Elsewhere the policy decides it after the result, in choose(), as without steps ahead: a
        tree needs the tokens the step in flight samples, and the budgets should see what it measured."""
        self._planned = None
        if self.policy is None:
            return True
        if any(seq.sampling.structured_output is not None for seq in candidates):
            return False
        groups = self._groups(candidates)
        if not candidates or not self.policy.keeps_off(groups) or self._to_classify(candidates, groups):
            return False
        self.policy.choose(groups, num_base_tokens, room)  # all 0
        self._planned = self.policy.last_gate_decision
        return True

    def take_planned(self) -> GateDecision | None:
        """The gate's decision for the step that plan_ahead() allowed and the scheduler has built."""
        planned, self._planned = self._planned, None
        return planned

    async def draft(self, plan: StepPlan) -> dict[str, CandidateTree]:
        """Ask the drafter about the plan's queries (choose()); the usable trees by request id. On any failure,
        none, and the step's cycle is not its gate decision's (plan.decision = None)."""
        seqs = self._seqs
        for seq in plan.seqs:  # every request runs a step built by schedule() before any step ahead
            if seq.request_id not in seqs:
                seqs[seq.request_id] = seq
        try:
            return await self._draft(plan.queries, plan.node_price) if plan.queries else {}
        except Exception:  # a bug here must cost speed, never a request
            plan.decision = None
            self._count_error()
            return {}
        finally:
            self._send_finals()  # after this step's own call, so that the drafter answers that one first

    def on_idle(self) -> None:
        """The engine has no work: a planned next step will not come, and the final updates go now, without
        waiting for another step."""
        self._planned = None
        self._send_finals()

    async def wait_finals_sent(self) -> None:
        """Send the final updates and wait until the drafter has answered them."""
        self._send_finals()
        while self._sending is not None and not self._sending.done():
            await asyncio.shield(self._sending)

    def _send_finals(self) -> None:
        """Start the background call for the waiting final updates, unless one is under way (it takes them)."""
        if self._finals and (self._sending is None or self._sending.done()):
            # in a context of its own: the call belongs to no step, so it carries no step's trace (traces.py)
            self._sending = asyncio.get_running_loop().create_task(self._send_all_finals(), context=Context())

    async def _send_all_finals(self) -> None:
        while self._finals:
            finals, self._finals = self._finals, []
            try:
                await self.drafter.draft(finals, [])
            except Exception:
                self.num_errors += 1

    def observe_step(self, request: StepRequest, result: StepResult, seconds: float | None,
                     forced_seq_ids: Container[str] = ()) -> None:
        """A worker step that succeeded: its time for the cost model, its verified trees for the stats.

        seconds: the step's round trip, or None for a step sent ahead, which waited at the worker for the step
        before it (SpecPolicy.observe_step prices it from its compute time, StepResult.compute_us).
        forced_seq_ids: the sequences whose tree starts with a forced span (StepPlan.forced_seq_ids), not counted."""
        if self.policy is None:
            return
        self._num_steps_since_classify += 1
        # a request of several decode steps is priced as that many steps (each computes the same tokens)
        num_steps = request.num_steps
        self.policy.observe_step(request.num_scheduled_tokens, result.compute_us / 1e6 / num_steps,
                                 None if seconds is None else seconds / num_steps, len(request.sequences))
        outputs = {output.seq_id: output for output in result.outputs}
        for work in request.sequences:
            output = outputs.get(work.seq_id)
            if (work.draft is None or output is None or output.error or work.seq_id in forced_seq_ids
                    or output_problem(work, output)):
                continue
            self.acceptance.record(self._segments.get(work.seq_id, ""), work.draft.max_depth, len(work.draft),
                                   len(output.token_ids) - 1)

    def observe_cycle(self, decision: GateDecision | None, num_generated_tokens: int, seconds: float) -> None:
        """A step, end to end, the tokens it generated and the gate's decision for it (StepPlan.decision, from
        choose() or take_planned()): for the gate."""
        if self.policy is not None:
            self.policy.observe_cycle(decision, num_generated_tokens, seconds)

    def _choose(self, candidates: list[Seq], num_scheduled_tokens: int, room: int, planned: GateDecision | None
                ) -> DraftChoice:
        if self.policy is None or not candidates:
            return NO_DRAFTS
        groups = self._groups(candidates)
        if planned is None:
            budgets = self.policy.choose(groups, num_scheduled_tokens, room)
            decision = self.policy.last_gate_decision
        else:  # decided by plan_ahead(), which the step ahead it allowed did not follow (the scheduler refused it)
            budgets, decision = {segment: 0 for segment in groups}, planned
        is_drafting = any(budgets.values())
        if not is_drafting:
            candidates = self._to_classify(candidates, groups)
            if not candidates:  # the drafter catches up on their tokens at the next call, or the final update
                return DraftChoice((), False, decision)
            self._num_steps_since_classify = 0
        queries = tuple((seq, budgets[self._segments.get(seq.request_id, "")]) for seq in candidates)
        price = self.policy.node_price(budgets, groups, num_scheduled_tokens)  # 0 where nothing is drafted
        return DraftChoice(queries, is_drafting, decision, price)

    async def _draft(self, chosen: tuple[tuple[Seq, int], ...], node_price: float = 0.0) -> dict[str, CandidateTree]:
        queries = [self._query(seq, max_nodes, node_price) for seq, max_nodes in chosen]
        self._num_classified.update((query.request_id, query.num_tokens) for query in queries)
        if self._finals:  # a reused id's old final update must not reach the drafter after its new first query
            queried = {query.request_id for query in queries}
            self._finals = [final for final in self._finals if final.request_id not in queried]
        start = self.clock()
        replies = await self.drafter.draft(queries, [])
        self.policy.observe_draft_call(self.clock() - start)
        return self._accept_replies([seq for seq, _ in chosen], queries, replies)

    def _count_error(self) -> None:
        self.num_errors += 1
        if self.num_errors % _LOG_EVERY == 1:
            logger.exception("speculation failed; the step runs without it (%d failures)", self.num_errors)

    def _to_classify(self, candidates: list[Seq], groups: Counter) -> list[Seq]:
        """The candidates whose kind may have changed since the drafter was last asked about them (never asked, or
        a segment marker among the tokens since), where their kind may let them draft: some kind absent from the
        step is open at its batch size (SpecPolicy.may_open_another_kind). A step that drafts for no kind asks the
        drafter about these alone, for no tree (a query of 0 nodes), so that a new request's kind is known from its
        first decode step, and a request whose output opens a code block drafts as code within classify_interval
        steps, not only once the gate explores its closed kind (every 16 to 256 steps). Once per request and
        marker: a drafter that does not answer leaves it to those explorations. At most every classify_interval
        steps, so that a batch that new requests keep joining does not wait for the drafter at every step."""
        if self._num_steps_since_classify < self.classify_interval or not self.policy.may_open_another_kind(groups):
            return []
        chosen = []
        for seq in candidates:
            num_classified = self._num_classified.get(seq.request_id)
            if num_classified is None or not self._markers.isdisjoint(seq.token_ids[num_classified:]):
                chosen.append(seq)
            else:  # nothing to rescan next time; a marker found stays found until the drafter is asked
                self._num_classified[seq.request_id] = seq.num_tokens
        return chosen

    def _groups(self, candidates: list[Seq]) -> Counter:
        """Segment kind -> how many of the candidates are in it."""
        return Counter(self._segments.get(seq.request_id, "") for seq in candidates)

    def _query(self, seq: Seq, max_nodes: int, node_price: float = 0.0) -> DraftQuery:
        num_synced = self._num_synced.setdefault(seq.request_id, 0)
        return DraftQuery(seq.request_id, seq.token_ids[num_synced:], seq.num_tokens, seq.num_prompt_tokens,
                          max_nodes, self._num_known.get(seq.request_id, 0) if num_synced == 0 else 0,
                          tenant=seq.tenant, corpus_key=corpus_key(seq), min_node_prob=node_price if max_nodes else 0.0)

    def _accept_replies(self, candidates: list[Seq], queries: list[DraftQuery],
                        replies: dict[str, DraftReply]) -> dict[str, CandidateTree]:
        """Usable trees by request id; updates each sequence's sync point and segment."""
        max_nodes = {q.request_id: q.max_nodes for q in queries}
        trees = {}
        for seq in candidates:
            request_id = seq.request_id
            reply = replies.get(request_id)
            if reply is None or request_id not in self._num_synced:
                continue  # its replica failed (the tokens are resent next time), or it ended meanwhile
            if reply.needs_resync:
                self._num_synced[request_id] = 0
                continue
            self._num_known[request_id] = seq.num_tokens  # the drafter took these tokens (and learned from them)
            problem = reply.tree.problem(self.vocab_size, max_nodes[request_id])
            if problem is not None:
                self.num_garbage_trees += 1
                if self.num_garbage_trees % _LOG_EVERY == 1:
                    logger.warning("drafter sent an unusable tree for %s (%d so far): %s", request_id,
                                   self.num_garbage_trees, problem)
                self._num_synced[request_id] = 0  # its state is suspect: resend everything
                continue
            self._num_synced[request_id] = seq.num_tokens
            self._segments[request_id] = seq.segment = reply.segment
            if reply.marker_token_ids and not self._markers.issuperset(reply.marker_token_ids):
                self._markers = self._markers.union(reply.marker_token_ids)
            if reply.tree:
                trees[request_id] = reply.tree
        return trees


def corpus_key(seq: Seq) -> str:
    """The drafter corpus of a request with a structured output: one per schema (kind and spec), so the
    requests of one schema, or of one forced tool call, learn each other's outputs; "" for free text."""
    structured = seq.sampling.structured_output
    if structured is None:
        return ""
    return "schema:" + hashlib.sha256(f"{structured.kind.name}\n{structured.spec}".encode()).hexdigest()[:16]
