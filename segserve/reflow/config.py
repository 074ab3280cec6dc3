"""Typed configuration of the offline side of data reflow: the consumer.

CLI flags derive from these fields (segserve/flags.py). The router's side,
RecorderConfig, lives in router/reflow/config.py; `queue_url` is the one setting
both sides share, so that the recorder and the consumer meet on one queue.
"""

from __future__ import annotations

from dataclasses import dataclass

SINK_FORMATS = ("jsonl", "parquet")


@dataclass
class ConsumerConfig:
    """The consumer side (`segserve reflow consume`): claims, reassembly and the sink."""

    queue_url: str = "sqlite:///reflow/queue.db"
    """Buffer queue to drain (same syntax as the recorder's)."""
    sink_dir: str = "reflow/logs"
    """Directory of the inference logs, one file per session."""
    sink_format: str = "jsonl"
    """jsonl or parquet."""
    redact: bool = False
    """Mask e-mail addresses, phone numbers and API keys before anything is written."""
    consumer_name: str = "consumer-1"
    """Name in the queue's consumer group (Redis); claims are per name."""
    claim_batch: int = 1000
    """Most chunks claimed at once."""
    visibility_timeout_s: float = 60.0
    """A claimed chunk not acknowledged within this time is delivered again (a crashed consumer's claims)."""
    incomplete_after_s: float = 300.0
    """Idle seconds after which an unfinished request is written as incomplete."""
    max_held_chunks: int = 200_000
    """Bound on chunks held in memory (unfinished requests, sink down); past it claiming pauses."""
    is_drain: bool = False
    """Exit once the queue is empty, writing what is left (unfinished requests as incomplete)."""

    def __post_init__(self) -> None:
        if self.sink_format not in SINK_FORMATS:
            raise ValueError(f"sink_format must be one of {SINK_FORMATS}")
        if self.claim_batch <= 0 or self.max_held_chunks < self.claim_batch:
            raise ValueError("claim_batch must be > 0 and max_held_chunks >= claim_batch")
        if self.visibility_timeout_s <= 0 or self.incomplete_after_s <= 0:
            raise ValueError("visibility_timeout_s and incomplete_after_s must be > 0")
