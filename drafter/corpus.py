"""LookupCorpus: one segment kind's token sequences -> continuation frequencies, as suffix arrays.

In: token sequences (segments learned online, or text files). Out: continuations of a context,
ranked by frequency.

Storage. Every learned sequence is kept once, in flat int32 buffers, and indexed by suffix arrays
over them. A *run* holds some sequences (each followed by a separator) and three arrays of
positions: every token position sorted by the tokens from it on (forward, up to `max_depth`
tokens), every position that has a next token sorted by the tokens up to it read backwards
(backward, up to `max_key` tokens: where a key ends), and the running sum of the sequences' weights
in forward order. About 20 bytes a token, counted from the arrays themselves (`num_bytes`), where
a trie of Python objects holding every suffix took 280 bytes a node and ~2,500 a learned token.

Query. The longest suffix of the context (max_key down to min_key tokens) that some run holds
followed by a token is found in one pass per run over the backward array, narrowing by binary
search from the context's last token back. The key's occurrences are then one range of the forward
array, sorted by what follows them: a continuation's count is the weight summed over its sub-range
(two prefix sums), and the most frequent continuations are found best-first over those ranges,
across runs. A key and its continuation together never pass max_depth (the forward sort's depth).

Learning. A new sequence becomes a run of its own; while the newest run holds at least half as many
tokens as the one before it, the two merge into one, rebuilt. So a corpus holds O(log n) runs and
each token takes part in O(log n) builds (prefix doubling: a few argsorts of the run). Runs never
change once built: a build reads the current runs, and the new tuple replaces the old in one
assignment, so a reader sees one or the other whole. `learn_steps` and `eviction_steps` are
generators whose yields say whether their next slice mutates the corpus (LOCKED: the caller holds
the corpus lock, drafter/learner.py, for the swap) or only builds (UNLOCKED).

Weights and the bound. A sequence starts at weight 1. The corpus holds at most max_bytes (and
max_entries tokens when set); when an add passes it, the oldest sequences go (every sequence left
has been decayed at least as often as an older one, so the oldest weigh least) until 90% of the
bound is left, and every weight left is multiplied by `decay`, so that what was seen long ago weighs
less than what is seen next.

Snapshots: a versioned .npz of the sequences and their weights (v2); a v1 file (the suffix trie this
replaced, in preorder) loads as its root-to-leaf paths weighted by their counts.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from drafter.segments import CorpusLimits
from drafter.suffix_array import SEPARATOR, SuffixRun
from drafter.types import Continuation

FORMAT = "segserve-corpus"
VERSION = 2
TRIE_VERSION = 1
"""Snapshots of the suffix trie this corpus replaced; `load` migrates them."""
LOW_WATER = 0.9
LOCKED, UNLOCKED = True, False
"""What a step generator's yield says of its next slice: it mutates the corpus, or only builds."""


