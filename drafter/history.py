"""HistorySource: the request's own prompt and output as a continuation source (prompt lookup).

In: the request's tokens, appended incrementally. Out: continuations that followed
earlier occurrences of the context's longest matching suffix (min_key..max_key
tokens), identical ones merged and counted, ranked by count then recency.

The prompt, which arrives whole, is indexed as a suffix array (drafter/suffix_array.py:
built by a few numpy sorts, ~20 bytes a token); the tokens after it are indexed one by one
in a dict mapping every n-gram (n in 1..max_key) ending at each to the positions right
after its occurrences. A query narrows the prompt's array from the context's last token
back (binary search) and looks the keys up in the dict, not a scan of the history.

Memory bound: the dict holds at most `max_bytes` (at a measured size per
indexed n-gram). It has two generations, each covering up to half the budget's
tokens; when the newer one is full, the older one is dropped whole and the newer
one takes its place, so the most recent half to whole budget stays indexed and
dropping costs no scan. The token list itself is the request's sequence (bounded
by the model's context); matches found in the index read their continuations
there, however old.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import numpy as np

from drafter.segments import CorpusLimits
from drafter.suffix_array import SuffixRun
from drafter.types import Continuation

# Memory per indexed n-gram, measured with tracemalloc over 20,000 random tokens of a 262k vocabulary
# (CPython 3.11, max_key 8: 1,600 bytes per token): its key tuple, its positions list, its dict slot.
BYTES_PER_NGRAM = 200
DEFAULT_MAX_BYTES = 64 << 20
MAX_MATCH = 64
"""Longest match a continuation reports: a max_key match is followed back this far along the history."""
PROMPT_TOKENS = 256
"""A first extend at least this long (a prompt) goes to a suffix array, not the dict."""
_EMPTY: list[int] = []


class HistorySource:
    """Prompt-lookup over one request's tokens, implementing ContinuationSource."""

    def __init__(self, max_key: int = 8, min_key: int = 2, max_occurrences: int = 16,
                 max_bytes: int = DEFAULT_MAX_BYTES, is_indexed: bool = True):
        if not 1 <= min_key <= max_key or max_occurrences <= 0 or max_bytes <= 0:
            raise ValueError("history needs 1 <= min_key <= max_key, max_occurrences > 0 and max_bytes > 0")
        self.max_key = max_key
        self.min_key = min_key
        self.max_occurrences = max_occurrences
        self.max_bytes = max_bytes
        self.is_indexed = is_indexed
        """False: keep the tokens only (a state about to be dropped needs no index)."""
        self.tokens: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._older: dict[tuple[int, ...], list[int]] = {}
        self._num_indexed = 0  # tokens indexed in _index
        self._num_older = 0  # tokens indexed in _older
        self._generation_tokens = max(1, max_bytes // (2 * max_key * BYTES_PER_NGRAM))
        self._prompt: SuffixRun | None = None
        """The first extend's tokens when a prompt (PROMPT_TOKENS or more), as a suffix array."""

    @property
    def num_bytes(self) -> int:
        """Estimated memory of the index: the dict (at most max_bytes) and the prompt's arrays."""
        prompt = self._prompt.num_bytes if self._prompt is not None else 0
        return (self._num_indexed + self._num_older) * self.max_key * BYTES_PER_NGRAM + prompt

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append tokens and index the n-grams ending at each."""
        if not self.is_indexed:
            self.tokens.extend(token_ids)
            return
        token_ids = list(token_ids)
        if not self.tokens and len(token_ids) >= PROMPT_TOKENS:
            limits = CorpusLimits(max_depth=self.max_key + 1, max_key=self.max_key, min_key=self.min_key)
            self._prompt = SuffixRun.build([np.asarray(token_ids, dtype=np.int32)], np.ones(1), limits)
            self.tokens.extend(token_ids[:-1])  # its n-grams but those ending at its last token, which the dict
            token_ids = token_ids[-1:]  # indexes (their continuations are the output's)
        for token_id in token_ids:
            self.tokens.append(token_id)
            if self._num_indexed >= self._generation_tokens:
                self._older, self._num_older = self._index, self._num_indexed
                self._index, self._num_indexed = {}, 0
            self._num_indexed += 1
            end = len(self.tokens)
            for n in range(1, min(self.max_key, end) + 1):
                positions = self._index.setdefault(tuple(self.tokens[end - n : end]), [])
                positions.append(end)
                if len(positions) > 2 * self.max_occurrences:
                    del positions[: self.max_occurrences]  # keep the recent ones, amortized

    def propose(self, context: Sequence[int], max_len: int, max_candidates: int) -> list[Continuation]:
        """Continuations of the longest suffix of `context` seen earlier in the history."""
        if max_len <= 0 or max_candidates <= 0:
            return []
        longest = min(self.max_key, len(context))
        in_prompt = self._prompt.match_ranges(context, longest) if self._prompt is not None and longest else []
        for key_len in range(longest, self.min_key - 1, -1):
            key = tuple(context[len(context) - key_len :])
            older, newer = self._older.get(key), self._index.get(key, _EMPTY)
            positions = older + newer if older else newer
            if key_len <= len(in_prompt):  # the prompt's occurrences come first: they are the oldest
                positions = self._prompt_positions(*in_prompt[key_len - 1]) + positions
            found = self._continuations(positions, max_len, context, key_len)
            if found:
                return found[:max_candidates]
        return []

    def _prompt_positions(self, lo: int, hi: int) -> list[int]:
        """Where the continuations of the prompt's occurrences in backward[lo:hi] start, the most recent
        max_occurrences of them, oldest first."""
        ends = np.asarray(self._prompt.backward[lo:hi]) + 1
        if len(ends) > self.max_occurrences:
            ends = np.partition(ends, len(ends) - self.max_occurrences)[-self.max_occurrences:]
        return np.sort(ends).tolist()

    def _continuations(self, positions: Sequence[int], max_len: int, context: Sequence[int],
                       key_len: int) -> list[Continuation]:  # fmt: skip
        """What followed the most recent occurrences of the key, merged and counted; each with the longest match
        among its occurrences (past key_len when the key is max_key long)."""
        recent = [p for p in reversed(positions) if p < len(self.tokens)][: self.max_occurrences]
        counts: Counter[tuple[int, ...]] = Counter()
        matched: dict[tuple[int, ...], int] = {}
        for p in recent:
            tokens = tuple(self.tokens[p : p + max_len])
            counts[tokens] += 1
            if tokens not in matched or matched[tokens] < MAX_MATCH:
                match_len = self._match_len(p, context, key_len) if key_len == self.max_key else key_len
                matched[tokens] = max(matched.get(tokens, 0), match_len)
        # Counter keeps first-seen order (most recent first); sorted() is stable on ties.
        ranked = sorted(counts.items(), key=lambda item: -item[1])
        return [Continuation(tokens, float(count), matched[tokens]) for tokens, count in ranked]

    def _match_len(self, position: int, context: Sequence[int], key_len: int) -> int:
        """How many tokens before `position` equal the context's last ones (at least key_len, at most MAX_MATCH)."""
        match_len = key_len
        limit = min(MAX_MATCH, position, len(context))
        while match_len < limit and self.tokens[position - match_len - 1] == context[-match_len - 1]:
            match_len += 1
        return match_len
