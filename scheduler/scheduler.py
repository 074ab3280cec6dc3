"""Continuous batching as pure logic: which tokens of which sequences run each step.

No model, no network, no asyncio: schedule() returns the step's StepPlan
(step_plan.py), finish_plan() completes it once the drafter has answered,
postprocess() takes the worker's StepResult and returns events for the
requests' streams. One code path serves prompt chunks and decode tokens alike
(vLLM v1 style): each step computes up to `num_uncomputed_tokens` of every
running sequence, within max_num_batched_tokens and max_num_seqs.

Every decision about what runs next is made here: which sequences, which of
them the drafter is asked about (its `drafting` chooser, the Speculator, decides
by the speculation policy), the trees that fit (drafting.py turns decode work
into candidate trees within the leftover budget, a structured output's tree
starting with the span its grammar forces, which the worker returned with its
last tokens), how many decode steps a plain decode step takes (decode_steps.py),
and, with async scheduling, whether the next step can be built before the one in
flight answers (schedule_ahead()).

Prefix caching (block_manager.py): a sequence being admitted takes the
longest cached prefix of full blocks of its tokens and starts computing past
it; after every step, the blocks that became full of computed tokens are
hashed into the cache (never draft nodes: only positions below
num_computed_tokens). Every NewSequence carries the prompt, so the worker
knows the tokens it did not compute.

Faults: a SequenceOutput with `error` ends that request alone
(FinishReason.ERROR). A whole step that fails (fail_step(), or an answer that
does not fit the work) preempts all of its sequences for recomputation and
halves the batch-size cap, which grows back by one per CAP_GROWTH_STEPS
successful steps; a sequence that fails again running alone, or fails
max_failed_steps steps in a row, ends with FinishReason.ERROR (faults.py
decides a failed step's outcome and a lost worker's hand-over; this class applies them).

Beside it: admission.py decides which requests add() queues (RequestRejected, QueueFull); step_requests.py
builds the StepRequests of the plans that schedule() and schedule_ahead() return and keeps the record of what is
at the worker (StepLedger: the step in flight, the step ahead, the releases).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping

from protos.segserve.v1.generate import FinishReason
from protos.segserve.v1.step import CONTINUATION_REFUSED, ScheduledSequence, StepRequest
from protos.segserve.v1.step_result import SequenceOutput, StepResult, output_problem
from protos.segserve.v1.tree import CandidateTree
from scheduler.admission import QueueFull, RequestRejected, check_admission, check_not_live, num_waiting_tokens
from scheduler.block_manager import BlockManager
from scheduler.decode_steps import DecodeStepBudget, add_decode_steps
from scheduler.drafting import DraftChooser, attach_drafts, draft_candidates, with_forced_spans
from scheduler.faults import (
    lowered_seqs_cap, raised_seqs_cap, reset_for_another_worker, resume_index, sort_out_failed_step,
)
from scheduler.outputs import RequestEvent, completion, token_chunk
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.step_plan import StepPlan
from scheduler.step_requests import StepLedger, build_step, build_step_ahead
from scheduler.stopping import append_tokens

__all__ = ["QueueFull", "RequestRejected", "Scheduler"]  # add()'s errors, defined in admission.py


class Scheduler:
    """Owns the waiting queue (FIFO), the running list and the KV-block allocation.

    Call order per step: schedule() -> (drafter) -> finish_plan() -> (worker) ->
    postprocess(), or fail_step() / discard() when the step failed; with async
    scheduling, schedule_ahead() while the step runs. add() and abort() may be
    called at any time. `on_end(request_id)` is called for every request that
    leaves (finished, failed or aborted), e.g. so that the speculator can tell the
    drafter. `drafting` chooses whom the drafter is asked about (None: nobody).
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
        max_failed_steps: int = 8,
        is_prefix_caching: bool = True,
        is_block_table_delta: bool = False,
        num_decode_steps: int = 1,
        decode_steps_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        on_end: Callable[[str], None] | None = None,
        drafting: DraftChooser | None = None,
        is_drafting_forced_spans: bool = False,
    ):
        self.block_manager = BlockManager(num_kv_blocks, block_size, is_prefix_caching)
        # Longest sequence (prompt + output) that can exist; reaching it ends generation.
        # The last sampled token needs no KV slot, hence the + 1.
        self.max_len = min(max_model_len, self.block_manager.num_total_tokens + 1)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Back-pressure: a queue longer than this only adds latency, so add() refuses at once.
        self.max_num_waiting = max_num_waiting
        self.max_num_waiting_tokens = max_num_waiting_tokens
        self.max_failed_steps = max_failed_steps
        self.is_block_table_delta = is_block_table_delta
        """Steps send each sequence only the block-table entries its worker lacks (Sequence.num_blocks_sent), for a
        worker with WorkerInfo.block_table_deltas; otherwise whole tables."""
        self.decode_steps = DecodeStepBudget(num_decode_steps, decode_steps_s)
        """How many decode steps a plain decode step may take now (multi-step decoding)."""
        self.clock = clock
        self._on_end = on_end
        self._drafting = drafting
        self.is_drafting_forced_spans = is_drafting_forced_spans
        """Structured outputs draft the spans their grammar forces (speculation is on): the worker returns them,
        and each becomes the first chain of its sequence's next tree (drafting.with_forced_spans)."""
        self._forced: dict[str, Sequence] = {}
        """The sequences whose last answer carried a forced span, by id, until the next step is final."""
        self.requests: dict[str, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        # In admission order: the last one is the first to be preempted.
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_steps = 0
        self.num_failed_steps = 0
        self.num_seqs_cap = max_num_seqs
        """The batch-size cap after failed steps: halved by each, + 1 per CAP_GROWTH_STEPS successful steps
        (scheduler/faults.py)."""
        self._num_ok_steps = 0  # successful steps since the last failed one
        self._steps = StepLedger()  # in flight, ahead, releases
        self._is_preempting = False  # whether the current schedule() has preempted anything

    @property
    def current_step(self) -> StepRequest | None:
        """The step in flight (StepLedger.current_step)."""
        return self._steps.current_step

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting sequences still have to compute (a preempted one recomputes all of its own)."""
        return num_waiting_tokens(self.waiting)

    @property
    def num_seqs_limit(self) -> int:
        """Most sequences in the next step: max_num_seqs, lowered while steps fail."""
        return min(self.max_num_seqs, self.num_seqs_cap)

    def add(self, seq: Sequence) -> None:
        """Queue a new request (FIFO); it must have passed generate.validate_request().

        Raises RequestRejected if it can never run here, QueueFull if the waiting
        queue is at max_num_waiting requests or would pass max_num_waiting_tokens
        (an empty queue takes any request that fits, so a long prompt is not refused forever).
        """
        check_admission(seq, self.requests, self.waiting, max_len=self.max_len, max_num_waiting=self.max_num_waiting,
                        max_num_waiting_tokens=self.max_num_waiting_tokens)
        self._steps.keep(seq.request_id)
        seq.status = SequenceStatus.WAITING
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a live request at once (its blocks are free for the next step); False if unknown."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        self._end(seq, SequenceStatus.ABORTED)
        return True

    def schedule(self) -> StepPlan:
        """Choose this step's work: running sequences first, then waiting ones in arrival order; and whom the
        drafter is asked about (finish_plan() takes its trees). An empty plan when nothing is runnable."""
        budget = self.max_num_batched_tokens
        limit = self.num_seqs_limit
        chosen: list[tuple[Sequence, int]] = []
        self._is_preempting = False
        index = 0
        while index < len(self.running) and index < limit and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)  # >= 1: the last sampled token at least
            if not self._allocate_or_preempt(seq, num_new):
                break  # seq was the last one left to preempt
            chosen.append((seq, num_new))
            budget -= num_new
            index += 1
        # Admitting while short of blocks would only preempt again next step.
        while self.waiting and not self._is_preempting and budget > 0 and len(self.running) < limit:
            seq = self.waiting[0]
            prefix = self.block_manager.cached_prefix(seq)
            num_new = min(seq.num_tokens - len(prefix) * self.block_manager.block_size, budget)
            if not self.block_manager.can_admit(prefix, num_new):
                break
            self.waiting.popleft()
            self.block_manager.admit(seq, prefix, num_new)  # num_computed_tokens starts past the cached prefix
            if seq.num_cached_prompt_tokens is None:
                seq.num_cached_prompt_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chosen.append((seq, num_new))
            budget -= num_new
        return self._plan(chosen)

    def finish_plan(self, plan: StepPlan, trees: Mapping[str, CandidateTree]) -> StepRequest:
        """Complete the plan schedule() made, once the drafter has answered about it (`trees` by request id, {}
        when it was not asked): the trees that fit turn their decode work into verification; a step in which no
        kind was let draft may take several decode steps, while nobody waits (decode_steps.py). Returns the
        step's request, final."""
        request, in_flight = plan.request, self._steps.in_flight
        if self._forced:  # a span not drafted now is stale at the next answer
            trees, plan.forced_seq_ids = with_forced_spans(trees, self._forced, plan.queries)
            self._forced = {}
        if trees:
            attach_drafts(request, trees, in_flight, self._draft_room(request), self.max_len, self.block_manager)
        num_steps = self.decode_steps.num_steps
        # not where the drafter was asked for trees: one that found none this step may find one the next, which
        # several decode steps in one request would skip (and so would a structured output's next forced span)
        if num_steps > 1 and not plan.is_drafting and not self.waiting:
            seqs = [self._running_in_flight(work.seq_id) for work in request.sequences]
            if not (self.is_drafting_forced_spans and any(
                    seq is not None and seq.sampling.structured_output is not None for seq in seqs)):
                add_decode_steps(request, seqs, num_steps, self.max_len, self.block_manager)
        return request

    def schedule_ahead(self, plan: StepPlan) -> StepPlan | None:
        """Async scheduling: the step after `plan`'s (in flight, not yet postprocessed), final, or None.

        Only in the steady decode state, where the next step's input is nothing but the tokens the step in
        flight samples: nobody waits, it holds every running sequence, each plain and sampled at its sequence's
        end, the last step succeeded, the next KV slots are free without preempting anyone
        (step_requests.build_step_ahead() builds it), and the drafting chooser lets it go ahead (it keeps
        drafting off for every kind in it: a tree needs the tokens of the step before it). Then postprocess()
        the step in flight's result, then this step's; a failed step in flight drops it (fail_step, discard).
        """
        request = plan.request
        num_base_tokens = len(request.sequences)  # a step ahead computes one token per sequence
        if self._drafting is not None and not self._drafting.plan_ahead(
                draft_candidates(request, self._steps.in_flight), num_base_tokens,
                self.max_num_batched_tokens - num_base_tokens):
            return None
        if (self.waiting or self._steps.ahead is not None or len(request.sequences) != len(self.running)
                or self._num_ok_steps == 0):  # not right after a failed step, nor before the first success
            return None
        ahead = build_step_ahead(request, self._steps.in_flight, self.block_manager, max_len=self.max_len,
                                 num_decode_steps=self.decode_steps.num_steps,
                                 is_block_table_delta=self.is_block_table_delta)
        if ahead is None:
            return None
        self.num_steps += 1
        self._steps.record_ahead(ahead)
        decision = self._drafting.take_planned() if self._drafting is not None else None
        return StepPlan(ahead, list(self._steps.ahead_seqs.values()), decision=decision, is_ahead=True)

    def postprocess(self, request: StepRequest, result: StepResult) -> list[RequestEvent]:
        """Account the step's computed tokens, append sampled ones, apply stop conditions.

        Returns the events for the requests' streams. An answer that does not
        fit the work (step.output_problem) fails the whole step (fail_step).
        Sequences aborted while the step ran are skipped.
        """
        outputs = {output.seq_id: output for output in result.outputs}
        for work in request.sequences:
            problem = output_problem(work, outputs.get(work.seq_id), request.num_steps)
            if problem is not None:
                return self.fail_step(request, f"the worker's answer does not fit the step: {problem}")
        self.decode_steps.observe(request, result)
        now = self.clock()
        in_flight = self._steps.take_in_flight()
        events: list[RequestEvent] = []
        for work in request.sequences:
            seq = in_flight.get(work.seq_id)
            # RUNNING: not ended, and not preempted since the step was built (a refused continuation preempts its
            # sequence while the step after it is already under way)
            if seq is not None and seq.status is SequenceStatus.RUNNING:
                events += self._apply(seq, work, outputs.get(work.seq_id), now, request.num_steps)
        self._steps.advance()  # the step ahead is next, if any
        self._num_ok_steps += 1
        self.num_seqs_cap = raised_seqs_cap(self.num_seqs_cap, self.max_num_seqs, self._num_ok_steps)
        return events

    def fail_step(self, request: StepRequest, message: str) -> list[RequestEvent]:
        """A whole step failed (the worker ran out of memory, crashed, or answered nonsense).

        Its live sequences are preempted (blocks freed, recomputed from 0, back at
        the front of the queue in order) and the batch-size cap halves. One that
        has failed before and now failed alone, or has failed max_failed_steps
        steps in a row, ends with FinishReason.ERROR and `message`: returns those events.
        """
        in_flight = self._steps.drop(self.requests)  # the step ahead too: its sequences are retried with the others
        self.num_failed_steps += 1
        self._num_ok_steps = 0
        self.num_seqs_cap = lowered_seqs_cap(self.num_seqs_cap, len(request.sequences))
        # The worker may or may not have taken in this step's announcements and releases: repeat them.
        self._steps.repeat_releases(request.finished_seq_ids, self.requests)
        failed, retried = sort_out_failed_step(request, in_flight, self.max_failed_steps)
        for seq in failed:
            self._end(seq, SequenceStatus.FINISHED, FinishReason.ERROR, message)
        for seq in reversed(retried):
            self.running.remove(seq)
            self._preempt(seq)
        return [RequestEvent(seq.request_id, completion(seq)) for seq in failed]

    def evict_all(self) -> list[Sequence]:
        """The worker is lost: every live sequence leaves, reset to be recomputed on another worker (no blocks,
        nothing computed, unknown to any worker; the tokens generated so far are kept). Running ones first, in
        admission order, then the waiting ones in queue order. Their requests have not ended (no on_end)."""
        seqs = [*self.running, *self.waiting]
        reset_for_another_worker(seqs, self.block_manager)
        self.running.clear()
        self.waiting.clear()
        self.requests.clear()
        self._steps.clear()
        self.block_manager.reset_prefix_cache()
        return seqs

    def resume(self, seq: Sequence) -> None:
        """Take over a sequence another scheduler evicted (evict_all): it goes ahead of the new requests, with
        no queue bound (it was admitted once already)."""
        check_not_live(seq, self.requests)
        self._steps.keep(seq.request_id)
        seq.status = SequenceStatus.WAITING
        self.requests[seq.request_id] = seq
        self.waiting.insert(resume_index(self.waiting), seq)

    def release_later(self, seq_ids: Iterable[str]) -> None:
        """Tell the worker with the next step that it may forget these sequences (e.g. ones evicted while it
        did not answer: if it comes back with its state, that state is stale)."""
        self._steps.releases.extend(s for s in seq_ids if s not in self.requests)

    def discard(self, request: StepRequest) -> list[str]:
        """Forget a step that failed; returns the ids of its sequences still live (the caller aborts them)."""
        in_flight = self._steps.drop(self.requests)
        return [work.seq_id for work in request.sequences
                if (seq := in_flight.get(work.seq_id)) is not None and not seq.is_finished]

    def _apply(self, seq: Sequence, work: ScheduledSequence, output: SequenceOutput | None, now: float,
               num_steps: int = 1) -> list[RequestEvent]:
        """One sequence's share of a successful step of num_steps decode steps: computed tokens, sampled
        tokens, stop, events."""
        if output is not None and output.error and work.is_continuation and output.error.endswith(
                CONTINUATION_REFUSED):  # the worker did not have its token (steps out of order): recompute it
            self.running.remove(seq)
            self._preempt(seq)
            return []
        if output is not None and output.error:  # this sequence alone failed; what it cached may be wrong
            self.block_manager.uncache(seq)
            self._end(seq, SequenceStatus.FINISHED, FinishReason.ERROR, output.error)
            return [RequestEvent(seq.request_id, completion(seq))]
        seq.num_failed_steps = 0  # failures count in a row
        if work.draft is not None:  # root + accepted drafts are in KV; rejected nodes' blocks go back
            seq.num_computed_tokens += len(output.token_ids)
            self.block_manager.trim(seq)
        else:  # each decode step after the first computed the token the one before sampled
            seq.num_computed_tokens += len(work.token_ids) + num_steps - 1
        if output is None:
            self.block_manager.commit(seq)
            return []
        num_kept, reason = (append_tokens(seq, output.token_ids, now, self.eos_token_ids, self.max_len)
                            if work.is_sampled else (0, None))
        if output.forced_token_ids and reason is None and self.is_drafting_forced_spans:
            seq.forced_span, seq.forced_span_at = output.forced_token_ids, seq.num_output_tokens
            self._forced[seq.request_id] = seq
        self.block_manager.commit(seq)  # after the append: accepted drafts' blocks are full of known tokens
        chunk = token_chunk(seq, output, num_kept, work.draft)
        events = [] if chunk is None else [RequestEvent(seq.request_id, chunk)]
        if reason is not None:
            self._end(seq, SequenceStatus.FINISHED, reason)
            events.append(RequestEvent(seq.request_id, completion(seq)))
        return events

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

    def _end(self, seq: Sequence, status: SequenceStatus, reason: FinishReason | None = None,
             error_message: str = "") -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status, seq.finish_reason, seq.error_message = status, reason, error_message
        del self.requests[seq.request_id]
        self._forced.pop(seq.request_id, None)  # its id may come back as another request's
        if seq.is_known_to_worker:
            self._steps.releases.append(seq.request_id)
        if self._on_end is not None:
            self._on_end(seq.request_id)

    def _plan(self, chosen: list[tuple[Sequence, int]]) -> StepPlan:
        """The plan of the step that computes `chosen`, with the drafting chooser's choice for it."""
        if not chosen:
            return StepPlan(StepRequest())  # finished ids wait for the next step that runs
        seqs = [seq for seq, _ in chosen]
        request = self._steps.record(build_step(chosen, self.clock(), self.is_block_table_delta,
                                                self.is_drafting_forced_spans), seqs)
        self.num_steps += 1
        plan = StepPlan(request, seqs)
        if self._drafting is not None:
            plan.queries, plan.is_drafting, plan.decision, plan.node_price = self._drafting.choose(
                draft_candidates(request, self._steps.in_flight), request.num_scheduled_tokens,
                self._draft_room(request))
        return plan

    def _draft_room(self, request: StepRequest) -> int:
        """Draft tokens that still fit in the step's token budget."""
        return self.max_num_batched_tokens - request.num_scheduled_tokens

    def _running_in_flight(self, seq_id: str) -> Sequence | None:
        """The sequence that `seq_id` names in the step in flight (None: not in it, or no longer running: ended or
        preempted since, e.g. cancelled while the drafter was asked about the step, so it gets no more blocks)."""
        seq = self._steps.in_flight.get(seq_id)
        return seq if seq is not None and seq.status is SequenceStatus.RUNNING else None
