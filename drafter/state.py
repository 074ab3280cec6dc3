"""Per-request drafting state: tokens, segment tracking, own-history index, online learning.

In: incremental token updates (the DraftQuery contract: new tokens + the expected
total). Out: the request's state, or None when the drafter must ask for a resync.
When appended tokens close a segment whose end token was generated (not part of
the prompt), the segment's tokens, markers included, go to `on_segment_closed`,
which adds them to that kind's corpus. A state built from the whole sequence
(a first query, a resync) learns the segments that close after the tokens a
drafter already received (num_known_tokens), so a resync never learns twice
and a request first seen at its end is still learned. Generated text outside
every segment is learned too, into the default kind, a run at a time: a run ends
where a marker opens a segment, or with the request. A segment still open when the
request ends (cut by max_tokens, or opened by the prompt and never closed) is learned
as if it closed there. A final update learns and
drops the state; one for a request never seen indexes no history.
Each state keeps its request's tenant, and the sink gets it with every closed
segment. A state with a corpus key (drafter/keyed.py) tracks no markers: its whole
output is one segment of the schema kind, which goes to the sink (with the key)
when the request's final update comes.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from drafter.history import HistorySource
from drafter.keyed import kept_key
from drafter.segments import DEFAULT_SEGMENT, SCHEMA_SEGMENT, SegmentsConfig
from drafter.tracker import SegmentTracker
from drafter.trees import TrieNode

SegmentSink = Callable[..., None]
"""sink(segment kind, tokens, tenant) of every closed segment ("" = the default tenant); a keyed request's output
comes as sink("schema", output, tenant, corpus_key=key)."""


@dataclass
class RequestState:
    """What the drafter knows about one request."""

    request_id: str
    num_prompt_tokens: int
    tracker: SegmentTracker
    history: HistorySource
    tenant: str = ""
    """Whose request: its segments are learned for this tenant, its trees drawn from this tenant's corpora."""
    corpus_key: str = ""
    """Non-empty: the whole output is one segment of the schema kind, drafted from and learned into this key's
    corpora (drafter/keyed.py); markers in it open nothing."""
    outside: list[int] = field(default_factory=list)
    """Generated tokens outside every segment since the last marker: a run of the default kind, learned when a
    segment opens or the request ends, as segments are when they close."""
    proposals: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """The last draft's best continuation per source (drafter/planner.py judges them against what came next)."""
    proposed_at: int = 0
    """len(tokens) when they were proposed."""
    proposed_kind: str = ""
    """The segment kind they were proposed in."""
    trie: TrieNode | None = None
    """The last draft's merged trie, whole (drafter/calibration.py judges its nodes against what came next)."""

    @property
    def tokens(self) -> list[int]:
        """Prompt + output so far (owned by the history index)."""
        return self.history.tokens

    @property
    def segment(self) -> str:
        return SCHEMA_SEGMENT if self.corpus_key else self.tracker.current

    def extend(self, token_ids: Sequence[int], num_known_tokens: int = 0) -> list[tuple[str, list[int]]]:
        """Append tokens; returns (segment name, tokens) of what they closed past num_known_tokens: generated
        segments, and generated runs outside every segment that a marker ended (DEFAULT_SEGMENT)."""
        position = len(self.tokens)
        self.history.extend(token_ids)
        if self.corpus_key:
            return []  # its one segment closes with the request (RequestStates.finish)
        first_new = max(self.num_prompt_tokens, num_known_tokens)
        learned = []
        known = min(len(token_ids), max(0, first_new - position))
        if known and not self.outside:  # prompt (or known) tokens: nothing of them is learned, so in one go
            self.tracker.append(token_ids[:known])
            token_ids, position = token_ids[known:], position + known
        if self.tracker.ends_no_marker(token_ids):  # the usual step: no segment opens or closes, in one go
            if self.tracker.current == DEFAULT_SEGMENT:
                self.outside.extend(token_ids[max(0, first_new - position):])
            self.tracker.append(token_ids)
            return learned
        for token_id in token_ids:
            was_outside = self.tracker.current == DEFAULT_SEGMENT
            for closed in self.tracker.append((token_id,)):
                if closed.end > first_new:  # its end token was generated, and new
                    learned.append((closed.name, self.tokens[closed.start : closed.end]))
            if self.tracker.current != DEFAULT_SEGMENT:
                learned += self.end_outside()
            elif was_outside and position >= first_new:
                self.outside.append(token_id)
            position += 1
        return learned

    def end_open(self) -> list[tuple[str, list[int]]]:
        """The request ended: each segment still open (cut by max_tokens, say) as a learned piece of its kind, from
        its start marker to the end, as if it closed there; none whose generated part is under two tokens."""
        return [(name, self.tokens[start:]) for name, start in self.tracker.open_segments
                if len(self.tokens) - max(start, self.num_prompt_tokens) >= 2]

    def end_outside(self) -> list[tuple[str, list[int]]]:
        """The run of generated tokens outside every segment, as a learned piece of the default kind (none when
        shorter than two tokens, which no lookup can use); the run starts over."""
        run, self.outside = self.outside, []
        return [(DEFAULT_SEGMENT, run)] if len(run) >= 2 else []


