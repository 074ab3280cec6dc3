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

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError("port must be in 0..65535")
        if self.default_max_tokens <= 0:
            raise ValueError("default_max_tokens must be > 0")
