"""Typed configuration of data reflow on the router's side: the recorder.

CLI flags derive from these fields (segserve/flags.py). The consumer's side,
ConsumerConfig, is offline tooling and lives in segserve/reflow/config.py;
`queue_url` is the one setting both sides share, so that the recorder and the
consumer meet on one queue.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RecorderConfig:
    """The router side: chunking, the in-memory buffer and the background writer."""

    queue_url: str = "sqlite:///reflow/queue.db"
    """Buffer queue: sqlite:///PATH (embedded, durable local file) or redis://HOST:PORT/DB[#STREAM]."""
    max_chunk_bytes: int = 16_384
    """Largest payload of one chunk; request bodies are split at this size."""
    max_buffer_bytes: int = 64 * 1024 * 1024
    """Bound on payload bytes waiting in memory for the writer; past it new chunks are dropped and counted."""
    flush_interval_s: float = 0.02
    """Longest a chunk waits in memory before the writer moves it to the queue."""
    writer_batch: int = 512
    """Most chunks the writer puts into the queue in one transaction."""
    spill_dir: str = "reflow/spill"
    """Where the writer spills batches the queue refused (queue down), to replay them later."""
    max_spill_bytes: int = 1024 * 1024 * 1024
    """Bound on spilled bytes; past it a refused batch is dropped and counted."""

    def __post_init__(self) -> None:
        if self.max_chunk_bytes < 16:
            raise ValueError("max_chunk_bytes must be >= 16")
        if self.max_buffer_bytes < self.max_chunk_bytes:
            raise ValueError("max_buffer_bytes must be >= max_chunk_bytes")
        if self.flush_interval_s <= 0 or self.writer_batch <= 0:
            raise ValueError("flush_interval_s and writer_batch must be > 0")
        if self.max_spill_bytes < 0:
            raise ValueError("max_spill_bytes must be >= 0 (0 = never spill)")

