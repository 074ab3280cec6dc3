"""The router's typed configuration; CLI flags derive from these fields."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RouterConfig:
    model: str | None = None
    """Model directory the tokenizer (and chat template) is loaded from; None = the default model."""
    served_model_name: str | None = None
    """Model name clients send; defaults to the scheduler's (the worker's) name."""
    scheduler_address: str = "127.0.0.1:50051"
    """gRPC address of the scheduler."""
    host: str = "127.0.0.1"
    """HTTP bind address."""
    port: int = 8000
    """HTTP port (0 = any free port, chosen by the launcher)."""
    default_max_tokens: int = 256
    """max_tokens when a request gives none (bounded by the context left)."""
    keepalive_interval_s: float = 10.0
    """Idle seconds before a stream gets an SSE keep-alive comment (so proxies keep it open)."""
    request_timeout_s: float = 600.0
    """Deadline of one request from arrival; past it the stream ends with an error event. 0 = none."""
    scheduler_wait_s: float = 300.0
    """How long start-up waits for the scheduler to answer GetInfo before giving up."""

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in 0..65535")
        if self.default_max_tokens <= 0:
            raise ValueError("default_max_tokens must be > 0")
        if self.keepalive_interval_s <= 0:
            raise ValueError("keepalive_interval_s must be > 0")
        if self.request_timeout_s < 0:
            raise ValueError("request_timeout_s must be >= 0 (0 = no deadline)")
        if self.scheduler_wait_s <= 0:
            raise ValueError("scheduler_wait_s must be > 0")
