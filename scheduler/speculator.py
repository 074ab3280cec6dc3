"""Speculation for one step: ask the drafter for trees and attach those that are usable.

In: the Scheduler and the SchedulerOutput that schedule() just made. Out: the
same output with candidate trees on the decode sequences the policy chose,
within the step's budget. It keeps each sequence's drafter sync point (tokens
sent so far), drops garbage trees, and never raises: any failure means this
step runs without speculation.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol

from scheduler.draft_trees import tree_problem
from scheduler.drafter_client import DraftQuery, DraftReply
from scheduler.outputs import DraftTree, SchedulerOutput
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence as Seq
from scheduler.spec_policy import SpecPolicy

logger = logging.getLogger(__name__)

_LOG_EVERY = 100
_MAX_FINISHED_BACKLOG = 256  # ended ids sent on their own once this many wait for a speculating step


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
        self._last_step = (0, False)  # (decode sequences, whether it speculated) of the step proposed last

    async def propose(self, scheduler: Scheduler, output: SchedulerOutput) -> None:
        """Attach candidate trees to output's decode sequences (or nothing, on any failure)."""
        self._last_step = (0, False)
        try:
            await self._propose(scheduler, output)
        except Exception:  # a bug here must cost speed, never a request
            self.num_errors += 1
            if self.num_errors % _LOG_EVERY == 1:
                logger.exception("speculation failed; the step runs without it (%d failures)", self.num_errors)

    async def flush_finished(self, scheduler: Scheduler) -> None:
        """Tell the drafter about ended requests now (the engine calls this before it idles)."""
        if scheduler.finished_draft_ids:
            finished, scheduler.finished_draft_ids = scheduler.finished_draft_ids, []
            try:
                await self.drafter.draft([], finished)
            except Exception:
                self.num_errors += 1

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A worker step's measured time, for the cost model."""
        self.policy.observe_step(num_tokens, seconds)

    def observe_cycle(self, num_generated_tokens: int, seconds: float) -> None:
        """The last proposed step, end to end, and the tokens it generated: for the gate."""
        num_sequences, is_speculating = self._last_step
        self.policy.observe_cycle(num_sequences, is_speculating, num_generated_tokens, seconds)

    async def _propose(self, scheduler: Scheduler, output: SchedulerOutput) -> None:
        candidates = scheduler.draft_candidates(output)
        groups = Counter(seq.segment for seq in candidates)
        room = scheduler.max_num_batched_tokens - output.num_scheduled_tokens
        budgets = self.policy.choose(groups, output.num_scheduled_tokens, room) if candidates else {}
        is_speculating = any(budgets.values())
        self._last_step = (len(candidates), is_speculating)
        if not is_speculating and len(scheduler.finished_draft_ids) < _MAX_FINISHED_BACKLOG:
            return  # the drafter catches up on these sequences' tokens at the next call
        finished, scheduler.finished_draft_ids = scheduler.finished_draft_ids, []
        queries = [self._query(seq, budgets[seq.segment]) for seq in candidates] if is_speculating else []
        start = self.clock()
        replies = await self.drafter.draft(queries, finished)
        self.policy.observe_draft_call(self.clock() - start)
        trees = self._accept_replies(candidates, queries, replies)
        scheduler.attach_drafts(output, trees)

    def _query(self, seq: Seq, max_nodes: int) -> DraftQuery:
        seq.is_known_to_drafter = True
        return DraftQuery(seq.request_id, seq.token_ids[seq.num_drafter_tokens:], seq.num_tokens,
                          seq.num_prompt_tokens, max_nodes)

    def _accept_replies(self, candidates: list[Seq], queries: list[DraftQuery],
                        replies: dict[str, DraftReply]) -> dict[str, DraftTree]:
        """Usable trees by request id; updates each sequence's sync point and segment."""
        max_nodes = {q.request_id: q.max_nodes for q in queries}
        trees = {}
        for seq in candidates:
            reply = replies.get(seq.request_id)
            if reply is None:
                continue  # its replica failed: the tokens are resent next time
            if reply.needs_resync:
                seq.num_drafter_tokens = 0
                continue
            problem = tree_problem(reply.tree, self.vocab_size, max_nodes[seq.request_id])
            if problem is not None:
                self.num_garbage_trees += 1
                if self.num_garbage_trees % _LOG_EVERY == 1:
                    logger.warning("drafter sent an unusable tree for %s (%d so far): %s", seq.request_id,
                                   self.num_garbage_trees, problem)
                seq.num_drafter_tokens = 0  # its state is suspect: resend everything
                continue
            seq.num_drafter_tokens = seq.num_tokens
            seq.segment = reply.tree.segment
            if reply.tree.token_ids:
                trees[seq.request_id] = reply.tree
        return trees
