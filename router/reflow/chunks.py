"""The chunk, the unit of data reflow, and how requests become chunks and sessions.

In: a request body (bytes) or a streamed delta, plus the request's tags. Out:
`Chunk`s of bounded size, serialized as compact JSON bytes for the queue.

A request is recorded in two directions, each its own sequence numbered from 0:
the request body split into pieces of at most `max_chunk_bytes` bytes, and the
response as one chunk per delta, each naming its choice (of n, and of each of a
completion's prompts). The response's last chunk carries the finish state (its
`finish` is set on it alone), the usage, how many request chunks there were and
how many chunks of the request the recorder dropped under pressure, so the
consumer knows a record is whole even when a bound was hit:
request chunks + response chunks present + dropped == request chunks + last seq + 1.

Session ids (`session_id_for`), first match wins:
1. the X-Session-Id header;
2. body `metadata.session_id`, then body `user`;
3. derived. Every turn of a chat repeats the turns before it, so what all turns
   of one conversation share is its opening: the messages up to and including the
   first user message. The session is a hash of (client id, model, opening). A
   follow-up that resends the history lands in the same session; conversations
   that differ anywhere in their opening do not mix. Two conversations that open
   identically (same client, model, system prompt and first message) cannot be
   told apart from content; clients that need them apart send X-Session-Id. A
   completion prompt has no turns: its opening is the whole prompt.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from enum import Enum
from typing import Any, Mapping


_REQUIRED = frozenset({"request_id", "direction", "seq", "client_id", "service_id", "session_id", "timestamp"})
_EMPTY = (None, (), {}, "", 0)  # optional fields at these values stay off the wire


class Direction(str, Enum):
    REQUEST = "request"
    RESPONSE = "response"


class FinishState(str, Enum):
    COMPLETE = "complete"
    CANCELLED = "cancelled"
    """The client went away before the end."""
    ERROR = "error"
    DEADLINE = "deadline"
    REJECTED = "rejected"
    """Refused before generation (bad input, overload)."""
    INCOMPLETE = "incomplete"
    """Set by the consumer, never the router: no final chunk came (router crashed mid-stream)."""


@dataclass(frozen=True)
class Chunk:
    request_id: str
    direction: Direction
    seq: int
    """Position within its direction, from 0; (request_id, direction, seq) identifies a chunk."""
    client_id: str
    service_id: str
    """The model the request named."""
    session_id: str
    timestamp: float
    """Unix seconds when the router produced the chunk."""
    text: str = ""
    """A piece of the request body, or one response delta."""
    token_ids: tuple[int, ...] = ()
    choice: int = 0
    """A response delta's choice index (the OpenAI response's `index`)."""
    finish: FinishState | None = None
    """Set on the response's last chunk, and there alone."""
    usage: Mapping[str, int] | None = None
    """Response's last chunk only: prompt_tokens, completion_tokens..."""
    num_request_chunks: int = 0
    """Response's last chunk only: how many chunks the request body was split into."""
    num_dropped: int = 0
    """Response's last chunk only: chunks of this request dropped at the recorder."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Response's last chunk only: the error message and the like."""

    @property
    def key(self) -> tuple[str, str, int]:
        return self.request_id, self.direction.value, self.seq

    def to_bytes(self) -> bytes:
        # The fields by name, shallow (a streamed delta's chunk is made once per token: dataclasses.asdict's deep
        # copy cost more than the JSON); the values are JSON's types, so the bytes are those of asdict's copy.
        fields = {}
        for name in _FIELD_NAMES:
            value = getattr(self, name)
            if name in _REQUIRED or value not in _EMPTY:
                fields[name] = value
        fields["direction"] = self.direction.value
        if self.finish is not None:
            fields["finish"] = self.finish.value
        return json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Chunk:
        fields = json.loads(data)
        fields["direction"] = Direction(fields["direction"])
        if "finish" in fields:
            fields["finish"] = FinishState(fields["finish"])
        fields["token_ids"] = tuple(fields.get("token_ids", ()))
        return cls(**fields)


_FIELD_NAMES = tuple(f.name for f in dataclass_fields(Chunk))


def split_utf8(data: bytes, max_bytes: int) -> list[str]:
    """Pieces of at most max_bytes bytes each, cut on character boundaries (invalid bytes replaced)."""
    text = data.decode("utf-8", errors="replace")
    data = text.encode()
    pieces, start = [], 0
    while start < len(data):
        end = min(start + max_bytes, len(data))
        while end < len(data) and (data[end] & 0xC0) == 0x80:  # never cut inside a character
            end -= 1
        pieces.append(data[start:end].decode())
        start = end
    return pieces or [""]


def conversation_opening(body: Mapping[str, Any]) -> Any:
    """What every turn of a conversation repeats: messages up to the first user message, or the prompt."""
    messages = body.get("messages") or body.get("input")
    if isinstance(messages, list):
        for index, message in enumerate(messages):
            if isinstance(message, Mapping) and message.get("role") == "user":
                return messages[: index + 1]
        return messages
    return body.get("prompt", messages)


def session_id_for(client_id: str, service_id: str, body: Mapping[str, Any] | None,
                   headers: Mapping[str, str] | None = None) -> str:
    """The session a request belongs to (rules in the module docstring)."""
    if headers:
        explicit = headers.get("x-session-id") or headers.get("X-Session-Id")
        if explicit:
            return explicit
    body = body if isinstance(body, Mapping) else {}
    metadata = body.get("metadata")
    if isinstance(metadata, Mapping) and isinstance(metadata.get("session_id"), str) and metadata["session_id"]:
        return metadata["session_id"]
    if isinstance(body.get("user"), str) and body["user"]:
        return body["user"]
    opening = json.dumps([client_id, service_id, conversation_opening(body)], sort_keys=True, ensure_ascii=False)
    return "s-" + hashlib.sha256(opening.encode()).hexdigest()[:32]
