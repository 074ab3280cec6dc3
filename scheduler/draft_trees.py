"""Candidate trees as the scheduler handles them: validate, prune to a budget, check what was accepted.

In: DraftTree (drafter.proto's shape: parents -1 = root). Out: pruned trees,
the worker's draft_parents form (0 = root, i + 1 = draft i), and whether the
worker's answer is a path of the tree it was sent. Pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.block_manager import BlockManager
from scheduler.outputs import DraftTree
from scheduler.sequence import Sequence


def tree_problem(tree: DraftTree, vocab_size: int, max_nodes: int) -> str | None:
    """Why a drafter's tree is unusable (garbage), or None when it is well formed."""
    if len(tree.token_ids) != len(tree.parents):
        return f"{len(tree.token_ids)} tokens but {len(tree.parents)} parents"
    if len(tree.token_ids) > max_nodes:
        return f"{len(tree.token_ids)} nodes, more than the {max_nodes} asked for"
    for index, (token_id, parent) in enumerate(zip(tree.token_ids, tree.parents)):
        if not 0 <= token_id < vocab_size:
            return f"token {token_id} is outside the vocabulary of {vocab_size}"
        if not -1 <= parent < index:
            return f"node {index} has parent {parent}"
    return None


def prune_tree(tree: DraftTree, max_nodes: int, max_depth: int) -> DraftTree:
    """The first max_nodes nodes (topological order) no deeper than max_depth whose parents are kept.

    A topological prefix of the kept nodes is itself a tree, so the result is valid.
    """
    new_index: dict[int, int] = {}
    token_ids: list[int] = []
    parents: list[int] = []
    for index, (token_id, parent, depth) in enumerate(zip(tree.token_ids, tree.parents, tree.depths)):
        if len(token_ids) >= max_nodes:
            break
        if depth > max_depth or (parent >= 0 and parent not in new_index):
            continue
        new_index[index] = len(token_ids)
        token_ids.append(token_id)
        parents.append(-1 if parent < 0 else new_index[parent])
    return DraftTree(token_ids, parents, tree.segment)


def fit_tree(tree: DraftTree, seq: Sequence, room: int, max_len: int, block_manager: BlockManager) -> DraftTree:
    """tree pruned to what seq can use this step: room draft tokens, free KV slots, and no node
    that could only be accepted past max_new_tokens or max_len (the target adds one token more)."""
    max_depth = min(seq.stopping.max_new_tokens - seq.num_output_tokens, max_len - seq.num_tokens) - 1
    max_nodes = min(room, block_manager.num_free_slots(seq) - 1)  # the root takes one slot
    if max_depth <= 0 or max_nodes <= 0:
        return DraftTree([], [], tree.segment)
    return prune_tree(tree, max_nodes, max_depth)


def worker_parents(tree: DraftTree) -> list[int]:
    """worker.proto's draft_parents: an index into [root] + drafts, so 0 = root and i + 1 = draft i."""
    return [parent + 1 for parent in tree.parents]


def is_tree_path(token_ids: Sequence[int], draft_token_ids: Sequence[int], draft_parents: Sequence[int]) -> bool:
    """Whether token_ids[:-1] walks the tree from the root (draft_parents in the worker's form).

    The last token is the target's own and may be anything.
    """
    nodes = {0}  # indices into [root] + drafts; a set, in case siblings repeat a token
    for token_id in token_ids[:-1]:
        nodes = {i + 1 for i, parent in enumerate(draft_parents)
                 if parent in nodes and draft_token_ids[i] == token_id}
        if not nodes:
            return False
    return len(token_ids) >= 1


def max_depth_of(draft_parents: Sequence[int]) -> int:
    """Depth of the deepest node of a tree given in the worker's form (0 for no drafts)."""
    depths = [0]
    for parent in draft_parents:
        depths.append(depths[parent] + 1)
    return max(depths)
