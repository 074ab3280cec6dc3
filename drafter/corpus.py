"""LookupCorpus: one segment kind's token-sequence -> continuation frequencies, as a suffix trie.

In: token sequences (segments learned online, or text files). Out: continuations
of a context, ranked by frequency.

Every suffix of every added sequence is inserted, cut at `max_depth` tokens; a
node's count is how often its root path occurred. A query takes the LONGEST
suffix of the context (max_key down to min_key tokens) that is a trie path with
children, then returns the most frequent distinct continuations below it (each
scored by how often that exact continuation followed the key).

Memory bound (policy): the corpus holds at most `max_nodes` nodes, its byte budget
(`max_bytes`) over the measured size of a node (and `max_entries` when set). When
an add passes it, the least valuable nodes go until exactly 90% of the bound is
left: lowest count first, the deeper first on equal counts, so a node never goes
before its subtree (a child never outcounts its parent). Every count left is then
multiplied by `decay`, so that what was seen long ago weighs less than what is
seen next.

Work comes in slices: `learn_steps` and `eviction_steps` are generators that do a
bounded amount of work (about `slice_nodes` node operations) between yields, and
each yield says whether the next slice mutates the trie (the caller holds the
corpus lock for it, drafter/learner.py) or only reads it (a walk or a sort, which
needs no lock as long as this caller is the trie's only writer). `add` and `evict`
run them to the end at once (offline building, loading).
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from drafter.segments import CorpusLimits
from drafter.types import Continuation

FORMAT = "segserve-corpus"
VERSION = 1
LOW_WATER = 0.9
# Memory per trie node, measured with tracemalloc on corpora of 10^5 nodes (CPython 3.11): the _Node, its
# count, its children dict and its slot in its parent's dict. Turns the byte budget into a node bound.
BYTES_PER_ENTRY = 280
SLICE_NODES = 256
"""Default work of one slice: about this many trie nodes visited or changed (about a millisecond)."""
LOCKED, UNLOCKED = True, False
"""What a step generator's yield says of its next slice: it mutates the trie, or only reads it."""


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
        self.num_evictions = 0
        """Times the bound was passed and nodes evicted."""

    @property
    def num_bytes(self) -> int:
        """Estimated memory held by the trie."""
        return self.num_entries * BYTES_PER_ENTRY

    @property
    def max_nodes(self) -> int:
        """The node bound: the byte budget over a node's size, and max_entries when set."""
        return self.limits.max_nodes(BYTES_PER_ENTRY)

    def add(self, token_ids: Sequence[int]) -> None:
        """Count every suffix of token_ids (cut at max_depth), then evict if over the bound; all at once."""
        for _ in self.learn_steps(token_ids):
            pass

    def evict(self) -> None:
        """Evict down to 90% of the bound now, if over it."""
        for _ in self.eviction_steps():
            pass

    def learn_steps(self, token_ids: Sequence[int], slice_nodes: int = SLICE_NODES) -> Iterator[bool]:
        """`add` a slice at a time: each slice inserts the suffixes of about slice_nodes / max_depth positions.
        The first slice mutates (the caller takes the lock before the first next())."""
        tokens = list(token_ids)
        depth = self.limits.max_depth
        num_positions = max(1, slice_nodes // depth)
        for start in range(0, len(tokens), num_positions):
            if start:
                yield LOCKED
            self._insert(tokens, start, min(start + num_positions, len(tokens)), depth)
        if self.num_entries > self.max_nodes:
            yield UNLOCKED
            yield from self.eviction_steps(slice_nodes)

    def _insert(self, tokens: list[int], start: int, stop: int, depth: int) -> None:
        for begin in range(start, stop):
            node = self._root
            for token_id in tokens[begin : begin + depth]:
                child = node.children.get(token_id)
                if child is None:
                    child = node.children[token_id] = _Node()
                    self.num_entries += 1
                child.count += 1.0
                node = child

    def eviction_steps(self, slice_nodes: int = SLICE_NODES) -> Iterator[bool]:
        """Evict down to 90% of the bound, if over it, a slice at a time (see the module docstring).

        A first walk (read only) counts the nodes per (count, -depth) key; the cutoff key is the one
        below which, with some nodes at it, exactly num_entries - target nodes lie. A second walk
        removes every child under the cutoff (its subtree lies under it too: a child never outcounts its
        parent and is deeper) and the first ones at it, and decays the counts of the rest.
        The first slice only reads.
        """
        target = int(self.max_nodes * LOW_WATER)
        if self.num_entries <= target:
            return
        self.num_evictions += 1
        histogram: dict[tuple[float, int], int] = {}
        stack = [(self._root, 0)]
        num_visited = 0
        while stack:
            node, depth = stack.pop()
            depth += 1
            for child in node.children.values():
                key = (child.count, -depth)
                histogram[key] = histogram.get(key, 0) + 1
                stack.append((child, depth))
            num_visited += len(node.children) + 1
            if num_visited >= slice_nodes and stack:
                num_visited = 0
                yield UNLOCKED
        cutoff, num_at_cutoff = _cutoff(histogram, self.num_entries - target)
        yield LOCKED
        decay = self.limits.decay
        stack = [(self._root, 0)]
        num_visited = 0
        while stack:
            node, depth = stack.pop()
            depth += 1
            for token_id, child in list(node.children.items()):
                key = (child.count, -depth)
                if key < cutoff or (key == cutoff and num_at_cutoff > 0):
                    num_at_cutoff -= key == cutoff
                    del node.children[token_id]
                    num_removed = _subtree_size(child)
                    self.num_entries -= num_removed
                    num_visited += num_removed
                else:
                    child.count *= decay
                    stack.append((child, depth))
            num_visited += len(node.children) + 1
            if num_visited >= slice_nodes and stack:
                num_visited = 0
                yield LOCKED

    def propose(self, context: Sequence[int], max_len: int, max_candidates: int) -> list[Continuation]:
        """The most frequent continuations after the longest matching key, best first."""
        node, key_len = self._longest_match(context)
        if node is None or max_len <= 0 or max_candidates <= 0:
            return []
        return [Continuation(c.token_ids, c.score, key_len) for c in _top_continuations(node, max_len, max_candidates)]

    def _longest_match(self, context: Sequence[int]) -> tuple[_Node | None, int]:
        """The node of the longest suffix of `context` (max_key down to min_key tokens) that has children, and the
        suffix's length."""
        longest = min(self.limits.max_key, len(context))
        for key_len in range(longest, self.limits.min_key - 1, -1):
            node: _Node | None = self._root
            for token_id in context[len(context) - key_len :]:
                node = node.children.get(token_id)
                if node is None:
                    break
            if node is not None and node.children:
                return node, key_len
        return None, 0

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
        corpus.evict()
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


def _cutoff(histogram: dict[tuple[float, int], int], num_evicted: int) -> tuple[tuple[float, int], int]:
    """The smallest key with num_evicted nodes at or under it, and how many at it go."""
    num_below = 0
    for key in sorted(histogram):
        if num_below + histogram[key] >= num_evicted:
            return key, num_evicted - num_below
        num_below += histogram[key]
    raise AssertionError("the histogram holds fewer nodes than num_entries")


def _subtree_size(node: _Node) -> int:
    size, stack = 0, [node]
    while stack:
        node = stack.pop()
        size += 1
        stack.extend(node.children.values())
    return size


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
