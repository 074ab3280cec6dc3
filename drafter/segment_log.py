"""The shared log of learned segments: every drafter replica appends what it learns and reads what the others did.

A record is one closed segment: its kind, its tokens, the origin (the process that learned
it), its tenant and, for a keyed request's output, its corpus key. A cursor says how far a
reader has read; it is plain JSON data, so a snapshot can keep it and a restarted replica
replays the log from there.

Two backends with one interface:
- `RedisSegmentLog`: a Redis Stream (XADD / XRANGE), trimmed to about `max_len` records; the
  cursor is the last stream id read. Replicas on several machines share it.
- `DirectorySegmentLog`: one append-only file per origin in a shared directory. A record is
  written with a single write() of a length-prefixed frame, so a reader never consumes a half
  written one (it stops at an incomplete frame and reads it next time); the cursor maps each file
  to the offset read so far. Replicas on one machine (or one shared volume) share it.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

Cursor = Any
"""Where a reader stands: JSON data (a stream id, or file name -> offset)."""


@dataclass(frozen=True)
class LearnedSegment:
    """One closed segment learned by one replica."""

    origin: str
    segment: str
    token_ids: tuple[int, ...]
    tenant: str = ""
    """Whose request closed it: a replica learns it into that tenant's corpus ("" = the shared one)."""
    corpus_key: str = ""
    """A keyed request's output (segment "schema"): learned into this key's corpus (drafter/keyed.py)."""


class SegmentLog(Protocol):
    def append(self, record: LearnedSegment) -> None:
        """Publish a record (raises on failure: the caller keeps its own copy)."""

    def read(self, cursor: Cursor, max_records: int) -> tuple[list[LearnedSegment], Cursor]:
        """Up to max_records records after `cursor` (None = from the start), and the cursor after them."""

    def close(self) -> None: ...


def _tokens_bytes(token_ids: tuple[int, ...]) -> bytes:
    return np.asarray(token_ids, dtype="<i4").tobytes()


def _tokens_from(data: bytes) -> tuple[int, ...]:
    return tuple(np.frombuffer(data, dtype="<i4").tolist())


class RedisSegmentLog:
    """A Redis Stream of records: fields o (origin), s (segment), t (int32 little-endian tokens), n (tenant, when
    not the default), k (corpus key, when set)."""

    def __init__(self, url: str, stream: str = "segserve:drafter:segments", max_len: int = 100_000):
        import redis

        self._client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.stream = stream
        self.max_len = max_len

    def append(self, record: LearnedSegment) -> None:
        fields = {"o": record.origin, "s": record.segment, "t": _tokens_bytes(record.token_ids)}
        if record.tenant:
            fields["n"] = record.tenant
        if record.corpus_key:
            fields["k"] = record.corpus_key
        self._client.xadd(self.stream, fields, maxlen=self.max_len, approximate=True)

    def read(self, cursor: Cursor, max_records: int) -> tuple[list[LearnedSegment], Cursor]:
        start = "-" if cursor is None else f"({cursor}"  # exclusive of the last id read
        entries = self._client.xrange(self.stream, min=start, max="+", count=max_records)
        records = [LearnedSegment(f[b"o"].decode(), f[b"s"].decode(), _tokens_from(f[b"t"]), f.get(b"n", b"").decode(),
                                  f.get(b"k", b"").decode()) for _, f in entries]
        return records, (entries[-1][0].decode() if entries else cursor)

    def close(self) -> None:
        self._client.close()


_HEADER = struct.Struct("<II")  # frame length (after the header), origin+segment text length
LOG_SUFFIX = ".seglog"


class DirectorySegmentLog:
    """One append-only file per origin under `directory`; readers read every file."""

    def __init__(self, directory: str | Path, origin: str):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._path = self.directory / f"{origin}{LOG_SUFFIX}"
        self._fd: int | None = None

    def append(self, record: LearnedSegment) -> None:
        text = "\n".join([record.origin, record.segment, *_scope_lines(record)]).encode()
        body = text + _tokens_bytes(record.token_ids)
        if self._fd is None:
            self._fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(self._fd, _HEADER.pack(len(body), len(text)) + body)  # one write: readers see all of it or none

    def read(self, cursor: Cursor, max_records: int) -> tuple[list[LearnedSegment], Cursor]:
        offsets = dict(cursor or {})
        records: list[LearnedSegment] = []
        for path in sorted(self.directory.glob(f"*{LOG_SUFFIX}")):
            if len(records) >= max_records:
                break
            offset = offsets.get(path.name, 0)
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            offsets[path.name] = offset + _parse_frames(data, records, max_records)
        return records, offsets

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _scope_lines(record: LearnedSegment) -> list[str]:
    """The text lines after origin and segment: the tenant when set, and the corpus key (after the tenant, even
    an empty one) when set."""
    if record.corpus_key:
        return [record.tenant, record.corpus_key]
    return [record.tenant] if record.tenant else []


def _parse_frames(data: bytes, out: list[LearnedSegment], max_records: int) -> int:
    """Append the complete frames at the start of `data` to `out` (up to max_records in all); bytes consumed."""
    position = 0
    while len(out) < max_records and position + _HEADER.size <= len(data):
        body_len, text_len = _HEADER.unpack_from(data, position)
        end = position + _HEADER.size + body_len
        if end > len(data):
            break  # still being written
        body = data[position + _HEADER.size:end]
        origin, segment, *scope = body[:text_len].decode().split("\n", 3)  # then the tenant, then the corpus key
        out.append(LearnedSegment(origin, segment, _tokens_from(body[text_len:]), *scope))
        position = end
    return position
