"""Continuous batching as pure logic: which tokens of which sequences run each step.

No model, no network, no asyncio: schedule() returns a SchedulerOutput,
postprocess() takes what the worker sampled and returns per-request outputs.
One code path serves prompt chunks and decode tokens alike (vLLM v1 style):
each step computes up to `num_uncomputed_tokens` of every running sequence,
within max_num_batched_tokens and max_num_seqs. Speculation plugs in between
schedule() and the worker: draft_candidates() names the decode sequences,
attach_drafts() turns them into candidate trees within the leftover budget.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping

from scheduler.block_manager import BlockManager
from scheduler.draft_trees import fit_tree, max_depth_of, worker_parents
from scheduler.outputs import (
    DraftTree,
    NewSequence,
    RequestOutput,
    SampledTokens,
    ScheduledSequence,
    SchedulerOutput,
)
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.spec_policy import AcceptanceStats
from scheduler.stopping import append_sampled


class RequestRejected(ValueError):
    """A request that can never run (too long for the model or the KV cache) or clashes with a live one."""


class QueueFull(RuntimeError):
    """The waiting queue is at its bound in requests or prompt tokens; the client should retry later."""


class Scheduler:
    """Owns the waiting queue (FIFO), the running list and the KV-block allocation.

    Call order per step: schedule() -> (worker) -> postprocess() or, if the
    step failed, discard(). add() and abort() may be called at any time.
    """

    def __init__(
        self,
        *,
        num_kv_blocks: int,
        block_size: int,
        max_model_len: int,
        eos_token_ids: Iterable[int],
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_num_waiting: int = 1024,
        max_num_waiting_tokens: int = 262144,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.block_manager = BlockManager(num_kv_blocks, block_size)
        # Longest sequence (prompt + output) that can exist; reaching it ends generation.
        # The last sampled token needs no KV slot, hence the + 1.
        self.max_len = min(max_model_len, self.block_manager.num_total_tokens + 1)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Back-pressure: a queue longer than this only adds latency, so add() refuses at once.
        self.max_num_waiting = max_num_waiting
        self.max_num_waiting_tokens = max_num_waiting_tokens
        self.clock = clock
        self.requests: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        # In admission order: the last one is the first to be preempted.
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_steps = 0
        self._finished_seq_ids: list[str] = []
        self.finished_draft_ids: list[str] = []
        """Ended sequences the drafter knew; the speculator drains it into its next Draft call."""
        self.acceptance = AcceptanceStats()
        self._in_flight: dict[str, Sequence] = {}
        self._is_preempting = False  # whether the current schedule() has preempted anything

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting sequences still have to compute (a preempted one recomputes all of its own)."""
        return sum(seq.num_uncomputed_tokens for seq in self.waiting)

    def add(self, seq: Sequence) -> None:
        """Queue a new request (FIFO).

        Raises RequestRejected if it can never run, QueueFull if the waiting
        queue is at max_num_waiting requests or would pass max_num_waiting_tokens
        (an empty queue takes any request that fits, so a long prompt is not refused forever).
        """
        if seq.request_id in self.requests:
            raise RequestRejected(f"request_id {seq.request_id!r} is already live")
        if seq.num_prompt_tokens == 0:
            raise RequestRejected("prompt_token_ids must not be empty")
        if seq.stopping.max_new_tokens <= 0:
            raise RequestRejected("stopping.max_new_tokens must be > 0")
        if seq.num_prompt_tokens >= self.max_len:
            raise RequestRejected(
                f"prompt_token_ids has {seq.num_prompt_tokens} tokens; at most {self.max_len - 1} fit "
                f"(max_model_len and KV-cache capacity leave room for one generated token)")
        if len(self.waiting) >= self.max_num_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting; retry later")
        num_waiting_tokens = self.num_waiting_tokens
        if self.waiting and num_waiting_tokens + seq.num_prompt_tokens > self.max_num_waiting_tokens:
            raise QueueFull(f"{num_waiting_tokens} prompt tokens are already waiting (at most "
                            f"{self.max_num_waiting_tokens}); retry later")
        for finished in (self._finished_seq_ids, self.finished_draft_ids):
            if seq.request_id in finished:
                # Its first step restarts the worker's (drafter's) state; a release after it would drop the new one.
                finished.remove(seq.request_id)
        seq.status = SequenceStatus.WAITING
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a live request at once (its blocks are free for the next step); False if unknown."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        self._finish(seq, SequenceStatus.FINISHED_ABORTED)
        return True

    def schedule(self) -> SchedulerOutput:
        """Choose this step's work: running sequences first, then waiting ones in arrival order."""
        budget = self.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        self._is_preempting = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)  # >= 1: the last sampled token at least
            if not self._allocate_or_preempt(seq, num_new):
                break  # seq was the last one left to preempt
            chosen.append((seq, num_new))
            budget -= num_new
            index += 1
        # Admitting while short of blocks would only preempt again next step.
        while self.waiting and not self._is_preempting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(seq, num_new):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen.append((seq, num_new))
            budget -= num_new
        return self._build_output(chosen)

    def draft_candidates(self, output: SchedulerOutput) -> list[Sequence]:
        """This step's decode sequences: their only uncomputed token is the last sampled one."""
        return [seq for work in output.scheduled
                if (seq := self._in_flight[work.seq_id]).num_uncomputed_tokens == 1 and work.sample_indices]

    def attach_drafts(self, output: SchedulerOutput, trees: Mapping[str, DraftTree]) -> None:
        """Turn decode work into tree verification, within the step's token budget and free KV blocks.

        Trees shrink (or drop) to fit: the budget left after schedule(), the
        stop conditions (no node past max_new_tokens or the context), and the
        free blocks (drafts never preempt anything).
        """
        room = self.max_num_batched_tokens - output.num_scheduled_tokens
        for index, work in enumerate(output.scheduled):
            tree = trees.get(work.seq_id)
            seq = self._in_flight.get(work.seq_id)
            if tree is None or seq is None or not work.sample_indices or seq.num_uncomputed_tokens != 1:
                continue
            tree = fit_tree(tree, seq, room, self.max_len, self.block_manager)
            if not tree.token_ids:
                continue
            self.block_manager.allocate(seq, 1 + len(tree.token_ids))
            room -= len(tree.token_ids)
            output.scheduled[index] = ScheduledSequence(
                seq_id=work.seq_id, token_ids=work.token_ids + tree.token_ids,
                num_computed_tokens=work.num_computed_tokens, block_table=list(seq.block_table),
                sample_indices=[], draft_parents=worker_parents(tree))

    def postprocess(self, output: SchedulerOutput, sampled: Mapping[str, SampledTokens]) -> list[RequestOutput]:
        """Account the step's computed tokens, append sampled ones, apply stop conditions.

        `sampled` holds an entry for every sampled work (sample indices or a
        tree). Sequences aborted while the step ran are skipped.
        """
        now = self.clock()
        results = []
        in_flight, self._in_flight = self._in_flight, {}
        for work in output.scheduled:
            seq = in_flight.get(work.seq_id)
            if seq is None or seq.is_finished:
                continue
            if work.draft_parents:  # root + accepted drafts are in KV; rejected nodes' blocks go back
                num_returned = len(sampled[work.seq_id].token_ids)
                seq.num_computed_tokens += num_returned
                self.block_manager.trim(seq)
                self.acceptance.record(seq.segment, max_depth_of(work.draft_parents), work.num_draft_tokens,
                                       num_returned - 1)
            else:
                seq.num_computed_tokens += len(work.token_ids)
            if work.is_sampled:
                result = append_sampled(seq, sampled[work.seq_id], now, self.eos_token_ids, self.max_len)
                if result.is_finished:
                    self._finish(seq, result.finish_status)
                results.append(result)
        return results

    def discard(self, output: SchedulerOutput) -> list[str]:
        """Forget a step that failed; returns the ids of its sequences still live (the caller aborts them)."""
        in_flight, self._in_flight = self._in_flight, {}
        return [work.seq_id for work in output.scheduled
                if (seq := in_flight.get(work.seq_id)) is not None and not seq.is_finished]

    def _allocate_or_preempt(self, seq: Sequence, num_new: int) -> bool:
        """Allocate blocks for seq, preempting the latest-admitted sequences while short.

        False when seq itself had to be preempted. Never preempts a sequence
        already chosen this step: those sit before seq in `running`.
        """
        while not self.block_manager.can_allocate(seq, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, num_new)
        return True

    def _preempt(self, seq: Sequence) -> None:
        # The worker keeps the sequence's sampling state: a step with
        # num_computed_tokens = 0 makes it recompute prompt + output so far.
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self._is_preempting = True

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        del self.requests[seq.request_id]
        if seq.is_known_to_worker:
            self._finished_seq_ids.append(seq.request_id)
        if seq.is_known_to_drafter:
            self.finished_draft_ids.append(seq.request_id)

    def _build_output(self, chosen: list[tuple[Sequence, int]]) -> SchedulerOutput:
        output = SchedulerOutput()
        if not chosen:
            return output  # finished ids wait for the next step that runs
        now = self.clock()
        for seq, num_new in chosen:
            start = seq.num_computed_tokens
            is_at_end = start + num_new == seq.num_tokens
            output.scheduled.append(ScheduledSequence(
                seq_id=seq.request_id,
                token_ids=seq.token_ids[start:start + num_new],
                num_computed_tokens=start,
                block_table=list(seq.block_table),
                sample_indices=[num_new - 1] if is_at_end else [],
            ))
            if not seq.is_known_to_worker:
                output.new_sequences.append(NewSequence(seq.request_id, seq.sampling, seq.num_prompt_tokens))
                seq.is_known_to_worker = True
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            seq.max_batch_size = max(seq.max_batch_size, len(chosen))
            self._in_flight[seq.request_id] = seq
        output.finished_seq_ids, self._finished_seq_ids = self._finished_seq_ids, []
        self.num_steps += 1
        return output
