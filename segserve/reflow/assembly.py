"""Reassembly: chunks in (any order, any number of times), whole request records out.

Pure bookkeeping, no I/O, so it is tested without a queue. Chunks are keyed by
(request id, direction, seq): a chunk delivered twice is held once, and every
delivery id is kept so all copies are acknowledged after the record is written.

A record is ready when the response's final chunk has come and every chunk is
accounted for (present, or counted as dropped by the recorder). One that has
seen no new chunk for `incomplete_after_s` is written as it is: finish
"incomplete" when the final chunk never came (the router died mid-stream).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from router.reflow.chunks import Chunk, Direction, FinishState


@dataclass
class _Pending:
    chunks: dict[tuple[str, int], Chunk] = field(default_factory=dict)
    delivery_ids: set[str] = field(default_factory=set)
    last_seen: float = 0.0
    final: Chunk | None = None

    def is_whole(self) -> bool:
        if self.final is None:
            return False
        expected = self.final.num_request_chunks + self.final.seq + 1
        return len(self.chunks) + self.final.num_dropped >= expected


class Assembler:
    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self.num_held_deliveries = 0
        self.num_duplicates = 0

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, chunk: Chunk, delivery_id: str, now: float) -> None:
        pending = self._pending.setdefault(chunk.request_id, _Pending())
        if delivery_id not in pending.delivery_ids:
            pending.delivery_ids.add(delivery_id)
            self.num_held_deliveries += 1
        key = (chunk.direction.value, chunk.seq)
        if key in pending.chunks:
            self.num_duplicates += 1
            return
        pending.chunks[key] = chunk
        pending.last_seen = now
        if chunk.finish is not None:
            pending.final = chunk

    def ready(self, now: float, incomplete_after_s: float, is_flush_all: bool = False) -> list[tuple[dict, list[str]]]:
        """(record, delivery ids) of every record to write now; `remove` them once written."""
        return [(build_record(request_id, p), sorted(p.delivery_ids)) for request_id, p in self._pending.items()
                if is_flush_all or p.is_whole() or now - p.last_seen >= incomplete_after_s]

    def remove(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.num_held_deliveries -= len(self._pending.pop(request_id).delivery_ids)


def build_record(request_id: str, pending: _Pending) -> dict[str, Any]:
    """One request and its response, as the sink stores it (one turn of a session's log): choice 0's text and
    token ids, and those of any other choices (n > 1, or a completion's several prompts) in `other_choices`."""
    ordered = sorted(pending.chunks.values(), key=lambda c: (c.direction != Direction.REQUEST, c.seq))
    first, final = ordered[0], pending.final
    request_text = "".join(c.text for c in ordered if c.direction == Direction.REQUEST)
    deltas = [c for c in ordered if c.direction == Direction.RESPONSE]
    by_choice: dict[int, list[Chunk]] = {}
    for chunk in deltas:
        by_choice.setdefault(chunk.choice, []).append(chunk)
    first_choice = by_choice.pop(0, [])
    try:
        request = json.loads(request_text)
    except ValueError:  # a body that was not JSON, or one whose chunks were dropped
        request = {"raw": request_text}
    num_expected = final.num_request_chunks + final.seq + 1 if final else len(ordered)
    return {
        "request_id": request_id,
        "session_id": first.session_id,
        "client_id": first.client_id,
        "service_id": first.service_id,
        "started_at": min(c.timestamp for c in ordered),
        "finished_at": max(c.timestamp for c in ordered),
        "finish": (final.finish if final else FinishState.INCOMPLETE).value,
        "request": request,
        "response_text": "".join(c.text for c in first_choice),
        "response_token_ids": [t for c in first_choice for t in c.token_ids],
        "other_choices": [{"index": index, "text": "".join(c.text for c in chunks),
                           "token_ids": [t for c in chunks for t in c.token_ids]}
                          for index, chunks in sorted(by_choice.items())],
        "usage": dict(final.usage) if final and final.usage else {},
        "error": final.extra.get("error", "") if final else "",
        "num_chunks": len(ordered),
        "num_missing_chunks": max(0, num_expected - len(ordered)),
    }
