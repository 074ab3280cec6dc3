"""The consumer (`segserve reflow consume`): queue in, one inference log per session out.

In: deliveries from the buffer queue. Out: records in the session sink, then the
acknowledgement of every delivery they were built from. The order is the whole
crash-safety argument: write (idempotent, atomic) first, ack after. A consumer
killed anywhere leaves unacked deliveries that come back after the visibility
timeout; rebuilding and rewriting their records changes nothing in the sink.

Memory stays bounded: chunks are held only until their record is written, and
claiming pauses at max_held_chunks (a slow or failing sink leaves the backlog in
the durable queue, not here). A failing sink write is retried with backoff.
"""

from __future__ import annotations

import logging
import threading
import time

from common.backoff import Backoff
from common.redact import redact_record
from router.reflow.chunks import Chunk
from router.reflow.queue import ChunkQueue, open_queue
from segserve.reflow.assembly import Assembler
from segserve.reflow.config import ConsumerConfig
from segserve.reflow.sink import SessionSink, open_sink

log = logging.getLogger(__name__)

_IDLE_SLEEP_S = 0.05
_SINK_BACKOFF = Backoff(0.1, 5.0)


class Consumer:
    def __init__(self, queue: ChunkQueue, sink: SessionSink, config: ConsumerConfig | None = None):
        self.queue = queue
        self.sink = sink
        self.config = config or ConsumerConfig()
        self.assembler = Assembler()
        self.num_records_written = 0
        self.num_bad_chunks = 0
        self.num_sink_failures = 0
        self._backoff_s = 0.0
        """The wait before the next try of a sink write that failed (0 after one that worked)."""
        self._num_failed_writes = 0
        """Sink writes that failed in a row."""

    def step(self) -> bool:
        """Claim, reassemble, write what is ready. True when it made progress."""
        now = time.monotonic()
        room = self.config.max_held_chunks - self.assembler.num_held_deliveries
        deliveries = self.queue.claim(min(self.config.claim_batch, room)) if room > 0 else []
        poison = []
        for delivery in deliveries:
            try:
                self.assembler.add(Chunk.from_bytes(delivery.payload), delivery.delivery_id, now)
            except (ValueError, TypeError, KeyError):
                log.error("dropping an unreadable chunk %s", delivery.delivery_id)
                self.num_bad_chunks += 1
                poison.append(delivery.delivery_id)
        self.queue.ack(poison)
        # Drain mode ends by writing what is left, once everything in the queue is held here.
        is_flush_all = (self.config.is_drain and not deliveries
                        and self.queue.depth() <= self.assembler.num_held_deliveries)
        ready = self.assembler.ready(now, self.config.incomplete_after_s, is_flush_all)
        if ready and not self._write(ready):
            return False
        return bool(deliveries or ready)

    def run(self, stop: threading.Event | None = None) -> None:
        """Loop until `stop` is set, or, draining, until the queue is empty and nothing is held."""
        stop = stop or threading.Event()
        while not stop.is_set():
            if self.step():
                continue
            if self.config.is_drain and not len(self.assembler) and self.queue.depth() == 0:
                return
            stop.wait(max(self._backoff_s, _IDLE_SLEEP_S))

    def _write(self, ready: list[tuple[dict, list[str]]]) -> bool:
        records = [redact_record(record) if self.config.redact else record for record, _ in ready]
        try:
            self.sink.write(records)
        except Exception as exc:  # the records stay held, their chunks stay unacked
            self.num_sink_failures += 1
            self._num_failed_writes += 1
            self._backoff_s = _SINK_BACKOFF.delay_s(self._num_failed_writes)
            log.warning("reflow sink write failed (%s); retrying in %.1f s", exc, self._backoff_s)
            return False
        self._backoff_s, self._num_failed_writes = 0.0, 0
        self.queue.ack([delivery_id for _, delivery_ids in ready for delivery_id in delivery_ids])
        self.assembler.remove([record["request_id"] for record, _ in ready])
        self.num_records_written += len(ready)
        return True


def consume(config: ConsumerConfig, stop: threading.Event | None = None) -> Consumer:
    """Open the queue and sink the config names and run a consumer on them."""
    queue = open_queue(config.queue_url, config.consumer_name, config.visibility_timeout_s)
    try:
        consumer = Consumer(queue, open_sink(config.sink_dir, config.sink_format), config)
        consumer.run(stop)
        return consumer
    finally:
        queue.close()
