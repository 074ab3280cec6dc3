"""Speculative tree verification: tree layout, acceptance walk, and where the accepted KV goes.

In: a `ScheduledSequence` with `draft_parents` (token_ids[0] = the root, the last sampled token;
token_ids[i + 1] a draft node whose parent is token_ids[draft_parents[i]]), and the target's
logits at every node after the packed forward.
Out: per tree sequence, the accepted draft tokens followed by the target's own token (each with
its score and top log-probabilities, as plain sampling gives them), the accepted node indices, and
the (from, to) storage moves that make the accepted path's KV sequential.

Acceptance keeps the target's distribution exactly (SPEC section 2 step 5): the walk starts at the
root; at each visited node one token is chosen from the target's processed distribution at that
node, with the node's own prefix (greedy: the argmax; sampling: one draw from the sequence's
generator); if a child carries that token the walk descends, else the token is emitted and the
walk stops. Only visited nodes are sampled, one sampler call per tree level for the whole batch,
so a seeded sequence consumes one uniform per output token, as plain decoding does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from worker.messages import ScheduledSequence, SequenceOutput
from worker.sampler import SampleRow, sample


@dataclass(frozen=True)
class TreeLayout:
    """Shape of one candidate tree; node 0 is the root."""

    parents: list[int]
    """Parent of every node; -1 for the root, else a smaller index."""
    depths: list[int]
    """Root depth 0, its children 1, ..."""

    @classmethod
    def from_draft_parents(cls, draft_parents: Sequence[int]) -> TreeLayout:
        """draft_parents[i] is the parent of node i + 1; callers validate 0 <= parent <= i first."""
        parents, depths = [-1], [0]
        for parent in draft_parents:
            parents.append(parent)
            depths.append(depths[parent] + 1)
        return cls(parents, depths)

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    def mask(self) -> np.ndarray:
        """[n, n] bool: node i sees its ancestors and itself."""
        n = self.num_nodes
        mask = np.zeros((n, n), dtype=bool)
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                mask[node] = mask[parent]  # parents come first, so their rows are complete
            mask[node, node] = True
        return mask

    def children(self, token_ids: Sequence[int]) -> list[dict[int, list[int]]]:
        """Per node: child token -> the children carrying it (siblings may share a token)."""
        children: list[dict[int, list[int]]] = [{} for _ in self.parents]
        for node in range(1, self.num_nodes):
            children[self.parents[node]].setdefault(token_ids[node], []).append(node)
        return children


def expand_tree(seq: ScheduledSequence) -> ScheduledSequence:
    """The tree step as a plain masked step: depth positions, tree mask, every node sampled."""
    layout = TreeLayout.from_draft_parents(seq.draft_parents)
    return dataclasses.replace(
        seq,
        position_ids=[seq.num_computed_tokens + d for d in layout.depths],
        attention_mask=layout.mask(),
        sample_indices=list(range(layout.num_nodes)),
    )


class TreeWalk:
    """The acceptance walk over one tree: `node` is where the next token is chosen.

    Siblings carrying the same token have the same prefix, hence the same logits and KV: the walk
    stands on all of them at once and descends into whichever has a matching child, so the
    accepted path is the longest one the target agrees with even when a drafter sends duplicates.
    """

    def __init__(self, token_ids: Sequence[int], layout: TreeLayout):
        self._children = layout.children(token_ids)
        self._nodes = [0]
        self.accepted_nodes: list[int] = []
        """Draft nodes accepted so far, root excluded, in path order."""
        self.is_done = False

    @property
    def node(self) -> int:
        """The node whose distribution chooses the next token (any of the equivalent ones)."""
        return self._nodes[0]

    def offer(self, token: int) -> None:
        """The token the target chose at `node`: descend to the children carrying it, or stop."""
        matches = [child for node in self._nodes for child in self._children[node].get(token, ())]
        if not matches:
            self.is_done = True
            return
        self.accepted_nodes.append(matches[0])
        self._nodes = matches


def kv_moves(accepted_nodes: Sequence[int], depths: Sequence[int]) -> list[tuple[int, int]]:
    """(from, to) offsets after num_computed_tokens: each accepted node moves to its depth.

    Moves are listed in increasing depth; a node's depth never exceeds its index.
    """
    return [(node, depths[node]) for node in accepted_nodes if node != depths[node]]


RowMaker = Callable[[ScheduledSequence, int], SampleRow]
"""Builds the SampleRow of token `index` of a sequence (with that token's own prefix)."""


def sample_with_trees(
    sequences: Sequence[ScheduledSequence], logits: torch.Tensor, make_row: RowMaker
) -> tuple[list[SequenceOutput], dict[str, list[int]]]:
    """Sample plain rows, and walk every tree level by level, one batched sampler call per level.

    logits: [N, V], one row per sample index in sequence order (a tree has one per node).
    Returns the outputs (one per sequence that sampled anything, in order) and, per tree
    sequence, its accepted draft node indices.
    """
    collected: list[tuple[list[int], list[float], list]] = [([], [], []) for _ in sequences]
    walks: dict[int, TreeWalk] = {}
    offsets, row_index, jobs = [], 0, []  # jobs: (sequence index, logits row, SampleRow)
    for i, seq in enumerate(sequences):
        offsets.append(row_index)
        if seq.draft_parents is not None:
            walks[i] = TreeWalk(seq.token_ids, TreeLayout.from_draft_parents(seq.draft_parents))
            jobs.append((i, row_index, make_row(seq, 0)))
        else:
            jobs += [(i, row_index + k, make_row(seq, index)) for k, index in enumerate(seq.sample_indices)]
        row_index += len(seq.sample_indices)
    while jobs:
        rows = [row for _, row, _ in jobs]
        if rows != list(range(logits.shape[0])):  # a plain batch samples every row in order: no copy
            chosen = logits.index_select(0, torch.tensor(rows, device=logits.device))  # [J, V]
        else:
            chosen = logits  # sample() never modifies its input, so later levels still read it
        result = sample(chosen, [job for _, _, job in jobs])  # J tokens
        next_jobs = []
        for j, (i, _, _) in enumerate(jobs):
            tokens, scores, tops = collected[i]
            tokens.append(result.token_ids[j])
            scores.append(result.scores[j])
            tops.append(result.top_logprobs[j])
            walk = walks.get(i)
            if walk is not None:
                walk.offer(result.token_ids[j])
                if not walk.is_done:
                    next_jobs.append((i, offsets[i] + walk.node, make_row(sequences[i], walk.node)))
        jobs = next_jobs
    outputs = [SequenceOutput(seq.seq_id, *collected[i]) for i, seq in enumerate(sequences) if collected[i][0]]
    accepted = {sequences[i].seq_id: walk.accepted_nodes for i, walk in walks.items()}
    return outputs, accepted
