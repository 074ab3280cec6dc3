"""HistorySource: the request's own prompt and output as a continuation source (prompt lookup).

In: the request's tokens, appended incrementally. Out: continuations that followed
earlier occurrences of the context's longest matching suffix (min_key..max_key
tokens), identical ones merged and counted, ranked by count then recency.

An index maps every n-gram (n in 1..max_key) to the positions right after its
occurrences, so a query is max_key dict lookups, not a scan of the history.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

from drafter.types import Continuation


class HistorySource:
    """Prompt-lookup over one request's tokens, implementing ContinuationSource."""

    def __init__(self, max_key: int = 8, min_key: int = 2, max_occurrences: int = 16):
        if not 1 <= min_key <= max_key or max_occurrences <= 0:
            raise ValueError("history needs 1 <= min_key <= max_key and max_occurrences > 0")
        self.max_key = max_key
        self.min_key = min_key
        self.max_occurrences = max_occurrences
        self.tokens: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = {}

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append tokens and index the n-grams ending at each."""
        for token_id in token_ids:
            self.tokens.append(token_id)
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
        for key_len in range(min(self.max_key, len(context)), self.min_key - 1, -1):
            key = tuple(context[len(context) - key_len :])
            found = self._continuations(self._index.get(key, ()), max_len)
            if found:
                return found[:max_candidates]
        return []

    def _continuations(self, positions: Sequence[int], max_len: int) -> list[Continuation]:
        recent = [p for p in reversed(positions) if p < len(self.tokens)][: self.max_occurrences]
        counts = Counter(tuple(self.tokens[p : p + max_len]) for p in recent)
        # Counter keeps first-seen order (most recent first); sorted() is stable on ties.
        ranked = sorted(counts.items(), key=lambda item: -item[1])
        return [Continuation(tokens, float(count)) for tokens, count in ranked]
