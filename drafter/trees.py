"""Tree builders: merge continuations into a trie, then pick nodes under a budget.

In: `Continuation`s from any sources (scores comparable across the list). Out: a
CandidateTree (protos.segserve.v1.tree: parents -1 = root) in topological order,
with at most `max_nodes` nodes of depth at most `max_depth`. A trie node's weight
is the sum of the scores of the continuations through it. A node's chance of being
accepted is its weight, or, given a `calibrate` (what the drafter measured of its
nodes' fate, drafter/calibration.py), the product of its path's calibrated chances;
builders take the likeliest nodes, and `min_prob` drops the nodes less likely than
that whatever the budget left (a caller whose scores are plain frequencies passes 0).

Builders live in `BUILDERS` (name -> function); a segment names one in its config.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from drafter.types import Continuation
from protos.segserve.v1.tree import ROOT, CandidateTree


Calibrate = Callable[[int, float, float], float]
"""(depth, weight, its parent's weight) -> the chance a node at that depth is accepted once its parent is (at most
1): a drafter that measures how its nodes fare (drafter/calibration.py) turns weights into acceptance this way."""


@dataclass(slots=True)
class TrieNode:
    token_id: int
    depth: int = 0
    """Tokens from the root to it (the root's 0)."""
    weight: float = 0.0
    children: dict[int, "TrieNode"] = field(default_factory=dict)
    prob: float = 1.0
    """Its path's estimated chance of acceptance (_Ranker): the weight, or the calibrated chances multiplied."""
    kept: list["TrieNode"] | None = None
    """Its children at least min_prob likely, the likeliest first (ties keep insertion order); None = not ranked."""


def merge(continuations: list[Continuation], max_depth: int) -> TrieNode:
    """A trie of the continuations cut at max_depth; shared prefixes become shared nodes."""
    root = TrieNode(token_id=-1)
    for cont in sorted(continuations, key=lambda c: -c.score):
        if cont.score <= 0:
            continue
        node = root
        root.weight += cont.score
        for depth, token_id in enumerate(cont.token_ids[:max_depth], start=1):
            node = node.children.setdefault(token_id, TrieNode(token_id, depth))
            node.weight += cont.score
    return root


@dataclass(frozen=True)
class _Ranker:
    """Ranks a node's children once the builder reaches it, leaving out those less likely than min_prob (and
    everything under them). A node's chance is its weight, or with `calibrate` its parent's chance times its own
    given the parent; a child is never likelier than its parent either way, so the trie itself is never cut and
    stays whole for judging (drafter/calibration.py)."""

    min_prob: float = 0.0
    calibrate: Calibrate | None = None

    def kept(self, node: TrieNode) -> list[TrieNode]:
        """node's ranked children."""
        if node.kept is None:
            for child in node.children.values():
                child.prob = (child.weight if self.calibrate is None
                              else node.prob * self.calibrate(child.depth, child.weight, node.weight))
            node.kept = sorted((c for c in node.children.values() if c.prob >= self.min_prob), key=lambda c: -c.prob)
        return node.kept


class _Emitter:
    """Collects trie nodes in emission order (parents first); tree() freezes them into a CandidateTree."""

    def __init__(self) -> None:
        self._token_ids: list[int] = []
        self._parents: list[int] = []
        self._index: dict[int, int] = {}  # id(trie node) -> its index in the tree

    def __len__(self) -> int:
        return len(self._token_ids)

    def emit(self, node: TrieNode, parent: TrieNode | None) -> None:
        """Append node as a child of parent (None = the root); parent must be emitted already."""
        self._index[id(node)] = len(self._token_ids)
        self._token_ids.append(node.token_id)
        self._parents.append(ROOT if parent is None else self._index[id(parent)])

    def tree(self) -> CandidateTree:
        return CandidateTree(tuple(self._token_ids), tuple(self._parents))


def single_branch(root: TrieNode, max_nodes: int, ranker: _Ranker) -> CandidateTree:
    """One chain: the likeliest child at every level."""
    out = _Emitter()
    node, parent = root, None
    while len(out) < max_nodes and (kept := ranker.kept(node)):
        child = kept[0]
        out.emit(child, parent)
        node = parent = child
    return out.tree()


def multi_branch_dfs(root: TrieNode, max_nodes: int, ranker: _Ranker) -> CandidateTree:
    """Depth-first, likeliest child first: the best chain in full, then its alternatives."""
    out = _Emitter()
    stack: list[tuple[TrieNode, TrieNode | None]] = [(c, None) for c in reversed(ranker.kept(root))]
    while stack and len(out) < max_nodes:
        node, parent = stack.pop()
        out.emit(node, parent)
        stack.extend((c, node) for c in reversed(ranker.kept(node)))
    return out.tree()


def multi_branch_bfs(root: TrieNode, max_nodes: int, ranker: _Ranker) -> CandidateTree:
    """Breadth-first, likeliest child first: every alternative of depth d before depth d + 1."""
    out = _Emitter()
    queue = deque((c, None) for c in ranker.kept(root))
    while queue and len(out) < max_nodes:
        node, parent = queue.popleft()
        out.emit(node, parent)
        queue.extend((c, node) for c in ranker.kept(node))
    return out.tree()


def best_first(root: TrieNode, max_nodes: int, ranker: _Ranker) -> CandidateTree:
    """Most probable paths first: the likeliest nodes, whatever their depth.

    A child is never likelier than its parent, and a node enters the queue only after its
    parent is emitted, so pop order is a topological order.
    """
    out = _Emitter()
    counter = itertools.count()  # tie-break: earlier pushes (likelier siblings, shallower nodes) first
    heap = [(-c.prob, next(counter), c, None) for c in ranker.kept(root)]
    heapq.heapify(heap)
    while heap and len(out) < max_nodes:
        _, _, node, parent = heapq.heappop(heap)
        out.emit(node, parent)
        for child in ranker.kept(node):
            heapq.heappush(heap, (-child.prob, next(counter), child, node))
    return out.tree()


TreeBuilder = Callable[[TrieNode, int, _Ranker], CandidateTree]

BUILDERS: dict[str, TreeBuilder] = {
    "single_branch": single_branch,
    "multi_branch_dfs": multi_branch_dfs,
    "multi_branch_bfs": multi_branch_bfs,
    "best_first": best_first,
}


def grow(algorithm: str, root: TrieNode, max_nodes: int, min_prob: float = 0.0,
         calibrate: Calibrate | None = None) -> CandidateTree:
    """The tree the named algorithm picks from a merged trie (merge()), of nodes at least min_prob likely (their
    weight, or their calibrated chance with `calibrate`)."""
    if max_nodes <= 0 or not root.children:
        return CandidateTree()
    return BUILDERS[algorithm](root, max_nodes, _Ranker(min_prob, calibrate))
