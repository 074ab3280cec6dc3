"""Per-request drafting state: tokens, segment tracking, own-history index, online learning.

In: incremental token updates (the DraftQuery contract: new tokens + the expected
total). Out: the request's state, or None when the drafter must ask for a resync.
When appended tokens close a segment whose end token was generated (not part of
the prompt), the segment's tokens, markers included, go to `on_segment_closed`,
which adds them to that kind's corpus. A resync rebuilds state without learning.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from drafter.history import HistorySource
from drafter.segments import SegmentsConfig
from drafter.tracker import SegmentTracker

SegmentSink = Callable[[str, Sequence[int]], None]


@dataclass
class RequestState:
    """What the drafter knows about one request."""

    request_id: str
    num_prompt_tokens: int
    tracker: SegmentTracker
    history: HistorySource

    @property
    def tokens(self) -> list[int]:
        """Prompt + output so far (owned by the history index)."""
        return self.history.tokens

    @property
    def segment(self) -> str:
        return self.tracker.current

    def extend(self, token_ids: Sequence[int]) -> list[tuple[str, list[int]]]:
        """Append tokens; returns (segment name, tokens) of generated segments they closed."""
        self.history.extend(token_ids)
        learned = []
        for closed in self.tracker.append(token_ids):
            if closed.end > self.num_prompt_tokens:  # its end token was generated
                learned.append((closed.name, self.tokens[closed.start : closed.end]))
        return learned


class RequestStates:
    """A bounded map request id -> RequestState; the least recently used is evicted first."""

    def __init__(
        self,
        segments: SegmentsConfig,
        on_segment_closed: SegmentSink,
        max_requests: int = 4096,
        history_factory: Callable[[], HistorySource] = HistorySource,
    ):
        if max_requests <= 0:
            raise ValueError("max_requests must be > 0")
        self._segments = segments
        self._on_segment_closed = on_segment_closed
        self._max_requests = max_requests
        self._history_factory = history_factory
        self._states: OrderedDict[str, RequestState] = OrderedDict()

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def count_by_segment(self) -> Counter[str]:
        """Tracked requests per current segment kind."""
        return Counter(state.segment for state in self._states.values())

    def update(
        self, request_id: str, new_token_ids: Sequence[int], num_tokens: int, num_prompt_tokens: int
    ) -> RequestState | None:
        """Apply one query's update; None = state lost or inconsistent (the caller answers needs_resync).

        Known request and len(tokens) + len(new) == num_tokens: an append (may learn).
        Otherwise, new tokens that are the whole sequence (len(new) == num_tokens)
        replace the state. Anything else drops the state and asks for a resync.
        """
        state = self._states.get(request_id)
        if state is not None and len(state.tokens) + len(new_token_ids) == num_tokens:
            self._states.move_to_end(request_id)
            for name, tokens in state.extend(new_token_ids):
                self._on_segment_closed(name, tokens)
            return state
        self._states.pop(request_id, None)
        if len(new_token_ids) != num_tokens or num_tokens == 0:
            return None
        return self._create(request_id, new_token_ids, num_prompt_tokens)

    def drop(self, request_id: str) -> None:
        """Forget a finished request (unknown ids are fine)."""
        self._states.pop(request_id, None)

    def _create(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> RequestState:
        state = RequestState(
            request_id=request_id,
            num_prompt_tokens=num_prompt_tokens,
            tracker=SegmentTracker(self._segments.kinds),
            history=self._history_factory(),
        )
        state.extend(token_ids)  # a (re)sync never learns: those segments may be learned already
        self._states[request_id] = state
        while len(self._states) > self._max_requests:
            self._states.popitem(last=False)
        return state
