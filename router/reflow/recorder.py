"""The router's side of data reflow: requests and responses in, chunks into the queue.

In: calls from the request handlers (`start_request`, then `.delta(...)` per
streamed delta, then `.finish(state)` once on every exit path). Out: chunks in the
durable buffer queue, written by one background thread.

The hot path only serializes a chunk and appends it to a bounded in-memory buffer:
it never waits on disk or network and never raises into the request. Bound policy,
every step counted:
1. buffer full (max_buffer_bytes): the new chunk is dropped, reason buffer_full.
   A final chunk gets 1/8 more room, so that a request that lost chunks under
   pressure still ends with a chunk saying how many it lost;
2. queue refuses a batch (down, disk full): the writer spills it to local disk
   and replays it once the queue takes writes again (spill bytes);
3. spill full (max_spill_bytes): the batch is dropped, reason spill_full.
Chunks still in memory when the process is killed are lost: at most
flush_interval_s worth. `close()` flushes them on a clean stop.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping

from router.reflow.chunks import Chunk, Direction, FinishState, session_id_for, split_utf8
from router.reflow.config import RecorderConfig
from router.reflow.queue import ChunkQueue, open_queue
from router.reflow.spill import SpillDir

log = logging.getLogger(__name__)

_QUEUE_RETRY_S = 1.0  # after a refused put, batches go straight to spill for this long
_QUEUE_SAMPLE_S = 1.0  # how often the writer refreshes queue depth / oldest age


class DropReason(str, Enum):
    BUFFER_FULL = "buffer_full"
    SPILL_FULL = "spill_full"
    INTERNAL_ERROR = "internal_error"
    """A bug in recording (e.g. an unserializable value): counted, never raised into the request."""


@dataclass
class RecorderStats:
    """A snapshot for metrics; queue figures are sampled by the writer, never on the caller's thread."""

    num_chunks_recorded: int
    num_chunks_dropped: dict[str, int]
    buffered_chunks: int
    buffered_bytes: int
    spill_bytes: int
    queue_depth: int
    queue_oldest_age_s: float


class RequestRecording:
    """One request's chunks. Every method is safe to call on any exit path; finish() counts once."""

    def __init__(self, recorder: Recorder, request_id: str, client_id: str, service_id: str, session_id: str):
        self._recorder = recorder
        self._tags = dict(request_id=request_id, client_id=client_id, service_id=service_id, session_id=session_id)
        self.session_id = session_id
        self.num_request_chunks = 0
        self.num_response_chunks = 0
        self.num_dropped = 0
        self.is_finished = False

    def request(self, body: bytes) -> None:
        """The request body, split into chunks of at most max_chunk_bytes."""
        for piece in split_utf8(body, self._recorder.config.max_chunk_bytes):
            self._offer(Direction.REQUEST, self.num_request_chunks, text=piece)
            self.num_request_chunks += 1

    def delta(self, text: str, token_ids: tuple[int, ...] | list[int] = (), choice: int = 0) -> None:
        """One streamed delta (or the whole non-streamed text) of the response's choice `choice`."""
        if not self.is_finished:
            self._offer(Direction.RESPONSE, self.num_response_chunks, text=text, token_ids=tuple(token_ids),
                        choice=choice)
            self.num_response_chunks += 1

    def finish(self, state: FinishState, usage: Mapping[str, int] | None = None, error: str | None = None) -> None:
        """The final chunk; later calls are ignored, so a `finally` may call it unconditionally."""
        if self.is_finished:
            return
        self.is_finished = True
        self._offer(Direction.RESPONSE, self.num_response_chunks, is_final=True, finish=state,
                    usage=dict(usage) if usage else None, num_request_chunks=self.num_request_chunks,
                    num_dropped=self.num_dropped, extra={"error": error} if error else {})

    def __enter__(self) -> RequestRecording:
        return self

    def __exit__(self, exc_type, exc, _tb) -> None:
        """Leaving without finish(): an exception picks the state, a clean exit is complete."""
        if exc_type is None:
            self.finish(FinishState.COMPLETE)
        elif issubclass(exc_type, (GeneratorExit, KeyboardInterrupt)) or exc_type.__name__ == "CancelledError":
            self.finish(FinishState.CANCELLED)
        elif issubclass(exc_type, TimeoutError):
            self.finish(FinishState.DEADLINE)
        else:
            self.finish(FinishState.ERROR, error=f"{exc_type.__name__}: {exc}")

    def _offer(self, direction: Direction, seq: int, is_final: bool = False, **fields: Any) -> None:
        try:
            chunk = Chunk(direction=direction, seq=seq, timestamp=time.time(), **self._tags, **fields)
            is_kept = self._recorder.offer(chunk.to_bytes(), is_final)
        except Exception:  # recording must never fail a request
            self._recorder.count_drop(DropReason.INTERNAL_ERROR)
            is_kept = False
        self.num_dropped += not is_kept


