"""Failed steps and lost workers: what they do to the scheduler's sequences and its batch size.

(A SequenceOutput with `error` only ends its own request, in Scheduler.postprocess().) A whole step that fails
(Scheduler.fail_step(), or an answer that does not fit the work) preempts all of its sequences for
recomputation and halves the batch-size cap (lowered_seqs_cap), which grows back by one per CAP_GROWTH_STEPS
successful steps (raised_seqs_cap); a sequence that fails again running alone, or fails max_failed_steps steps
in a row, ends with FinishReason.ERROR (sort_out_failed_step). A lost worker's sequences leave its scheduler
(Scheduler.evict_all(), reset_for_another_worker) and queue at another one ahead of its new requests, with no
queue bound, as they were admitted once already (Scheduler.resume(), resume_index).

The Scheduler applies these decisions (ends, preemptions, its queues and step bookkeeping); nothing here does
I/O or touches the Scheduler itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

from protos.segserve.v1.step import StepRequest
from scheduler.block_manager import BlockManager
from scheduler.sequence import Sequence, SequenceStatus

CAP_GROWTH_STEPS = 16
"""Successful steps per + 1 of a lowered batch-size cap (slow, so that a size that ran out of memory is
not probed again at once)."""


def lowered_seqs_cap(num_seqs_cap: int, num_failed_seqs: int) -> int:
    """The batch-size cap after a step of num_failed_seqs sequences failed: half of the smaller, at least 1."""
    return max(1, min(num_seqs_cap, num_failed_seqs) // 2)


def raised_seqs_cap(num_seqs_cap: int, max_num_seqs: int, num_ok_steps: int) -> int:
    """The batch-size cap after num_ok_steps successful steps in a row: + 1 per CAP_GROWTH_STEPS of them, up to
    max_num_seqs."""
    if num_ok_steps % CAP_GROWTH_STEPS == 0:
        return min(max_num_seqs, num_seqs_cap + 1)
    return num_seqs_cap


def sort_out_failed_step(request: StepRequest, in_flight: Mapping[str, Sequence],
                         max_failed_steps: int) -> tuple[list[Sequence], list[Sequence]]:
    """The live sequences of a step that failed (`in_flight` holds its sequences), each counted as failed once
    more, in the step's order: those to end with FinishReason.ERROR (one that has failed before and now failed
    alone, or has failed max_failed_steps steps in a row), and those to retry. A sequence to retry that the
    step announced is unknown to the worker again (it may or may not have taken in the announcement)."""
    new_ids = {new.seq_id for new in request.new_sequences}
    is_alone = len(request.sequences) == 1
    failed, retried = [], []
    for work in request.sequences:
        seq = in_flight.get(work.seq_id)
        if seq is None or seq.is_finished:
            continue
        seq.num_failed_steps += 1
        if (is_alone and seq.num_failed_steps > 1) or seq.num_failed_steps >= max_failed_steps:
            failed.append(seq)
            continue
        if seq.request_id in new_ids:
            seq.is_known_to_worker = False
        retried.append(seq)
    return failed, retried


def reset_for_another_worker(seqs: Iterable[Sequence], block_manager: BlockManager) -> None:
    """Sequences leaving a lost worker: no blocks, nothing computed, unknown to any worker, waiting (the tokens
    generated so far are kept)."""
    for seq in seqs:
        block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.is_known_to_worker = False
        seq.status = SequenceStatus.WAITING


def resume_index(waiting: deque[Sequence]) -> int:
    """Where a sequence from another scheduler joins the waiting queue: before the first sequence that has
    neither computed nor generated anything (a new request), else last."""
    return next((i for i, w in enumerate(waiting) if w.num_computed_tokens == 0 and not w.output_token_ids),
                len(waiting))