class LookupCorpus:
    """A bounded set of suffix-array runs implementing ContinuationSource (see the module docstring)."""

    def __init__(self, limits: CorpusLimits | None = None):
        self.limits = limits or CorpusLimits()
        self._runs: tuple[SuffixRun, ...] = ()
        self.num_evictions = 0
        """Times the bound was passed and the oldest sequences evicted."""

    @property
    def num_entries(self) -> int:
        """Learned tokens held."""
        return sum(run.num_tokens for run in self._runs)

    @property
    def num_bytes(self) -> int:
        """Memory held by the runs' arrays."""
        return sum(run.num_bytes for run in self._runs)

    def add(self, token_ids: Sequence[int]) -> None:
        """Learn token_ids, then evict if over the bound; all at once."""
        for _ in self.learn_steps(token_ids):
            pass

    def evict(self) -> None:
        """Evict down to 90% of the bound now, if over it."""
        for _ in self.eviction_steps():
            pass

    def learn_steps(self, token_ids: Sequence[int]) -> Iterator[bool]:
        """`add` a build at a time: the new sequence's run, each merge, then the swap (locked), then eviction.
        The first slice (which the caller runs locked) does nothing."""
        tokens = np.asarray(token_ids, dtype=np.int32).reshape(-1)
        if not len(tokens):
            return
        yield UNLOCKED
        runs = [*self._runs, SuffixRun.build([tokens], np.ones(1), self.limits)]
        while len(runs) >= 2 and 2 * runs[-1].num_tokens >= runs[-2].num_tokens:
            runs[-2:] = [_merged(runs[-2:], self.limits)]
            yield UNLOCKED
        yield LOCKED
        self._runs = tuple(runs)
        if self._is_over(self.num_bytes, self.num_entries):
            yield UNLOCKED
            yield from self.eviction_steps()

    def eviction_steps(self) -> Iterator[bool]:
        """Evict the oldest sequences down to 90% of the bound, if over it, then decay what is left. The
        first slice only builds."""
        if not self._is_over(self.num_bytes, self.num_entries):
            return
        self.num_evictions += 1
        runs = list(self._runs)
        max_bytes = int(self.limits.max_bytes * LOW_WATER)
        max_entries = int(self.limits.max_entries * LOW_WATER) if self.limits.max_entries else None
        num_bytes, num_entries = self.num_bytes, self.num_entries
        while runs and (num_bytes > max_bytes or (max_entries is not None and num_entries > max_entries)):
            oldest = runs.pop(0)
            num_bytes -= oldest.num_bytes
            num_entries -= oldest.num_tokens
            kept = min(len(oldest.starts) - 1,  # at least one goes, whatever the estimate says
                       _newest_within(oldest, max_bytes - num_bytes,
                                      None if max_entries is None else max_entries - num_entries))
            if kept:
                rebuilt = SuffixRun.build(oldest.sequences()[-kept:], oldest.weights[-kept:] * oldest.scale, self.limits)
                runs.insert(0, rebuilt)
                num_bytes += rebuilt.num_bytes
                num_entries += rebuilt.num_tokens
                yield UNLOCKED
        yield LOCKED
        self._runs = tuple(replace(run, scale=run.scale * self.limits.decay) for run in runs)

    def _is_over(self, num_bytes: int, num_entries: int) -> bool:
        return num_bytes > self.limits.max_bytes or bool(self.limits.max_entries and num_entries >
                                                         self.limits.max_entries)

    def propose(self, context: Sequence[int], max_len: int, max_candidates: int) -> list[Continuation]:
        """The most frequent continuations after the longest matching key, best first."""
        runs = self._runs
        longest = min(self.limits.max_key, len(context), self.limits.max_depth - 1)
        if not runs or max_len <= 0 or max_candidates <= 0 or longest < self.limits.min_key:
            return []
        matches = [run.match_length(context, longest) for run in runs]
        key_len = max(matches)
        if key_len < self.limits.min_key:
            return []
        key = context[len(context) - key_len:]
        ranges = [(run, *run.key_range(key)) for run, match in zip(runs, matches) if match == key_len]
        found = _top_continuations([(run, lo, hi) for run, lo, hi in ranges if lo < hi], key_len,
                                   min(max_len, self.limits.max_depth - key_len), max_candidates)
        return [Continuation(tokens, score, key_len) for tokens, score in found]

    def save(self, path: str | Path) -> None:
        """Write the sequences (oldest first, each followed by a separator) and their weights as a versioned .npz."""
        runs = self._runs
        sequences = [s for run in runs for s in run.sequences()]
        weights = np.concatenate([run.weights * run.scale for run in runs]) if runs else np.zeros(0)
        tokens = np.concatenate([np.append(s, np.int32(SEPARATOR)) for s in sequences]) if sequences else []
        meta = {"format": FORMAT, "version": VERSION, "limits": self.limits.__dict__}
        with open(path, "wb") as f:
            np.savez_compressed(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                                tokens=np.asarray(tokens, dtype=np.int32), weights=weights.astype(np.float64))

    @classmethod
    def load(cls, path: str | Path, limits: CorpusLimits | None = None) -> "LookupCorpus":
        """Read a file written by save (or a v1 trie); `limits` (e.g. from the current config) override the
        saved ones."""
        with np.load(path) as data:
            meta = json.loads(data["meta"].tobytes().decode())
            version = meta.get("version")
            if meta.get("format") != FORMAT or version not in (VERSION, TRIE_VERSION):
                raise ValueError(f"{path}: not a {FORMAT} v{VERSION} (or v{TRIE_VERSION}) file: "
                                 f"{meta.get('format')} v{version}")
            corpus = cls(limits or CorpusLimits(**meta["limits"]))
            if version == TRIE_VERSION:
                sequences, weights = _trie_paths(data["tokens"].tolist(), data["counts"].tolist(),
                                                 data["num_children"].tolist())
            else:
                tokens = data["tokens"]
                ends = np.flatnonzero(tokens == SEPARATOR)
                sequences = [s for s in np.split(tokens, ends + 1) if len(s) > 1 or (len(s) and s[0] != SEPARATOR)]
                sequences = [s[:-1] if s[-1] == SEPARATOR else s for s in sequences]
                weights = data["weights"]
        if sequences:
            corpus._runs = (SuffixRun.build(sequences, np.asarray(weights, dtype=np.float64), corpus.limits),)
        corpus.evict()
        return corpus