class RequestStates:
    """A map request id -> RequestState bounded in requests and in the bytes of their history indexes;
    the least recently used is evicted first."""

    def __init__(
        self,
        segments: SegmentsConfig,
        on_segment_closed: SegmentSink,
        max_requests: int = 4096,
        history_factory: Callable[[], HistorySource] = HistorySource,
        max_history_bytes: int = 2 << 30,
    ):
        if max_requests <= 0 or max_history_bytes <= 0:
            raise ValueError("max_requests and max_history_bytes must be > 0")
        self._segments = segments
        self._on_segment_closed = on_segment_closed
        self._max_requests = max_requests
        self._max_history_bytes = max_history_bytes
        self._history_factory = history_factory
        self._states: OrderedDict[str, RequestState] = OrderedDict()
        self.num_history_bytes = 0
        """Estimated memory of every tracked request's history index."""

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def count_by_segment(self) -> Counter[str]:
        """Tracked requests per current segment kind."""
        return Counter(state.segment for state in self._states.values())

    def update(
        self, request_id: str, new_token_ids: Sequence[int], num_tokens: int, num_prompt_tokens: int,
        num_known_tokens: int = 0, tenant: str = "", corpus_key: str = "",
    ) -> RequestState | None:
        """Apply one query's update; None = state lost or inconsistent (the caller answers needs_resync).

        Known request and len(tokens) + len(new) == num_tokens: an append (may learn).
        Otherwise, new tokens that are the whole sequence (len(new) == num_tokens)
        replace the state, learning what closes past num_known_tokens. Anything
        else drops the state and asks for a resync.
        """
        state = self._states.get(request_id)
        if state is not None and len(state.tokens) + len(new_token_ids) == num_tokens:
            self._states.move_to_end(request_id)
            num_bytes = state.history.num_bytes
            self._learn(state, state.extend(new_token_ids))
            self.num_history_bytes += state.history.num_bytes - num_bytes
            self._bound()
            return state if request_id in self._states else None
        self.drop(request_id)
        if len(new_token_ids) != num_tokens or num_tokens == 0:
            return None
        return self._create(request_id, new_token_ids, num_prompt_tokens, num_known_tokens, tenant, corpus_key)

    def finish(self, request_id: str, new_token_ids: Sequence[int], num_tokens: int, num_prompt_tokens: int,
               num_known_tokens: int = 0, tenant: str = "", corpus_key: str = "") -> RequestState | None:
        """A request's final update: learn the segments it closes (a keyed request: its whole output), then drop
        its state and return it. None = the tokens neither extend the state nor are the whole sequence (nothing
        learned; the caller answers needs_resync)."""
        state = self._states.get(request_id)
        self.drop(request_id)
        if state is not None and len(state.tokens) + len(new_token_ids) == num_tokens:
            self._learn(state, state.extend(new_token_ids))
            self._learn_output(state)
            return state
        if len(new_token_ids) != num_tokens or num_tokens == 0:
            return None
        # Only the segments matter now: no history index is built for a state dropped at once.
        state = self._new_state(request_id, num_prompt_tokens, HistorySource(is_indexed=False), tenant, corpus_key)
        self._learn(state, state.extend(new_token_ids, num_known_tokens))
        self._learn_output(state)
        return state

    def drop(self, request_id: str) -> None:
        """Forget a finished request (unknown ids are fine)."""
        state = self._states.pop(request_id, None)
        if state is not None:
            self.num_history_bytes -= state.history.num_bytes

    def _bound(self) -> None:
        """Drop the least recently used states while over either bound (the newest one is kept)."""
        while len(self._states) > 1 and (len(self._states) > self._max_requests
                                         or self.num_history_bytes > self._max_history_bytes):
            self.drop(next(iter(self._states)))

    def _learn(self, state: RequestState, closed: list[tuple[str, list[int]]]) -> None:
        for name, tokens in closed:
            self._on_segment_closed(name, tokens, state.tenant)

    def _learn_output(self, state: RequestState) -> None:
        """A request ended: its last run outside every segment and each segment still open go to the sink; a keyed
        request's output, the schema kind's one segment, with the key."""
        self._learn(state, state.end_outside())
        if not state.corpus_key:
            self._learn(state, state.end_open())
        output = state.tokens[state.num_prompt_tokens:]
        if state.corpus_key and output:
            self._on_segment_closed(SCHEMA_SEGMENT, output, state.tenant, corpus_key=state.corpus_key)

    def _new_state(self, request_id: str, num_prompt_tokens: int, history: HistorySource,
                   tenant: str = "", corpus_key: str = "") -> RequestState:
        return RequestState(request_id, num_prompt_tokens, SegmentTracker(self._segments.kinds), history, tenant,
                            kept_key(corpus_key))

    def _create(self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                num_known_tokens: int, tenant: str = "", corpus_key: str = "") -> RequestState:
        state = self._new_state(request_id, num_prompt_tokens, self._history_factory(), tenant, corpus_key)
        self._learn(state, state.extend(token_ids, num_known_tokens))
        self._states[request_id] = state
        self.num_history_bytes += state.history.num_bytes
        self._bound()
        return state


def split_segments(token_ids: Sequence[int], segments: SegmentsConfig) -> list[tuple[str, list[int]]]:
    """(segment kind, tokens) of what a request whose every token was generated teaches, in order: its closed
    segments, its runs outside every segment (of two tokens or more) and each segment still open at its end. The
    online rule (RequestState), applied offline (`segserve corpus build`)."""
    state = RequestState("", 0, SegmentTracker(segments.kinds), HistorySource(is_indexed=False))
    return [*state.extend(token_ids), *state.end_outside(), *state.end_open()]
