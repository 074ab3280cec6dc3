"""Multi-step decoding: one StepRequest of several decode steps, which the worker runs back to back.

In the steady decode state a step's only input is the tokens the step before it sampled, and the worker has
those. A request of num_steps decode steps (StepRequest.num_steps) lets it continue every sequence itself,
without a round trip per token through the scheduler and the wire: the scheduler allocates the KV slots of all
the steps up front and applies the tokens in one go, cutting them at a stop (EOS, a stop token) like the
accepted tokens of a tree. A stop inside the steps only costs the steps after it; max_tokens and the context
length are never passed (room_for_steps).

The price is granularity: a stream gets its tokens num_steps at a time, a request that arrives meanwhile waits
for its prefill until the request in flight is done (and the step ahead of it, with async scheduling: up to twice
num_steps steps), and a cancellation or a stop takes effect after them. So only a plain decode step takes more
than one, only while nobody waits, and only as many as fit a time bound (Scheduler.decode_steps_now: by default
up to 8 steps within 25 ms at the worker's recent time per step, so a step of over 12.5 ms stays one per request).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from protos.segserve.v1.step import StepRequest

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler
    from scheduler.sequence import Sequence


def room_for_steps(seq: Sequence, num_pending: int, max_len: int) -> int:
    """Decode steps `seq` may still take after the num_pending tokens it already has in flight, within its
    max_tokens and the context length."""
    return min(seq.stopping.max_tokens - seq.num_output_tokens, max_len - seq.num_tokens) - num_pending


def add_decode_steps(scheduler: Scheduler, request: StepRequest) -> int:
    """Let `request` (built by schedule(), drafted in) run up to scheduler.decode_steps_now() decode steps: where
    nobody waits, every sequence decodes one token sampled at its end without a tree, and as many as the free KV
    blocks hold every step's slot for (when they are short, as many as the sequences' own blocks hold). Allocates
    those slots and sends the grown block tables. Returns request.num_steps."""
    num_steps = scheduler.decode_steps_now()
    if num_steps <= 1 or scheduler.waiting or not request.sequences:
        return request.num_steps
    seqs = []
    for work in request.sequences:
        seq = scheduler.in_flight(work.seq_id)
        if seq is None or len(work.token_ids) != 1 or work.sample_indices != (0,) or work.draft is not None:
            return request.num_steps
        num_steps = min(num_steps, room_for_steps(seq, 0, scheduler.max_len))
        seqs.append(seq)
    block_manager = scheduler.block_manager
    if sum(block_manager.num_missing_blocks(seq, num_steps) for seq in seqs) > block_manager.num_free_blocks:
        # short of free blocks: only as many steps as every sequence has slots for in its own blocks
        num_steps = min(num_steps, min(len(seq.block_table) * block_manager.block_size - seq.num_computed_tokens
                                       for seq in seqs))
    if num_steps <= 1:
        return request.num_steps
    for index, (work, seq) in enumerate(zip(request.sequences, seqs)):
        block_manager.allocate(seq, num_steps)  # appends: the entries before work.block_table_start stay
        request.sequences[index] = dataclasses.replace(
            work, block_table=tuple(seq.block_table[work.block_table_start:]))
        seq.num_blocks_sent = len(seq.block_table)
    request.num_steps = num_steps
    return num_steps
