"""The buffer queue between the router's recorder and the consumer, behind one interface.

In: serialized chunks (bytes) from the recorder's writer thread. Out: deliveries
to the consumer, at least once: a claimed delivery that is not acknowledged within
the visibility timeout is delivered again, so a consumer that crashes mid-batch
loses nothing (and the consumer dedupes what comes twice).

Backends, chosen by URL (`open_queue`):
- sqlite:///PATH  the embedded default: one SQLite file in WAL mode, no service.
  A claim stamps rows with the time they become visible again; ack deletes them.
  synchronous=NORMAL: a committed put survives a killed process (WAL), not a
  power cut in the last moment.
- redis://HOST:PORT/DB#STREAM  Redis Streams: XADD, a consumer group read with
  XREADGROUP, XACK + XDEL on ack, XAUTOCLAIM for deliveries left pending too long.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence
from urllib.parse import urlsplit

DEFAULT_STREAM = "segserve:reflow"
GROUP = "segserve-reflow"


@dataclass(frozen=True)
class Delivery:
    delivery_id: str
    """What `ack` takes; the same chunk delivered again keeps its id."""
    payload: bytes


class ChunkQueue(ABC):
    """A durable queue of opaque payloads with claim/ack (at-least-once) delivery."""

    @abstractmethod
    def put(self, payloads: Sequence[bytes]) -> None:
        """Append payloads durably, all or none."""

    @abstractmethod
    def claim(self, max_items: int) -> list[Delivery]:
        """Up to max_items deliveries, oldest first: new ones and ones whose claim timed out."""

    @abstractmethod
    def ack(self, delivery_ids: Sequence[str]) -> None:
        """Forget deliveries for good (acking twice is harmless)."""

    @abstractmethod
    def depth(self) -> int:
        """Payloads not yet acknowledged (claimed or not)."""

    @abstractmethod
    def oldest_age_s(self) -> float:
        """Seconds since the oldest unacknowledged payload was put (0 when empty)."""

    def close(self) -> None:
        """Release connections."""


class SqliteQueue(ChunkQueue):
    def __init__(self, path: str | Path, visibility_timeout_s: float = 60.0):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.visibility_timeout_s = visibility_timeout_s
        self._lock = threading.Lock()  # one connection, shared by the owner's threads
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30.0)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS chunks (id INTEGER PRIMARY KEY AUTOINCREMENT, payload BLOB NOT NULL,"
            " put_at REAL NOT NULL, visible_at REAL NOT NULL DEFAULT 0)")

    def put(self, payloads: Sequence[bytes]) -> None:
        now = time.time()
        with self._lock, self._transaction():
            self._conn.executemany("INSERT INTO chunks (payload, put_at) VALUES (?, ?)",
                                   [(payload, now) for payload in payloads])

    def claim(self, max_items: int) -> list[Delivery]:
        now = time.time()
        with self._lock, self._transaction():
            rows = self._conn.execute("SELECT id, payload FROM chunks WHERE visible_at <= ? ORDER BY id LIMIT ?",
                                      (now, max_items)).fetchall()
            self._conn.executemany("UPDATE chunks SET visible_at = ? WHERE id = ?",
                                   [(now + self.visibility_timeout_s, row_id) for row_id, _ in rows])
        return [Delivery(str(row_id), payload) for row_id, payload in rows]

    def ack(self, delivery_ids: Sequence[str]) -> None:
        with self._lock, self._transaction():
            self._conn.executemany("DELETE FROM chunks WHERE id = ?", [(int(i),) for i in delivery_ids])

    def depth(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0]

    def oldest_age_s(self) -> float:
        with self._lock:
            oldest = self._conn.execute("SELECT MIN(put_at) FROM chunks").fetchone()[0]
        return 0.0 if oldest is None else max(0.0, time.time() - oldest)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def _transaction(self):
        return _Transaction(self._conn)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error): takes the write lock up front, so claims never race."""

    def __init__(self, conn: sqlite3.Connection):
        self._conn = conn

    def __enter__(self) -> None:
        self._conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, *_) -> None:
        self._conn.execute("ROLLBACK" if exc_type else "COMMIT")


class RedisStreamQueue(ChunkQueue):
    def __init__(self, url: str, stream: str = DEFAULT_STREAM, consumer_name: str = "consumer-1",
                 visibility_timeout_s: float = 60.0):
        import redis

        self.stream = stream
        self.consumer_name = consumer_name
        self.visibility_timeout_s = visibility_timeout_s
        self._redis = redis.Redis.from_url(url)
        try:
            self._redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):  # the group exists already: fine
                raise

    def put(self, payloads: Sequence[bytes]) -> None:
        pipe = self._redis.pipeline(transaction=True)
        for payload in payloads:
            pipe.xadd(self.stream, {"c": payload})  # never MAXLEN: trimming would drop unacked chunks
        pipe.execute()

    def claim(self, max_items: int) -> list[Delivery]:
        idle_ms = int(self.visibility_timeout_s * 1000)
        _, stale, *_ = self._redis.xautoclaim(self.stream, GROUP, self.consumer_name, idle_ms, "0-0",
                                              count=max_items)
        deliveries = [Delivery(i.decode(), f[b"c"]) for i, f in stale if f]
        if len(deliveries) < max_items:
            for _, entries in self._redis.xreadgroup(GROUP, self.consumer_name, {self.stream: ">"},
                                                     count=max_items - len(deliveries)) or []:
                deliveries += [Delivery(i.decode(), f[b"c"]) for i, f in entries]
        return deliveries

    def ack(self, delivery_ids: Sequence[str]) -> None:
        if delivery_ids:
            pipe = self._redis.pipeline(transaction=True)
            pipe.xack(self.stream, GROUP, *delivery_ids)
            pipe.xdel(self.stream, *delivery_ids)  # acked entries leave the stream: depth = XLEN
            pipe.execute()

    def depth(self) -> int:
        return self._redis.xlen(self.stream)

    def oldest_age_s(self) -> float:
        first = self._redis.xrange(self.stream, count=1)
        if not first:
            return 0.0
        put_ms = int(first[0][0].split(b"-")[0])  # stream ids start with the put time in ms
        return max(0.0, time.time() - put_ms / 1000)

    def close(self) -> None:
        self._redis.close()


def open_queue(url: str, consumer_name: str = "consumer-1", visibility_timeout_s: float = 60.0) -> ChunkQueue:
    """sqlite:///relative/path, sqlite:////absolute/path, or redis://host:port/db#stream."""
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        return SqliteQueue(url[len("sqlite:///"):], visibility_timeout_s)
    if parts.scheme in ("redis", "rediss", "unix"):
        return RedisStreamQueue(url.split("#")[0], parts.fragment or DEFAULT_STREAM, consumer_name,
                                visibility_timeout_s)
    raise ValueError(f"queue URL must start with sqlite:/// or redis://, got {url!r}")
