"""HistorySource: the request's own prompt and output as a continuation source (prompt lookup).

In: the request's tokens, appended incrementally. Out: continuations that followed
earlier occurrences of the context's longest matching suffix (min_key..max_key
tokens), identical ones merged and counted, ranked by count then recency.

Storage: the tokens in one flat int64 array (grown by doubling), after max_key padding
slots that match no token. Appending costs a copy into it, nothing per n-gram.
A query finds where the context's last token occurs (one vectorized compare over the
array), then keeps, one step back at a time, the occurrences whose previous token
matches the context's too, while any do: the survivors of the last step are the longest
key's occurrences (at most max_key steps, each over the survivors only).

Memory bound: the array holds at most `max_bytes`; when a request's tokens pass it, the
older half of the searched tokens goes (a match never reaches before what is kept), so
the most recent half to whole budget stays searchable. The token list itself is the
request's sequence (bounded by the model's context); a match found in the array reads
its continuation there, and a full-key match is followed back along it (MAX_MATCH).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import numpy as np

from drafter.types import Continuation

ITEM_BYTES = 8
"""Bytes per searched token (int64: a uint32 token id and the padding's -1 both fit)."""
DEFAULT_MAX_BYTES = 64 << 20
MAX_MATCH = 64
"""Longest match a continuation reports: a max_key match is followed back this far along the history."""
_PAD = -1
_INITIAL_SLOTS = 256


class HistorySource:
    """Prompt-lookup over one request's tokens, implementing ContinuationSource."""

    def __init__(self, max_key: int = 8, min_key: int = 2, max_occurrences: int = 16,
                 max_bytes: int = DEFAULT_MAX_BYTES, is_indexed: bool = True):
        if not 1 <= min_key <= max_key or max_occurrences <= 0:
            raise ValueError("history needs 1 <= min_key <= max_key and max_occurrences > 0")
        if max_bytes < ITEM_BYTES * (max_key + 2):
            raise ValueError(f"history max_bytes must hold at least max_key + 2 tokens ({ITEM_BYTES} bytes each)")
        self.max_key = max_key
        self.min_key = min_key
        self.max_occurrences = max_occurrences
        self.max_bytes = max_bytes
        self.tokens: list[int] = []
        self._window = max_bytes // ITEM_BYTES - max_key
        """Most tokens the array holds after its padding."""
        self._array = np.full(max_key, _PAD, dtype=np.int64) if is_indexed else None
        """The searched tokens after max_key padding; None when not is_indexed (a state about to be dropped keeps
        its tokens only)."""
        self._used = max_key
        """Slots of the array in use, the padding's included."""
        self._first = 0
        """Index in `tokens` of the array's first token (the slot after the padding)."""

    @property
    def num_bytes(self) -> int:
        """Memory of the search array (at most max_bytes)."""
        return self._array.nbytes if self._array is not None else 0

    def extend(self, token_ids: Iterable[int]) -> None:
        """Append tokens (and copy them into the search array)."""
        token_ids = list(token_ids)
        self.tokens.extend(token_ids)
        if self._array is None or not token_ids:
            return
        end = self._used + len(token_ids)
        if end <= len(self._array):
            self._array[self._used:end] = token_ids
            self._used = end
            return
        num_held = end - self.max_key
        if num_held > self._window:  # the most recent half of the window stays (all of it, if this extend is more)
            num_held = max(self._window // 2, min(len(token_ids), self._window))
        self._array = np.full(self.max_key + min(self._window, max(2 * num_held, _INITIAL_SLOTS)), _PAD,
                              dtype=np.int64)
        self._first = len(self.tokens) - num_held
        self._array[self.max_key:self.max_key + num_held] = self.tokens[self._first:]
        self._used = self.max_key + num_held

    def propose(self, context: Sequence[int], max_len: int, max_candidates: int) -> list[Continuation]:
        """Continuations of the longest suffix of `context` (min_key..max_key tokens) seen earlier in the history."""
        longest = min(self.max_key, len(context))
        if max_len <= 0 or max_candidates <= 0 or longest < self.min_key or self._array is None:
            return []
        searched = self._array[:self._used]
        # Slots right after an occurrence of the last token, that a token follows (the padding matches nothing).
        ends = np.flatnonzero(searched[:-1] == context[-1]) + 1
        key_len = 1
        while len(ends) and key_len < longest:
            longer = ends[searched[ends - key_len - 1] == context[-key_len - 1]]
            if not len(longer):
                break
            ends, key_len = longer, key_len + 1
        if not len(ends) or key_len < self.min_key:
            return []
        recent = (ends[: -self.max_occurrences - 1 : -1] + (self._first - self.max_key)).tolist()
        return self._continuations(recent, max_len, context, key_len)[:max_candidates]

    def _continuations(self, recent: list[int], max_len: int, context: Sequence[int],
                       key_len: int) -> list[Continuation]:  # fmt: skip
        """What followed the key's occurrences (where continuations start in `tokens`, most recent first), merged
        and counted; each with the longest match among its occurrences (past key_len when the key is max_key
        long)."""
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
