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
than one, only while nobody waits, and only as many as fit a time bound (DecodeStepBudget: by default up to 8
steps within 25 ms at the worker's recent time per step, so a step of over 12.5 ms stays one per request).

In: the sequences of a step the Scheduler built, and the worker's compute times. Out: the step's num_steps, its
KV slots allocated and its block tables grown. The Scheduler decides when a step may take several
(Scheduler.finish_plan, Scheduler.schedule_ahead); this module decides how many.
"""

from __future__ import annotations

import dataclasses

from protos.segserve.v1.step import StepRequest
from protos.segserve.v1.step_result import StepResult
from scheduler.block_manager import BlockManager
from scheduler.sequence import Sequence

_DECODE_STEP_WEIGHT = 0.25
"""Weight of the last plain decode step's compute time in the moving average that bounds the decode steps of one
request (DecodeStepBudget.num_steps): a batch that grows or shrinks moves it within a few steps."""


class DecodeStepBudget:
    """How many decode steps one plain decode step may take now: num_decode_steps, or as many of them as fit
    decode_steps_s at the worker's recent compute time per step."""

    def __init__(self, num_decode_steps: int = 1, decode_steps_s: float = 0.0):
        self.num_decode_steps = num_decode_steps
        """The most decode steps one plain decode step may take; 1 = off."""
        self.decode_steps_s = decode_steps_s
        """How long those steps may take together, by the worker's last compute times (0 = no bound)."""
        self._step_s: float | None = None
        """Moving average of the worker's compute time per step of plain decode steps (StepResult.compute_us)."""

    @property
    def num_steps(self) -> int:
        """The decode steps a plain decode step may take now (1 until the time per step is measured, where
        there is a bound)."""
        if self.num_decode_steps <= 1 or self.decode_steps_s <= 0:
            return self.num_decode_steps
        if self._step_s is None:
            return 1
        return max(1, min(self.num_decode_steps, int(self.decode_steps_s / self._step_s)))

    def observe(self, request: StepRequest, result: StepResult) -> None:
        """A successful step: a plain decode step's compute time per step moves the average."""
        if result.compute_us and request.num_scheduled_tokens == len(request.sequences):  # plain decode steps
            step_s = result.compute_us / 1e6 / request.num_steps
            last = self._step_s
            self._step_s = step_s if last is None else last + _DECODE_STEP_WEIGHT * (step_s - last)


def room_for_steps(seq: Sequence, num_pending: int, max_len: int) -> int:
    """Decode steps `seq` may still take after the num_pending tokens it already has in flight, within its
    max_tokens and the context length."""
    return min(seq.stopping.max_tokens - seq.num_output_tokens, max_len - seq.num_tokens) - num_pending


def add_decode_steps(request: StepRequest, seqs: list[Sequence | None], num_steps: int, max_len: int,
                     block_manager: BlockManager) -> int:
    """Let `request` run up to num_steps decode steps where every sequence decodes one token sampled at its end
    without a tree, and as many as the free KV blocks hold every step's slot for (when they are short, as many as
    the sequences' own blocks hold). seqs: the running sequence of each of request.sequences (None: ended since
    the step was built: the step stays one). Allocates those slots and sends the grown block tables. Returns
    request.num_steps."""
    if num_steps <= 1 or not request.sequences:
        return request.num_steps
    for work, seq in zip(request.sequences, seqs):
        if seq is None or len(work.token_ids) != 1 or work.sample_indices != (0,) or work.draft is not None:
            return request.num_steps
        num_steps = min(num_steps, room_for_steps(seq, 0, max_len))
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
