"""The worker-internal form of one sequence's work: what the packed forward and the sampler run.

In: a validated `ScheduledSequence` (protos/segserve/v1/step.py). A plain step keeps its tokens,
causal positions and sample indices. A tree step (`draft` set, token_ids = the root) is expanded
into nodes: node 0 is the root, node i + 1 is draft i; every node sits at rotary position
num_computed_tokens + its depth (root depth 0), sees its ancestors and itself, and is sampled.
Out: `Work`, never on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.segserve.v1.step import ScheduledSequence
from protos.segserve.v1.tree import ROOT, CandidateTree


@dataclass(slots=True)  # one per sequence per step: a frozen dataclass's __init__ costs ~5x a plain one's
class Work:
    """One sequence's tokens in one forward, with what is read back from it."""

    seq: ScheduledSequence
    token_ids: tuple[int, ...]
    """The tokens computed: token_ids of the step, or for a tree the root followed by its drafts."""
    positions: tuple[int, ...]
    """Rotary position of every token."""
    sample_indices: tuple[int, ...]
    """Indices into token_ids whose next token is sampled (every node of a tree)."""
    node_parents: tuple[int, ...] = ()
    """Tree steps: parent node of every node (-1 for the root); empty for a plain step."""
    node_depths: tuple[int, ...] = ()
    """Tree steps: depth of every node (root 0); empty for a plain step."""
    prompt_offsets: tuple[int, ...] = ()
    """Indices into token_ids whose raw logits feed prompt log-probabilities (worker/prompt_logprobs.py)."""

    @property
    def seq_id(self) -> str:
        return self.seq.seq_id

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def block_table(self) -> tuple[int, ...]:
        return self.seq.block_table

    @property
    def is_tree(self) -> bool:
        return bool(self.node_parents)


def expand(seq: ScheduledSequence, prompt_offsets: tuple[int, ...] = ()) -> Work:
    """The Work of a validated sequence (a tree must have passed CandidateTree.problem())."""
    start = seq.num_computed_tokens
    if seq.draft is None:
        positions = (start,) if len(seq.token_ids) == 1 else tuple(range(start, start + len(seq.token_ids)))
        return Work(seq, seq.token_ids, positions, seq.sample_indices, prompt_offsets=prompt_offsets)
    parents, depths = tree_nodes(seq.draft)
    return Work(seq, seq.token_ids + seq.draft.token_ids, tuple(start + d for d in depths),
                tuple(range(len(parents))), parents, depths, prompt_offsets)


def tree_nodes(tree: CandidateTree) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(parent node, depth) of every node of root + tree: node 0 is the root, node i + 1 is draft i."""
    parents = (-1,) + tuple(0 if p == ROOT else p + 1 for p in tree.parents)
    return parents, (0,) + tree.depths
