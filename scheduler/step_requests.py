"""The StepRequests the scheduler sends the worker, and its record of them (StepLedger).

Built from the sequences the Scheduler chose: a scheduled step (build_step, for Scheduler.schedule()) and the
step ahead of the one in flight (build_step_ahead, for Scheduler.schedule_ahead(), async scheduling). Each
sequence's work carries the block-table entries its worker lacks (table_to_send: all of them unless the worker
keeps tables, WorkerInfo.block_table_deltas); a step announces a sequence the worker does not know with every
token so far (NewSequence). The ledger holds what is at the worker: the step in flight and its live sequences,
the step ahead, and the ended sequences the next step releases.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping

from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from scheduler.block_manager import BlockManager
from scheduler.decode_steps import room_for_steps
from scheduler.sequence import RequestMetrics, Sequence


def table_to_send(seq: Sequence, is_block_table_delta: bool) -> tuple[int, tuple[int, ...]]:
    """seq's block_table_start and block table entries for the step being built; the worker has them all
    once it takes the step (a step that fails preempts its sequences, and with them this count)."""
    table_start = seq.num_blocks_sent if is_block_table_delta else 0
    seq.num_blocks_sent = len(seq.block_table)
    return table_start, tuple(seq.block_table[table_start:])


def build_step(chosen: list[tuple[Sequence, int]], now: float, is_block_table_delta: bool,
               is_drafting_forced_spans: bool = False) -> StepRequest:
    """The work of computing the next num_new tokens of each chosen sequence (its KV slots allocated), sampled
    where they reach its end. Marks each sequence known to the worker, and records its first scheduling (at
    `now`) and the largest batch it ran in. With is_drafting_forced_spans, a structured output is announced for
    forced spans (NewSequence.is_drafting_forced_spans)."""
    request = StepRequest()
    batch_size = len(chosen)
    for seq, num_new in chosen:
        start = seq.num_computed_tokens
        is_at_end = start + num_new == seq.num_tokens
        # positional arguments, and a decoding sequence's one token without a slice: this runs for every
        # sequence every step
        token_ids = (seq.token_ids[start],) if num_new == 1 else tuple(seq.token_ids[start:start + num_new])
        table_start, table = table_to_send(seq, is_block_table_delta)
        request.sequences.append(ScheduledSequence(seq.request_id, token_ids, start, table,
                                                   (num_new - 1,) if is_at_end else (), None, False, table_start))
        if not seq.is_known_to_worker:
            # every token so far: a sequence moved from a lost worker may start past a cached prefix that
            # covers some of its output too
            request.new_sequences.append(NewSequence(
                seq.request_id, seq.sampling, seq.num_prompt_tokens, tuple(seq.token_ids),
                is_drafting_forced_spans and seq.sampling.structured_output is not None))
            seq.is_known_to_worker = True
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = now
            seq.queue_wait_us = RequestMetrics.of(seq).queue_wait_us
        seq.max_batch_size = max(seq.max_batch_size, batch_size)
    return request


def build_step_ahead(request: StepRequest, in_flight: Mapping[str, Sequence], block_manager: BlockManager, *,
                     max_len: int, num_decode_steps: int, is_block_table_delta: bool) -> StepRequest | None:
    """The step after `request` (in flight; `in_flight` holds its sequences) for Scheduler.schedule_ahead(),
    which has checked its own side of the steady decode state; allocates the step's KV slots.

    None unless every sequence of `request` is live, plain (no tree) and sampled at its end, and the free blocks
    hold the new slots. Each sequence continues with one placeholder (ScheduledSequence.is_continuation) that the
    worker replaces with the last token it samples in `request`; a sequence that `request` brings to its length
    limit is left out (a stop the scheduler cannot foresee, EOS or a stop token, only wastes its slots in the step
    ahead), and None if that leaves none. The step ahead takes up to num_decode_steps decode steps
    (scheduler/decode_steps.py), 1 where the free blocks hold no more.
    """
    chosen: list[tuple[Sequence, ScheduledSequence]] = []
    num_pending = request.num_steps  # tokens `request` samples per sequence
    num_steps = num_decode_steps
    for work in request.sequences:
        seq = in_flight.get(work.seq_id)
        if (seq is None or seq.is_finished or work.draft is not None
                or work.sample_indices != (len(work.token_ids) - 1,)
                or work.num_computed_tokens + len(work.token_ids) != seq.num_tokens):
            return None
        room = room_for_steps(seq, num_pending, max_len)
        if room < 1:
            continue
        chosen.append((seq, work))
        num_steps = min(num_steps, room)
    if not chosen:
        return None

    def num_missing(steps: int) -> int:  # each work's tokens, then the pending ones' slots, then the steps'
        return sum(block_manager.num_missing_blocks(seq, len(work.token_ids) + num_pending - 1 + steps)
                   for seq, work in chosen)

    missing = num_missing(num_steps)
    if num_steps > 1 and missing > block_manager.num_free_blocks:
        num_steps, missing = 1, num_missing(1)
    if missing > block_manager.num_free_blocks:
        return None
    ahead = StepRequest(num_steps=num_steps)
    for seq, work in chosen:
        block_manager.allocate(seq, len(work.token_ids) + num_pending - 1 + num_steps)
        table_start, table = table_to_send(seq, is_block_table_delta)
        ahead.sequences.append(ScheduledSequence(seq.request_id, (0,), seq.num_tokens + num_pending - 1, table,
                                                 (0,), None, True, table_start))
        seq.max_batch_size = max(seq.max_batch_size, len(chosen))
    return ahead


class StepLedger:
    """What the scheduler has sent its worker and not yet seen answered, and what the next step tells it."""

    def __init__(self) -> None:
        self.current_step: StepRequest | None = None
        """The step in flight: the last one schedule() built, or the step ahead once its predecessor is
        postprocessed; None once postprocessed, failed or discarded."""
        self.in_flight: dict[str, Sequence] = {}
        """The live sequences of the step in flight, by id."""
        self.ahead: StepRequest | None = None
        """The step schedule_ahead() built while the one in flight runs; it becomes the one in flight when that
        one's postprocess() ends."""
        self.ahead_seqs: dict[str, Sequence] = {}
        self.releases: list[str] = []
        """Ended sequences the worker knows: the next step built tells it to forget them (finished_seq_ids)."""

    def record(self, request: StepRequest, seqs: Iterable[Sequence]) -> StepRequest:
        """`request`, the work of `seqs`, is the step in flight now (the engine sends it next); it carries the
        releases."""
        self.in_flight.update((seq.request_id, seq) for seq in seqs)
        request.finished_seq_ids, self.releases = self.releases, []
        self.current_step = request
        return request

    def record_ahead(self, ahead: StepRequest) -> StepRequest:
        """`ahead`, the work of sequences in flight, follows the step in flight; it carries the releases."""
        ahead.finished_seq_ids, self.releases = self.releases, []
        self.ahead, self.ahead_seqs = ahead, {work.seq_id: self.in_flight[work.seq_id] for work in ahead.sequences}
        return ahead

    def take_in_flight(self) -> dict[str, Sequence]:
        """The sequences of the step in flight, which is being postprocessed; advance() when it is done."""
        in_flight, self.in_flight = self.in_flight, {}
        return in_flight

    def advance(self) -> None:
        """The step in flight is postprocessed: the step ahead, if any, is in flight now."""
        self.current_step, self.in_flight = self.ahead, self.ahead_seqs
        self.ahead, self.ahead_seqs = None, {}

    def drop(self, live_ids: Container[str]) -> dict[str, Sequence]:
        """The step in flight failed: returns its sequences; no step is in flight, and the step ahead is
        dropped too (the worker may or may not have taken in its releases, so they are repeated)."""
        in_flight, self.in_flight = self.in_flight, {}
        if self.ahead is not None:
            self.repeat_releases(self.ahead.finished_seq_ids, live_ids)
        self.ahead, self.ahead_seqs = None, {}
        self.current_step = None
        return in_flight

    def keep(self, seq_id: str) -> None:
        """seq_id is live again (a reused id, or a sequence handed over): its pending release is withdrawn, as its
        first step restarts the worker's state and a release after that would drop the new one."""
        if seq_id in self.releases:
            self.releases.remove(seq_id)

    def repeat_releases(self, seq_ids: Iterable[str], live_ids: Container[str]) -> None:
        """Release seq_ids again with the next step, but for those live again (their id reused) or pending."""
        self.releases += [seq_id for seq_id in seq_ids if seq_id not in live_ids and seq_id not in self.releases]

    def clear(self) -> None:
        """The worker is lost: nothing is at it any more."""
        self.in_flight.clear()
        self.ahead, self.ahead_seqs, self.current_step = None, {}, None
        self.releases.clear()
