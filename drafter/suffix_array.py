"""SuffixRun: token sequences in one flat int32 buffer, indexed by suffix arrays (drafter/corpus.py's runs, and
the prompt of a request's history, drafter/history.py).

The forward array holds every token position sorted by the tokens from there on (max_depth of them), the
backward one every position followed by a token, sorted by the tokens up to there read backwards (max_key of
them): a key's occurrences are one range of either, found by binary search, token by token. Both are built by
prefix doubling (a few numpy argsorts). Reads of single elements go through memoryviews (Python numbers, no
numpy scalars); bisect's key is a memoryview's own __getitem__ on a shifted view, so a probe is one C call.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from drafter.segments import CorpusLimits

SEPARATOR = int(np.iinfo(np.int32).min)
"""Ends every sequence in a run's buffer and pads it: below every token (keyed corpora learn -1, KEY_START)."""


@dataclass(frozen=True)
class SuffixRun:
    """Sequences and their suffix arrays; immutable (a new weight scale makes a new SuffixRun over the same arrays)."""

    tokens: np.ndarray
    """int32: `pad` separators, then every sequence followed by a separator, then `pad` separators."""
    forward: np.ndarray
    """int32 positions of every token, sorted by the tokens from there on (max_depth of them)."""
    backward: np.ndarray
    """int32 positions (less `pad`) of every token followed by a token, sorted by the tokens up to there, read
    backwards."""
    weight_sums: np.ndarray
    """float64, len(forward) + 1: weight_sums[i] = the weights of forward[:i]'s sequences, summed."""
    starts: np.ndarray
    """int64 position of each sequence's first token, oldest sequence first."""
    weights: np.ndarray
    """float64 weight of each sequence (before `scale`)."""
    pad: int
    """Separators before the first sequence and after the last (max_depth: a read never leaves the buffer)."""
    scale: float = 1.0
    views: tuple[memoryview, ...] = field(init=False, repr=False, compare=False)
    """tokens, forward, backward and weight_sums as memoryviews: reads of one element as Python numbers, fast."""

    def __post_init__(self) -> None:
        views = tuple(memoryview(a) for a in (self.tokens, self.forward, self.backward, self.weight_sums))
        object.__setattr__(self, "views", views)

    @property
    def num_tokens(self) -> int:
        return len(self.forward)

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes for a in (self.tokens, self.forward, self.backward, self.weight_sums, self.starts,
                                      self.weights))

    @property
    def lengths(self) -> np.ndarray:
        """Each sequence's number of tokens, oldest first (its separator not counted)."""
        return np.diff(np.r_[self.starts, len(self.tokens) - self.pad]) - 1

    def sequences(self) -> list[np.ndarray]:
        """Each sequence's tokens, oldest first."""
        return [self.tokens[start:start + length] for start, length in zip(self.starts.tolist(),
                                                                             self.lengths.tolist())]

    def match_length(self, context: Sequence[int], longest: int) -> int:
        """How many of the context's last tokens (at most `longest`) this run holds followed by a token."""
        return len(self.match_ranges(context, longest))

    def match_ranges(self, context: Sequence[int], longest: int) -> list[tuple[int, int]]:
        """For n = 1, 2, ... (at most `longest`, while any): the range of `backward` whose positions end the
        context's last n tokens (backward[lo:hi] + 1: where each occurrence's continuation starts)."""
        tokens, _, backward, _ = self.views
        lo, hi = 0, len(backward)
        ranges = []
        for depth in range(longest):
            token = context[len(context) - 1 - depth]
            read = tokens[self.pad - depth:].__getitem__  # backward holds positions less the padding
            lo = bisect_left(backward, token, lo, hi, key=read)
            hi = bisect_right(backward, token, lo, hi, key=read)
            if lo == hi:
                break
            ranges.append((lo, hi))
        return ranges

    def key_range(self, key: Sequence[int]) -> tuple[int, int]:
        """The range of `forward` whose positions start with `key` (empty: lo == hi)."""
        tokens, forward, _, _ = self.views
        lo, hi = 0, len(forward)
        for depth, token in enumerate(key):
            read = tokens[depth:].__getitem__
            lo = bisect_left(forward, token, lo, hi, key=read)
            hi = bisect_right(forward, token, lo, hi, key=read)
            if lo == hi:
                break
        return lo, hi

    def weight(self, lo: int, hi: int) -> float:
        weight_sums = self.views[3]
        return (weight_sums[hi] - weight_sums[lo]) * self.scale

    def children(self, lo: int, hi: int, depth: int) -> Iterator[tuple[int, int, int]]:
        """(token, lo, hi) for each token that follows forward[lo:hi]'s common prefix of `depth` tokens."""
        tokens, forward, _, _ = self.views
        read = tokens[depth:].__getitem__
        while lo < hi:
            token = read(forward[lo])
            end = bisect_right(forward, token, lo, hi, key=read)
            if token != SEPARATOR:
                yield token, lo, end
            lo = end

    @classmethod
    def build(cls, sequences: Sequence[np.ndarray], weights: np.ndarray, limits: CorpusLimits) -> "SuffixRun":
        """Index `sequences` (oldest first), each of weight `weights[i]`."""
        pad = limits.max_depth
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        body = np.full(int(lengths.sum()) + len(sequences), SEPARATOR, dtype=np.int32)
        ends = np.cumsum(lengths + 1)
        starts = ends - lengths - 1
        for sequence, start in zip(sequences, starts.tolist()):
            body[start:start + len(sequence)] = sequence
        is_token = body != SEPARATOR
        separator_rank = np.cumsum(~is_token) - 1  # each separator ranks below every token, and apart
        _, token_rank = np.unique(body, return_inverse=True)
        ranks = np.where(is_token, token_rank.reshape(-1) + len(sequences), separator_rank)
        forward = _sorted_positions(ranks, limits.max_depth)
        forward = forward[is_token[forward]]
        has_next = is_token & np.r_[is_token[1:], False]
        backward = len(body) - 1 - _sorted_positions(ranks[::-1].copy(), limits.max_key)
        backward = backward[has_next[backward]]
        sequence_of = np.searchsorted(starts, forward, side="right") - 1
        weight_sums = np.zeros(len(forward) + 1)
        np.cumsum(weights[sequence_of], out=weight_sums[1:])
        padded = np.concatenate([np.full(pad, SEPARATOR, np.int32), body, np.full(pad, SEPARATOR, np.int32)])
        return cls(padded, (forward + pad).astype(np.int32), backward.astype(np.int32), weight_sums, starts + pad,
                   np.asarray(weights, dtype=np.float64), pad)


def _sorted_positions(ranks: np.ndarray, depth: int) -> np.ndarray:
    """Positions of `ranks` sorted by the `depth` (or more) ranks from each on (prefix doubling)."""
    n = len(ranks)
    rank = np.unique(ranks, return_inverse=True)[1].reshape(-1).astype(np.int64) + 1  # 0: past the end
    order = np.argsort(rank, kind="stable")
    width = 1
    while width < depth and rank.max(initial=0) < n:  # stops early once every position ranks apart
        following = np.zeros(n, dtype=np.int64)
        following[: max(0, n - width)] = rank[width:]
        key = rank * (n + 2) + following
        order = np.argsort(key, kind="stable")
        ordered = key[order]
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(np.r_[True, ordered[1:] != ordered[:-1]])
        width *= 2
    return order
