"""Token counts of a finished request (generation.proto's GenerationUsage). Torch-free.

The router counts them as a request's choices finish and sends them on every API (the public
gRPC API as GenerationUsage, the HTTP APIs in their own JSON shapes); the gRPC client reads them
back into the same type.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.segserve.v1 import generation_pb2


@dataclass(frozen=True)
class Usage:
    """Token counts of a finished request, every choice together."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (0 when none did)."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_pb(self) -> generation_pb2.GenerationUsage:
        return generation_pb2.GenerationUsage(prompt_tokens=self.prompt_tokens,
                                              completion_tokens=self.completion_tokens,
                                              cached_tokens=self.cached_tokens)

    @classmethod
    def from_pb(cls, message: generation_pb2.GenerationUsage) -> Usage:
        return cls(message.prompt_tokens, message.completion_tokens, message.cached_tokens)
