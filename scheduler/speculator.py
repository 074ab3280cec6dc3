"""Speculation for one step: ask the drafter for trees and attach those that are usable.

In: the Scheduler and the StepRequest that schedule() just made. Out: the same
request with candidate trees on the decode sequences the policy chose, within
the step's budget. The speculator owns all drafter-side state: each request's
sync point (tokens the drafter holds), its segment, the backlog of ended
requests to release, and the acceptance stats. The scheduler tells it when a
request ends (`forget`, its on_end callback); it never touches the scheduler's
fields. It drops garbage trees and never raises: any failure means this step
runs without speculation.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

from protos.segserve.v1.step import StepRequest, StepResult, output_problem
from protos.segserve.v1.tree import CandidateTree
from scheduler.drafter_client import DraftQuery, DraftReply
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence as Seq
from scheduler.spec_policy import AcceptanceStats, SpecPolicy

logger = logging.getLogger(__name__)

_LOG_EVERY = 100
_MAX_ENDED_BACKLOG = 256  # ended ids sent on their own once this many wait for a speculating step


class Drafter(Protocol):
    """What the speculator needs from the drafter (DrafterClient, or a fake in tests)."""

    async def draft(self, queries: Sequence[DraftQuery], finished_ids: Sequence[str]) -> dict[str, DraftReply]: ...


class Speculator:
    def __init__(self, drafter: Drafter, policy: SpecPolicy, vocab_size: int,
                 clock: Callable[[], float] = time.perf_counter):
        self.drafter = drafter
        self.policy = policy
        self.vocab_size = vocab_size
        self.clock = clock
        self.num_garbage_trees = 0
        self.num_errors = 0
        self._num_synced: dict[str, int] = {}
        """Request id -> tokens the drafter holds for it (0 = send the whole sequence); keys = requests
        the drafter has state for."""
        self._segments: dict[str, str] = {}
        """Request id -> the segment kind the drafter last reported."""
        self._ended: list[str] = []
        """Ended requests the drafter still holds state for, to release with the next call."""
        self._last_step = (0, False)  # (decode sequences, whether it speculated) of the step proposed last

    @property
    def acceptance(self) -> AcceptanceStats:
        return self.policy.acceptance

    @property
    def num_ended_pending(self) -> int:
        """Ended requests not yet released at the drafter."""
        return len(self._ended)

    def forget(self, request_id: str) -> None:
        """A request ended (the scheduler's on_end): release its drafter state with the next call."""
        self._segments.pop(request_id, None)
        if self._num_synced.pop(request_id, None) is not None:
            self._ended.append(request_id)

    async def propose(self, scheduler: Scheduler, request: StepRequest) -> None:
        """Attach candidate trees to the request's decode sequences (or nothing, on any failure)."""
        self._last_step = (0, False)
        try:
            await self._propose(scheduler, request)
        except Exception:  # a bug here must cost speed, never a request
            self.num_errors += 1
            if self.num_errors % _LOG_EVERY == 1:
                logger.exception("speculation failed; the step runs without it (%d failures)", self.num_errors)

    async def flush_ended(self) -> None:
        """Tell the drafter about ended requests now (the engine calls this before it idles)."""
        if self._ended:
            ended, self._ended = self._ended, []
            try:
                await self.drafter.draft([], ended)
            except Exception:
                self.num_errors += 1

    def observe_step(self, request: StepRequest, result: StepResult, seconds: float) -> None:
        """A worker step that succeeded: its time for the cost model, its verified trees for the stats."""
        self.policy.observe_step(request.num_scheduled_tokens, seconds)
        outputs = {output.seq_id: output for output in result.outputs}
        for work in request.sequences:
            output = outputs.get(work.seq_id)
            if work.draft is None or output is None or output.error or output_problem(work, output):
                continue
            self.acceptance.record(self._segments.get(work.seq_id, ""), work.draft.max_depth, len(work.draft),
                                   len(output.token_ids) - 1)

    def observe_cycle(self, num_generated_tokens: int, seconds: float) -> None:
        """The last proposed step, end to end, and the tokens it generated: for the gate."""
        num_sequences, is_speculating = self._last_step
        self.policy.observe_cycle(num_sequences, is_speculating, num_generated_tokens, seconds)

    async def _propose(self, scheduler: Scheduler, request: StepRequest) -> None:
        candidates = scheduler.draft_candidates(request)
        groups = Counter(self._segments.get(seq.request_id, "") for seq in candidates)
        budgets = (self.policy.choose(groups, request.num_scheduled_tokens, scheduler.draft_room(request))
                   if candidates else {})
        is_speculating = any(budgets.values())
        self._last_step = (len(candidates), is_speculating)
        if not is_speculating and len(self._ended) < _MAX_ENDED_BACKLOG:
            return  # the drafter catches up on these sequences' tokens at the next call
        queries = ([self._query(seq, budgets[self._segments.get(seq.request_id, "")]) for seq in candidates]
                   if is_speculating else [])
        queried = {query.request_id for query in queries}
        # A reused id's old state must not be released after its new first query.
        ended, self._ended = [i for i in self._ended if i not in queried], []
        start = self.clock()
        replies = await self.drafter.draft(queries, ended)
        self.policy.observe_draft_call(self.clock() - start)
        scheduler.attach_drafts(request, self._accept_replies(candidates, queries, replies))

    def _query(self, seq: Seq, max_nodes: int) -> DraftQuery:
        num_synced = self._num_synced.setdefault(seq.request_id, 0)
        return DraftQuery(seq.request_id, seq.token_ids[num_synced:], seq.num_tokens, seq.num_prompt_tokens,
                          max_nodes)

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
            if reply.tree:
                trees[request_id] = reply.tree
        return trees
