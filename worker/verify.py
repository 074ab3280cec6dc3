"""Sampling after the forward: plain rows, and speculative trees verified by an acceptance walk.

In: the step's `Work`s (worker/work.py; a tree's node 0 is the root, the last sampled token),
the target's logits at every sample index (every node of a tree), and the works that already
failed (non-finite logits). Out: per work, its tokens, scores and top log-probabilities (for a
tree the accepted drafts followed by the target's own token), per tree the accepted node
indices, and per work that failed here the reason; `kv_moves` says where accepted KV goes.

Acceptance keeps the target's distribution exactly (SPEC section 2 step 5): the walk starts at the
root; at each visited node one token is chosen from the target's processed distribution at that
node, with the node's own prefix (greedy: the argmax; sampling: one draw from the sequence's
generator); if a child carries that token the walk descends, else the token is emitted and the
walk stops. Only visited nodes are sampled, one sampler call per tree level for the whole batch,
so a seeded sequence consumes one uniform per output token, as plain decoding does. A sampler
failure fails only the sequence whose row raised (worker/faults.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from worker.faults import sample_isolated
from worker.sampler import SampleRow
from worker.work import Work


class TreeWalk:
    """The acceptance walk over one tree step: `node` is where the next token is chosen.

    Siblings carrying the same token have the same prefix, hence the same logits and KV: the walk
    stands on all of them at once and descends into whichever has a matching child, so the
    accepted path is the longest one the target agrees with even when a drafter sends duplicates.
    """

    def __init__(self, work: Work):
        self._children = work.children()
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


RowMaker = Callable[[Work, int], SampleRow]
"""Builds the SampleRow of token `index` of a work (with that token's own prefix)."""


@dataclass
class Sampled:
    """What one work sampled this step, token by token."""

    token_ids: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[list[int], list[float]] | None] = field(default_factory=list)
    accepted_nodes: list[int] | None = None
    """Tree steps: the accepted draft nodes (root excluded)."""


def sample_works(works: Sequence[Work], logits: torch.Tensor, failed: dict[int, str], make_row: RowMaker
                 ) -> dict[int, Sampled]:
    """Sample plain rows, and walk every tree level by level, one batched sampler call per level.

    logits: [N, V], one row per sample index in work order (a tree has one per node).
    failed: work index -> why it failed; works in it are skipped, and sampler failures are added.
    Returns, per work index that sampled and did not fail, what it sampled.
    """
    sampled: dict[int, Sampled] = {}
    walks: dict[int, TreeWalk] = {}
    offsets, row_index, jobs = [], 0, []  # jobs: (work index, logits row, SampleRow)
    for i, work in enumerate(works):
        offsets.append(row_index)
        row_index += len(work.sample_indices)
        if i in failed or not work.sample_indices:
            continue
        sampled[i] = Sampled()
        if work.is_tree:
            walks[i] = TreeWalk(work)
            jobs.append((i, offsets[i], make_row(work, 0)))
        else:
            jobs += [(i, offsets[i] + k, make_row(work, index)) for k, index in enumerate(work.sample_indices)]
    while jobs:
        results = sample_isolated(_rows_of(logits, [row for _, row, _ in jobs]), [job for _, _, job in jobs])
        next_jobs = []
        for (i, _, _), result in zip(jobs, results):
            if i in failed:
                continue
            if isinstance(result, str):
                failed[i] = result
                continue
            out = sampled[i]
            out.token_ids.append(result[0])
            out.scores.append(result[1])
            out.top_logprobs.append(result[2])
            walk = walks.get(i)
            if walk is not None:
                walk.offer(result[0])
                if not walk.is_done:
                    next_jobs.append((i, offsets[i] + walk.node, make_row(works[i], walk.node)))
        jobs = [job for job in next_jobs if job[0] not in failed]
    for i, walk in walks.items():
        sampled[i].accepted_nodes = walk.accepted_nodes
    return {i: out for i, out in sampled.items() if i not in failed}


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits[rows]; the tensor itself when a plain batch samples every row in order (no copy).
    sample() never modifies its input, so later tree levels still read the original."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, torch.tensor(rows, device=logits.device))  # [J, V]
