"""LookupCorpus: one segment kind's token-sequence -> continuation frequencies, as a suffix trie.

In: token sequences (segments learned online, or text files). Out: continuations
of a context, ranked by frequency.

Every suffix of every added sequence is inserted, cut at `max_depth` tokens; a
node's count is how often its root path occurred. A query takes the LONGEST
suffix of the context (max_key down to min_key tokens) that is a trie path with
children, then returns the most frequent distinct continuations below it (each
scored by how often that exact continuation followed the key).

Memory bound (policy): the corpus holds at most `max_entries` nodes. When an add
passes it, eviction passes run until it is under 90% of the bound; each pass
multiplies every count by `decay` and drops the nodes (with their subtrees) whose
count was below 1 before the pass. Rarely seen, long-unseen paths go first; a
node seen once survives one pass, so freshly learned content gets a grace period.
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path
from typing import Sequence

import numpy as np

from drafter.segments import CorpusLimits
from drafter.types import Continuation

FORMAT = "segserve-corpus"
VERSION = 1
LOW_WATER = 0.9
# Memory per trie node, measured with tracemalloc on corpora of 10^5 nodes (CPython 3.11): the _Node, its
# count, its children dict and its slot in its parent's dict. For the stats only.
BYTES_PER_ENTRY = 280


class _Node:
    __slots__ = ("count", "children")

    def __init__(self) -> None:
        self.count = 0.0
        self.children: dict[int, _Node] = {}


class LookupCorpus:
    """A bounded suffix trie implementing ContinuationSource."""

    def __init__(self, limits: CorpusLimits | None = None):
        self.limits = limits or CorpusLimits()
        self._root = _Node()
        self.num_entries = 0

    @property
    def num_bytes(self) -> int:
        """Estimated memory held by the trie."""
        return self.num_entries * BYTES_PER_ENTRY

    def add(self, token_ids: Sequence[int]) -> None:
        """Count every suffix of token_ids (cut at max_depth), then evict if over the bound."""
        tokens = list(token_ids)
        depth = self.limits.max_depth
        for start in range(len(tokens)):
            node = self._root
            for token_id in tokens[start : start + depth]:
                child = node.children.get(token_id)
                if child is None:
                    child = node.children[token_id] = _Node()
                    self.num_entries += 1
                child.count += 1.0
                node = child
        if self.num_entries > self.limits.max_entries:
            self._evict()

    def propose(self, context: Sequence[int], max_len: int, max_candidates: int) -> list[Continuation]:
        """The most frequent continuations after the longest matching key, best first."""
        node = self._longest_match(context)
        if node is None or max_len <= 0 or max_candidates <= 0:
            return []
        return _top_continuations(node, max_len, max_candidates)

    def _longest_match(self, context: Sequence[int]) -> _Node | None:
        longest = min(self.limits.max_key, len(context))
        for key_len in range(longest, self.limits.min_key - 1, -1):
            node: _Node | None = self._root
            for token_id in context[len(context) - key_len :]:
                node = node.children.get(token_id)
                if node is None:
                    break
            if node is not None and node.children:
                return node
        return None

    def _evict(self) -> None:
        target = int(self.limits.max_entries * LOW_WATER)
        while self.num_entries > target:
            self.num_entries = _decay_and_prune(self._root, self.limits.decay)

    def save(self, path: str | Path) -> None:
        """Write the trie in preorder as a versioned .npz (tokens, counts, child counts)."""
        tokens, counts, num_children = [], [], []
        stack = [(-1, self._root)]
        while stack:
            token_id, node = stack.pop()
            tokens.append(token_id)
            counts.append(node.count)
            num_children.append(len(node.children))
            stack.extend(reversed(node.children.items()))
        meta = {"format": FORMAT, "version": VERSION, "limits": self.limits.__dict__}
        with open(path, "wb") as f:
            np.savez_compressed(
                f,
                meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                tokens=np.asarray(tokens, dtype=np.int64),
                counts=np.asarray(counts, dtype=np.float32),
                num_children=np.asarray(num_children, dtype=np.int64),
            )

    @classmethod
    def load(cls, path: str | Path, limits: CorpusLimits | None = None) -> "LookupCorpus":
        """Read a file written by save; `limits` (e.g. from the current config) override the saved ones."""
        with np.load(path) as data:
            meta = json.loads(data["meta"].tobytes().decode())
            if meta.get("format") != FORMAT or meta.get("version") != VERSION:
                raise ValueError(f"{path}: not a {FORMAT} v{VERSION} file: {meta.get('format')} v{meta.get('version')}")
            corpus = cls(limits or CorpusLimits(**meta["limits"]))
            corpus._root, corpus.num_entries = _from_preorder(
                data["tokens"].tolist(), data["counts"].tolist(), data["num_children"].tolist()
            )
        if corpus.num_entries > corpus.limits.max_entries:
            corpus._evict()
        return corpus


def _top_continuations(node: _Node, max_len: int, max_candidates: int) -> list[Continuation]:
    """Best-first over counts (a child never outcounts its parent): leaves pop in count order.

    A leaf is a path of max_len tokens or one that ends in the trie. Ties prefer
    deeper paths, so equal counts finish one continuation before starting another.
    """
    out: list[Continuation] = []
    serial = 0
    heap: list[tuple[float, int, int, tuple[int, ...], _Node]] = []
    for token_id, child in node.children.items():
        heap.append((-child.count, -1, serial, (token_id,), child))
        serial += 1
    heapq.heapify(heap)
    budget = max_candidates * max_len * 8  # bounds the work on wide, flat subtrees
    while heap and len(out) < max_candidates and budget > 0:
        budget -= 1
        neg_count, _, _, path, child = heapq.heappop(heap)
        if len(path) >= max_len or not child.children:
            out.append(Continuation(path, -neg_count))
            continue
        for token_id, grandchild in child.children.items():
            heapq.heappush(heap, (-grandchild.count, -len(path) - 1, serial, path + (token_id,), grandchild))
            serial += 1
    return out


def _decay_and_prune(root: _Node, decay: float) -> int:
    """Multiply counts by decay, drop nodes whose count was below 1; returns the nodes left."""
    num_left = 0
    stack = [root]
    while stack:
        node = stack.pop()
        kept = {}
        for token_id, child in node.children.items():
            if child.count >= 1.0:
                child.count *= decay
                kept[token_id] = child
        node.children = kept
        num_left += len(kept)
        stack.extend(kept.values())
    return num_left


def _from_preorder(tokens: list[int], counts: list[float], num_children: list[int]) -> tuple[_Node, int]:
    root = _Node()
    root.count = counts[0]
    stack = [(root, num_children[0])]
    for i in range(1, len(tokens)):
        while stack[-1][1] == 0:
            stack.pop()
        parent, remaining = stack[-1]
        stack[-1] = (parent, remaining - 1)
        node = parent.children[tokens[i]] = _Node()
        node.count = counts[i]
        stack.append((node, num_children[i]))
    return root, len(tokens) - 1