class Recorder:
    """The bounded buffer and its writer thread. start() once, close() at shutdown."""

    def __init__(self, queue: ChunkQueue, config: RecorderConfig | None = None):
        self.queue = queue
        self.config = config or RecorderConfig()
        self.spill = SpillDir(self.config.spill_dir, self.config.max_spill_bytes)
        self._buffer: collections.deque[bytes] = collections.deque()
        self._buffered_bytes = 0
        self._lock = threading.Lock()  # guards the buffer's byte count and the counters
        self.num_chunks_recorded = 0
        self.num_chunks_dropped: dict[str, int] = {reason.value: 0 for reason in DropReason}
        self._queue_depth, self._queue_oldest_age_s, self._sampled_at = 0, 0.0, 0.0
        self._queue_down_until = 0.0
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._run, name="reflow-writer", daemon=True)

    def start(self) -> Recorder:
        self._writer.start()
        return self

    def close(self) -> None:
        """Stop the writer after it has flushed the buffer (or spilled it, queue down)."""
        self._stop.set()
        if self._writer.is_alive():
            self._writer.join()
        self.queue.close()

    def start_request(self, request_id: str, client_id: str, service_id: str, body: bytes,
                      parsed_body: Mapping[str, Any] | None = None,
                      headers: Mapping[str, str] | None = None) -> RequestRecording:
        """Record a request's body now; the session comes from headers/body (see chunks.py)."""
        try:
            if parsed_body is None:
                parsed_body = json.loads(body) if body else {}
            session_id = session_id_for(client_id, service_id, parsed_body, headers)
        except Exception:  # unparseable body: still recorded, as a session of its own
            session_id = f"r-{request_id}"
        recording = RequestRecording(self, request_id, client_id, service_id, session_id)
        recording.request(body)
        return recording

    def offer(self, payload: bytes, is_final: bool = False) -> bool:
        """Append to the buffer without blocking; False (and counted) when the bound is hit."""
        limit = self.config.max_buffer_bytes + (self.config.max_buffer_bytes // 8 if is_final else 0)
        with self._lock:
            if self._buffered_bytes + len(payload) > limit:
                self.num_chunks_dropped[DropReason.BUFFER_FULL.value] += 1
                return False
            self._buffered_bytes += len(payload)
            self.num_chunks_recorded += 1
        self._buffer.append(payload)
        return True

    def count_drop(self, reason: DropReason, num_chunks: int = 1) -> None:
        with self._lock:
            self.num_chunks_dropped[reason.value] += num_chunks

    def stats(self) -> RecorderStats:
        with self._lock:
            return RecorderStats(self.num_chunks_recorded, dict(self.num_chunks_dropped), len(self._buffer),
                                 self._buffered_bytes, self.spill.num_bytes, self._queue_depth,
                                 self._queue_oldest_age_s)

    def _run(self) -> None:
        while not self._stop.wait(self.config.flush_interval_s):
            self._write_buffer()
            self._replay_spill()
            self._sample_queue()
        self._write_buffer()  # the final flush of close()

    def _write_buffer(self) -> None:
        while self._buffer:
            batch = [self._buffer.popleft() for _ in range(min(self.config.writer_batch, len(self._buffer)))]
            self._put_or_spill(batch)
            with self._lock:
                self._buffered_bytes -= sum(map(len, batch))

    def _put_or_spill(self, batch: list[bytes]) -> None:
        if time.monotonic() >= self._queue_down_until:
            try:
                self.queue.put(batch)
                return
            except Exception as exc:
                log.warning("reflow queue refused a batch (%s); spilling for %.0f s", exc, _QUEUE_RETRY_S)
                self._queue_down_until = time.monotonic() + _QUEUE_RETRY_S
        if not self.spill.write(batch):
            self.count_drop(DropReason.SPILL_FULL, len(batch))

    def _replay_spill(self) -> None:
        while self.spill and time.monotonic() >= self._queue_down_until:
            oldest = self.spill.oldest()
            if oldest is None:
                return
            path, payloads = oldest
            try:
                self.queue.put(payloads)
            except Exception:
                self._queue_down_until = time.monotonic() + _QUEUE_RETRY_S
                return
            self.spill.remove(path)  # a crash before this replays the batch again: the consumer dedupes

    def _sample_queue(self) -> None:
        now = time.monotonic()
        if now - self._sampled_at < _QUEUE_SAMPLE_S or now < self._queue_down_until:
            return
        self._sampled_at = now
        try:
            depth, age = self.queue.depth(), self.queue.oldest_age_s()
        except Exception:
            return  # the next put tells whether the queue is down
        with self._lock:
            self._queue_depth, self._queue_oldest_age_s = depth, age


def open_recorder(config: RecorderConfig) -> Recorder:
    """A started recorder on the queue the config names."""
    return Recorder(open_queue(config.queue_url), config).start()
