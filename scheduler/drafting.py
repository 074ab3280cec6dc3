"""Where speculation meets the batch: which of a step's sequences may carry a candidate tree, how many draft
tokens still fit, and the trees pruned to fit before the step goes to the worker.

In: a StepRequest from Scheduler.schedule() and the drafter's trees by request id. Out: the same request, its
decode work turned into tree verification (ScheduledSequence.draft) and the trees' KV blocks allocated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from protos.segserve.v1.step import ScheduledSequence, StepRequest
from protos.segserve.v1.tree import CandidateTree
from scheduler.block_manager import BlockManager
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence


def draft_candidates(scheduler: Scheduler, request: StepRequest) -> list[Sequence]:
    """The step's decode sequences: their only uncomputed token is the last sampled one."""
    return [seq for work in request.sequences if (seq := _decoding(scheduler, work)) is not None]


def _decoding(scheduler: Scheduler, work: ScheduledSequence) -> Sequence | None:
    """The running sequence of `work` where it is a decode step (it samples its one uncomputed token), else None."""
    seq = scheduler.in_flight(work.seq_id)
    return seq if seq is not None and seq.num_uncomputed_tokens == 1 and work.sample_indices else None


def draft_room(scheduler: Scheduler, request: StepRequest) -> int:
    """Draft tokens that still fit in the step's token budget."""
    return scheduler.max_num_batched_tokens - request.num_scheduled_tokens


def attach_drafts(scheduler: Scheduler, request: StepRequest, trees: Mapping[str, CandidateTree]) -> None:
    """Turn decode work into tree verification, within the step's token budget and free KV blocks.

    Trees shrink (or drop) to fit: the budget left after schedule(), the stop conditions (no node past
    max_tokens or the context), and the free blocks (drafts never preempt anything).
    """
    room = draft_room(scheduler, request)
    block_manager = scheduler.block_manager
    for index, work in enumerate(request.sequences):
        tree = trees.get(work.seq_id)
        if tree is None or (seq := _decoding(scheduler, work)) is None:
            continue
        tree = fit_tree(tree, seq, room, scheduler.max_len, block_manager)
        if not tree:
            continue
        block_manager.allocate(seq, 1 + len(tree))  # appends: the entries before work.block_table_start stay
        room -= len(tree)
        request.sequences[index] = dataclasses.replace(
            work, block_table=tuple(seq.block_table[work.block_table_start:]), sample_indices=(), draft=tree)
        seq.num_blocks_sent = len(seq.block_table)


def fit_tree(tree: CandidateTree, seq: Sequence, room: int, max_len: int,
             block_manager: BlockManager) -> CandidateTree:
    """tree pruned to what seq can use this step: room draft tokens, free KV slots, and no node
    that could only be accepted past max_tokens or max_len (the target adds one token more)."""
    max_depth = min(seq.stopping.max_tokens - seq.num_output_tokens, max_len - seq.num_tokens) - 1
    max_nodes = min(room, block_manager.num_free_slots(seq) - 1)  # the root takes one slot
    if max_depth <= 0 or max_nodes <= 0:
        return CandidateTree()
    return tree.prune(max_nodes, max_depth)
