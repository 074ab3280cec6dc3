"""SegmentTracker: which segment a token stream is in, updated one appended token at a time.

In: appended token ids. Out: the current segment name and the segments that
closed. The current segment is the most recently opened one not yet closed
(segments nest, e.g. a code fence inside a model turn). Rules, per token:

1. Close first: if an end marker ends at this token and belongs to an open
   segment (searched innermost first) whose start marker it does not overlap,
   that segment closes, and any segment opened inside it is dropped unclosed.
   A token that closes never also opens (so "```" both opens and closes code).
2. Else open: the longest start marker ending here (and not overlapping the last
   close) opens its segment. If it merely extends the marker that opened the
   innermost segment (```` ``` ```` then ``json``), it replaces that segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from drafter.segments import DEFAULT_SEGMENT, SegmentKind

MAX_NESTING = 16  # deeper opens drop the outermost segment (malformed streams stay bounded)


@dataclass(frozen=True)
class ClosedSegment:
    """A segment that closed: its tokens are positions [start, end) of the stream."""

    name: str
    start: int
    end: int


@dataclass
class _Open:
    kind: SegmentKind
    start: int  # position of the first token of its start marker
    marker_end: int  # position of the last token of its start marker


class SegmentTracker:
    """Incremental segment state over a growing token stream."""

    def __init__(self, kinds: Sequence[SegmentKind]):
        self._kinds = [k for k in kinds if k.start]
        self._window = max((max(len(k.start), len(k.end)) for k in self._kinds), default=1)
        self._last_tokens = {marker[-1] for k in self._kinds for marker in (k.start, k.end) if marker}
        """Tokens some marker ends with: at any other token nothing opens or closes."""
        self._tail: list[int] = []  # the last `_window` tokens
        self._stack: list[_Open] = []
        self._last_close = -1
        self.num_tokens = 0

    @property
    def current(self) -> str:
        """Name of the current segment (the default segment outside every marker)."""
        return self._stack[-1].kind.name if self._stack else DEFAULT_SEGMENT

    @property
    def open_segments(self) -> list[tuple[str, int]]:
        """(name, stream position where its start marker begins) of every open segment, outermost first."""
        return [(entry.kind.name, entry.start) for entry in self._stack]

    @property
    def current_start(self) -> int | None:
        """Stream position where the current segment's start marker begins (None for the default)."""
        return self._stack[-1].start if self._stack else None

    def append(self, token_ids: Iterable[int]) -> list[ClosedSegment]:
        """Feed appended tokens; returns the segments they closed, in order. Only tokens that end some marker
        are looked at (a prompt of thousands of tokens passes in a set lookup per token)."""
        closed: list[ClosedSegment] = []
        stream = self._tail + list(token_ids)
        start, first = len(self._tail), self.num_tokens - len(self._tail)
        for i in range(start, len(stream)):
            if stream[i] in self._last_tokens:
                self._tail = stream[max(0, i + 1 - self._window) : i + 1]
                self.num_tokens = first + i
                segment = self._close()
                if segment is not None:
                    closed.append(segment)
                else:
                    self._open()
        self._tail = stream[-self._window :]
        self.num_tokens = first + len(stream)
        return closed

    def ends_no_marker(self, token_ids: Sequence[int]) -> bool:
        """None of token_ids ends a marker: appending them opens and closes nothing."""
        return self._last_tokens.isdisjoint(token_ids)

    def _ends_here(self, marker: tuple[int, ...]) -> bool:
        n = len(marker)
        return n <= len(self._tail) and tuple(self._tail[-n:]) == marker

    def _close(self) -> ClosedSegment | None:
        pos = self.num_tokens
        for depth in range(len(self._stack) - 1, -1, -1):
            entry = self._stack[depth]
            end = entry.kind.end
            if self._ends_here(end) and pos - len(end) + 1 > entry.marker_end:
                del self._stack[depth:]
                self._last_close = pos
                return ClosedSegment(entry.kind.name, entry.start, pos + 1)
        return None

    def _open(self) -> None:
        pos = self.num_tokens
        matches = [k for k in self._kinds if self._ends_here(k.start) and pos - len(k.start) + 1 > self._last_close]
        if not matches:
            return
        kind = max(matches, key=lambda k: len(k.start))
        start = pos - len(kind.start) + 1
        if self._stack and self._stack[-1].start == start:
            self._stack.pop()  # a longer marker with the same beginning refines the segment
        self._stack.append(_Open(kind, start, pos))
        if len(self._stack) > MAX_NESTING:
            del self._stack[0]
