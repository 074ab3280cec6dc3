"""Where speculation meets the batch: which of a step's sequences may carry a candidate tree, how many draft
tokens still fit, and the trees pruned to fit before the step goes to the worker.

In: a StepRequest the Scheduler built, its running sequences, and the drafter's trees by request id. Out: the
same request, its decode work turned into tree verification (ScheduledSequence.draft) and the trees' KV blocks
allocated. DraftChooser is what the Scheduler asks which sequences to draft for (the Speculator).

Structured outputs draft like any sequence (the worker drops the nodes their grammar forbids, and masks every
node's row), and get a free draft besides: the span their grammar forces after their output, which the worker
returned with their last tokens (Sequence.forced_span). `with_forced_spans` makes it the first chain of the tree,
the drafter's nodes merged after it (a node whose path runs along the chain is the chain's node, so a drafter
that predicted the span continues after it), even where the drafter was asked for nothing; the step's token
budget and the free KV slots still bound it (fit_tree).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

from protos.segserve.v1.step import ScheduledSequence, StepRequest
from protos.segserve.v1.tree import ROOT, CandidateTree
from scheduler.block_manager import BlockManager
from scheduler.sequence import Sequence, SequenceStatus
from scheduler.spec_gate import GateDecision
from scheduler.step_plan import DraftChoice


class DraftChooser(Protocol):
    """Decides, for the Scheduler, which of a step's decode sequences the drafter is asked about (the Speculator,
    by its speculation policy). Pure logic: the drafter is asked later, by the engine's draft stage."""

    def choose(self, candidates: list[Sequence], num_scheduled_tokens: int, room: int) -> DraftChoice:
        """The drafting for a step schedule() built; candidates: its decode sequences; room: draft tokens that fit."""

    def plan_ahead(self, candidates: list[Sequence], num_base_tokens: int, room: int) -> bool:
        """Whether the step after the one in flight (whose decode sequences are `candidates`) may be built before
        that one answers: it drafts nothing then."""

    def take_planned(self) -> GateDecision | None:
        """The gate's decision for the step plan_ahead() allowed, once the Scheduler has built it."""


def decoding(seq: Sequence | None, work: ScheduledSequence) -> Sequence | None:
    """`seq` where `work` is a decode step of it (it samples its one uncomputed token) and it is still running
    (not ended or preempted since the step was built, e.g. cancelled while the drafter was asked), else None."""
    if seq is None or seq.status is not SequenceStatus.RUNNING:
        return None
    return seq if seq.num_uncomputed_tokens == 1 and work.sample_indices else None


def draft_candidates(request: StepRequest, in_flight: Mapping[str, Sequence]) -> list[Sequence]:
    """The step's decode sequences; in_flight: the sequences of the step by id."""
    return [seq for work in request.sequences if (seq := decoding(in_flight.get(work.seq_id), work)) is not None]


def attach_drafts(request: StepRequest, trees: Mapping[str, CandidateTree], in_flight: Mapping[str, Sequence],
                  room: int, max_len: int, block_manager: BlockManager) -> None:
    """Turn decode work into tree verification, within `room` draft tokens and the free KV blocks.

    Trees shrink (or drop) to fit: the budget left after schedule(), the stop conditions (no node past
    max_tokens or the context), and the free blocks (drafts never preempt anything).
    """
    for index, work in enumerate(request.sequences):
        tree = trees.get(work.seq_id)
        if tree is None or (seq := decoding(in_flight.get(work.seq_id), work)) is None:
            continue
        tree = fit_tree(tree, seq, room, max_len, block_manager)
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


def with_forced_spans(trees: Mapping[str, CandidateTree], forced: Mapping[str, Sequence],
                      queries: tuple[tuple[Sequence, int], ...]) -> tuple[dict[str, CandidateTree], frozenset[str]]:
    """`trees` with the fresh forced span of each of `forced` (sequences by id whose last answer carried one) as the
    first chain of its tree, and the ids of those trees. A span is fresh at the output length it came at
    (Sequence.forced_span_at); the caller attaches the trees (attach_drafts), which keeps only decode work. A merged
    tree keeps the span and as many of the drafter's nodes as its query allowed (queries: the drafter's node
    budget per sequence), the span first."""
    merged, ids = dict(trees), []
    budgets = None
    for request_id, seq in forced.items():
        if seq.forced_span_at != seq.num_output_tokens or not seq.forced_span:
            continue
        drafted = trees.get(request_id)
        tree = forced_first(seq.forced_span, drafted)
        if drafted is not None:
            budgets = budgets if budgets is not None else {s.request_id: n for s, n in queries}
            tree = tree.prune(max(len(seq.forced_span), budgets.get(request_id, 0)), len(tree))
        merged[request_id] = tree
        ids.append(request_id)
    return merged, frozenset(ids)


def forced_first(span: tuple[int, ...], drafted: CandidateTree | None) -> CandidateTree:
    """`span` as a chain from the root, then the drafted tree's nodes merged in (topological order kept): a node
    whose parent and token are those of a node already there is that node."""
    token_ids, parents = list(span), [ROOT, *range(len(span) - 1)]
    if drafted is None:
        return CandidateTree(tuple(token_ids), tuple(parents))
    nodes = {(parent, token_id): node for node, (parent, token_id) in enumerate(zip(parents, token_ids))}
    placed: list[int] = []  # drafted node -> its node in the merged tree
    for token_id, parent in zip(drafted.token_ids, drafted.parents):
        key = (ROOT if parent == ROOT else placed[parent], token_id)
        node = nodes.get(key)
        if node is None:
            node = nodes[key] = len(token_ids)
            token_ids.append(token_id)
            parents.append(key[0])
        placed.append(node)
    return CandidateTree(tuple(token_ids), tuple(parents))
