"""Tree builders: merge continuations into a trie, then pick nodes under a budget.

In: `Continuation`s from any sources (scores comparable across the list). Out: a
CandidateTree (protos.segserve.v1.tree: parents -1 = root) in topological order,
with at most `max_nodes` nodes of depth at most `max_depth`. A trie node's weight
is the sum of the scores of the continuations through it. The planner's scores
are calibrated (each source's sum to its measured match share, drafter/planner.py),
so a node's weight estimates the chance its path is accepted, and `min_prob`
drops the nodes less likely than that whatever the budget left; a caller whose
scores are plain frequencies passes 0.

Builders live in `BUILDERS` (name -> function); a segment names one in its config.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

from drafter.types import Continuation
from protos.segserve.v1.tree import ROOT, CandidateTree


@dataclass(slots=True)
class _TrieNode:
    token_id: int
    weight: float = 0.0
    children: dict[int, "_TrieNode"] = field(default_factory=dict)

    def ranked_children(self) -> list["_TrieNode"]:
        """Heaviest first; ties keep insertion order (earlier = better-ranked continuation)."""
        return sorted(self.children.values(), key=lambda c: -c.weight)


def merge(continuations: list[Continuation], max_depth: int, min_prob: float = 0.0) -> _TrieNode:
    """A trie of the continuations cut at max_depth; shared prefixes become shared nodes. A node lighter than
    min_prob (its path's estimated acceptance: see the module) is left out with everything under it."""
    root = _TrieNode(token_id=-1)
    for cont in sorted(continuations, key=lambda c: -c.score):
        if cont.score <= 0:
            continue
        node = root
        root.weight += cont.score
        for token_id in cont.token_ids[:max_depth]:
            node = node.children.setdefault(token_id, _TrieNode(token_id))
            node.weight += cont.score
    if min_prob > 0:
        _prune(root, min_prob)
    return root


def _prune(root: _TrieNode, min_weight: float) -> None:
    """Drop every node lighter than min_weight (its subtree is lighter still)."""
    stack = [root]
    while stack:
        node = stack.pop()
        node.children = {t: c for t, c in node.children.items() if c.weight >= min_weight}
        stack.extend(node.children.values())


class _Emitter:
    """Collects trie nodes in emission order (parents first); tree() freezes them into a CandidateTree."""

    def __init__(self) -> None:
        self._token_ids: list[int] = []
        self._parents: list[int] = []
        self._index: dict[int, int] = {}  # id(trie node) -> its index in the tree

    def __len__(self) -> int:
        return len(self._token_ids)

    def emit(self, node: _TrieNode, parent: _TrieNode | None) -> None:
        """Append node as a child of parent (None = the root); parent must be emitted already."""
        self._index[id(node)] = len(self._token_ids)
        self._token_ids.append(node.token_id)
        self._parents.append(ROOT if parent is None else self._index[id(parent)])

    def tree(self) -> CandidateTree:
        return CandidateTree(tuple(self._token_ids), tuple(self._parents))


def single_branch(continuations: list[Continuation], max_nodes: int, max_depth: int,
                  min_prob: float = 0.0) -> CandidateTree:
    """One chain: the heaviest child at every level."""
    out = _Emitter()
    node, parent = merge(continuations, max_depth, min_prob), None
    for _ in range(min(max_nodes, max_depth)):
        if not node.children:
            break
        child = node.ranked_children()[0]
        out.emit(child, parent)
        node = parent = child
    return out.tree()


def multi_branch_dfs(continuations: list[Continuation], max_nodes: int, max_depth: int,
                     min_prob: float = 0.0) -> CandidateTree:
    """Depth-first, heaviest child first: the best chain in full, then its alternatives."""
    out = _Emitter()
    for node, parent in _preorder(merge(continuations, max_depth, min_prob)):
        if len(out) >= max_nodes:
            break
        out.emit(node, parent)
    return out.tree()


def _preorder(root: _TrieNode) -> Iterator[tuple[_TrieNode, _TrieNode | None]]:
    stack: list[tuple[_TrieNode, _TrieNode | None]] = [(c, None) for c in reversed(root.ranked_children())]
    while stack:
        node, parent = stack.pop()
        yield node, parent
        stack.extend((c, node) for c in reversed(node.ranked_children()))


def multi_branch_bfs(continuations: list[Continuation], max_nodes: int, max_depth: int,
                     min_prob: float = 0.0) -> CandidateTree:
    """Breadth-first, heaviest child first: every alternative of depth d before depth d + 1."""
    out = _Emitter()
    root = merge(continuations, max_depth, min_prob)
    queue = deque((c, None) for c in root.ranked_children())
    while queue and len(out) < max_nodes:
        node, parent = queue.popleft()
        out.emit(node, parent)
        queue.extend((c, node) for c in node.ranked_children())
    return out.tree()


def best_first(continuations: list[Continuation], max_nodes: int, max_depth: int,
               min_prob: float = 0.0) -> CandidateTree:
    """Most probable paths first: the nodes with the largest weight, whatever their depth.

    A child never outweighs its parent, and a node enters the queue only after its
    parent is emitted, so pop order is a topological order.
    """
    out = _Emitter()
    root = merge(continuations, max_depth, min_prob)
    counter = 0  # tie-break: earlier pushes (heavier siblings, shallower nodes) first
    heap: list[tuple[float, int, _TrieNode, _TrieNode | None]] = []
    for child in root.ranked_children():
        heap.append((-child.weight, counter, child, None))
        counter += 1
    heapq.heapify(heap)
    while heap and len(out) < max_nodes:
        _, _, node, parent = heapq.heappop(heap)
        out.emit(node, parent)
        for child in node.ranked_children():
            heapq.heappush(heap, (-child.weight, counter, child, node))
            counter += 1
    return out.tree()


TreeBuilder = Callable[[list[Continuation], int, int, float], CandidateTree]

BUILDERS: dict[str, TreeBuilder] = {
    "single_branch": single_branch,
    "multi_branch_dfs": multi_branch_dfs,
    "multi_branch_bfs": multi_branch_bfs,
    "best_first": best_first,
}


def build(algorithm: str, continuations: list[Continuation], max_nodes: int, max_depth: int,
          min_prob: float = 0.0) -> CandidateTree:
    """Build a tree with the named algorithm (a key of BUILDERS), of nodes weighing at least min_prob."""
    if max_nodes <= 0 or max_depth <= 0 or not continuations:
        return CandidateTree()
    return BUILDERS[algorithm](continuations, max_nodes, max_depth, min_prob)
