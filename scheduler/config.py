"""The scheduler's typed configuration; CLI flags derive from these fields."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    worker_address: str = "127.0.0.1:50061"
    """gRPC address of the worker."""
    max_num_seqs: int = 32
    """Most sequences in one step."""
    max_num_batched_tokens: int = 256
    """Token budget of one step: prefill chunks, decode tokens and draft tokens together."""
    host: str = "127.0.0.1"
    """Address the gRPC server binds to (localhost by default)."""
    port: int = 50051
    """gRPC port (0 = any free port)."""
    max_num_waiting: int = 1024
    """Most requests queued but not running; more are refused (RESOURCE_EXHAUSTED, HTTP 429)."""
    worker_step_timeout_s: float = 120.0
    """Deadline of one worker step; a step past it fails the requests it carried."""

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be > 0")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be > 0")
        if self.max_num_waiting <= 0:
            raise ValueError("max_num_waiting must be > 0")
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in 0..65535")
        if self.worker_step_timeout_s <= 0:
            raise ValueError("worker_step_timeout_s must be > 0")