def _merged(runs: Sequence[SuffixRun], limits: CorpusLimits) -> SuffixRun:
    """One run holding the runs' sequences, oldest first, with their weights as they stand."""
    sequences = [s for run in runs for s in run.sequences()]
    return SuffixRun.build(sequences, np.concatenate([run.weights * run.scale for run in runs]), limits)


def _newest_within(run: SuffixRun, max_bytes: int, max_entries: int | None) -> int:
    """How many of the run's newest sequences a rebuilt run of them keeps within max_bytes (and max_entries
    tokens unless None). Estimated from the run's own bytes per token and per sequence."""
    lengths = run.lengths
    newest_first = np.cumsum(lengths[::-1])
    per_token = run.num_bytes / max(1, run.num_tokens + len(run.starts))
    fits = per_token * (newest_first + np.arange(1, len(lengths) + 1)) <= max_bytes
    if max_entries is not None:
        fits &= newest_first <= max_entries
    return int(np.argmin(fits)) if not fits.all() else len(lengths)


def _top_continuations(ranges: list[tuple[SuffixRun, int, int]], key_len: int, max_len: int, max_candidates: int
                       ) -> list[tuple[tuple[int, ...], float]]:  # fmt: skip
    """Best-first over counts (a continuation never outcounts its prefix): leaves pop in count order.

    A leaf is a path of max_len tokens or one nothing follows. Ties prefer deeper paths, so equal counts
    finish one continuation before starting another.
    """
    out: list[tuple[tuple[int, ...], float]] = []
    heap: list[tuple[float, int, int, tuple[int, ...], list[tuple[SuffixRun, int, int]]]] = []
    serial = 0

    def push(path: tuple[int, ...], parent_ranges: list[tuple[SuffixRun, int, int]]) -> None:
        nonlocal serial
        if len(parent_ranges) == 1:  # the usual case: one run holds the key
            run, lo, hi = parent_ranges[0]
            for token, child_lo, child_hi in run.children(lo, hi, key_len + len(path)):
                heapq.heappush(heap, (-run.weight(child_lo, child_hi), -len(path) - 1, serial, (*path, token),
                                      [(run, child_lo, child_hi)]))
                serial += 1
            return
        grouped: dict[int, list[tuple[SuffixRun, int, int]]] = {}
        for run, lo, hi in parent_ranges:
            for token, child_lo, child_hi in run.children(lo, hi, key_len + len(path)):
                grouped.setdefault(token, []).append((run, child_lo, child_hi))
        for token, child_ranges in grouped.items():
            count = sum(run.weight(lo, hi) for run, lo, hi in child_ranges)
            heapq.heappush(heap, (-count, -len(path) - 1, serial, (*path, token), child_ranges))
            serial += 1

    push((), ranges)
    budget = max_candidates * max_len * 8  # bounds the work on wide, flat subtrees
    while heap and len(out) < max_candidates and budget > 0:
        budget -= 1
        neg_count, _, _, path, child_ranges = heapq.heappop(heap)
        size = len(heap)
        if len(path) < max_len:
            push(path, child_ranges)
        if len(heap) == size:  # max_len, or nothing follows
            out.append((path, -neg_count))
    return out


def _trie_paths(tokens: list[int], counts: list[float], num_children: list[int]
                ) -> tuple[list[np.ndarray], np.ndarray]:  # fmt: skip
    """A v1 snapshot (a suffix trie in preorder: token, count, number of children) as sequences: each path from
    the root that ends a continuation (a leaf, or a node counted more often than its children together), weighted
    by the count that ends there."""
    sequences, weights = [], []
    stack: list[list] = []  # [token, count, children left, children's counts]
    path: list[int] = []

    def close(entry: list) -> None:
        ending = entry[1] - entry[3]
        if ending > 1e-9 and path:
            sequences.append(np.asarray(path, dtype=np.int32))
            weights.append(ending)

    for i, (token, count, children) in enumerate(zip(tokens, counts, num_children)):
        while stack and stack[-1][2] == 0:
            close(stack.pop())
            if path:
                path.pop()
        if stack:
            stack[-1][2] -= 1
            stack[-1][3] += count
        if i:
            path.append(token)
        stack.append([token, count, children, 0.0])
    while stack:
        close(stack.pop())
        if path:
            path.pop()
    return sequences, np.asarray(weights, dtype=np.float64)
