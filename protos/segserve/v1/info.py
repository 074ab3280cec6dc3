"""Component info and health contracts (common.proto's WorkerInfo and HealthResponse). Torch-free.

The worker reports `WorkerInfo`; the scheduler passes it on to the router, which
reads the model's name, context limit, vocabulary and EOS ids from it. Every
service answers Health with `Health`.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.segserve.v1 import common_pb2


@dataclass(frozen=True)
class WorkerInfo:
    """Static facts about the served model and the worker's KV cache."""

    model_name: str
    num_kv_blocks: int
    """KV-cache blocks the worker allocated."""
    block_size: int
    """Tokens per KV-cache block."""
    max_model_len: int
    """Longest sequence (prompt + output) the model supports."""
    vocab_size: int
    """Size of the output vocabulary."""
    eos_token_ids: tuple[int, ...]
    """Token ids that end generation."""
    device: str = ""
    """torch device, e.g. "cpu" or "cuda:0"."""
    dtype: str = ""
    """torch dtype, e.g. "float32"."""
    packed_steps: bool = False
    """The worker's server reads steps packed (step.py); set by the server, which owns the wire."""
    block_table_deltas: bool = False
    """The worker keeps each sequence's block table between steps, so a step may send only the entries from
    ScheduledSequence.block_table_start on."""
    max_decode_steps: int = 1
    """The most decode steps the worker runs for one StepRequest (StepRequest.num_steps); 1 for a worker that
    predates multi-step decoding."""
    step_stream: bool = False
    """The worker's server serves Worker.StepStream (steps over one stream); set by the server, which owns the
    wire."""
    sequence_state_reason: str = ""
    """Why the worker takes no cached prefixes: its model keeps state per sequence besides the KV cache, which runs
    from each token to the next (LFM2's convolutions, Mamba mixers). Empty: it takes them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    def to_pb(self) -> common_pb2.WorkerInfo:
        return common_pb2.WorkerInfo(
            model_name=self.model_name, num_kv_blocks=self.num_kv_blocks, block_size=self.block_size,
            max_model_len=self.max_model_len, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids,
            device=self.device, dtype=self.dtype, packed_steps=self.packed_steps,
            block_table_deltas=self.block_table_deltas, max_decode_steps=self.max_decode_steps,
            step_stream=self.step_stream, sequence_state_reason=self.sequence_state_reason)

    @classmethod
    def from_pb(cls, pb: common_pb2.WorkerInfo) -> WorkerInfo:
        return cls(pb.model_name, pb.num_kv_blocks, pb.block_size, pb.max_model_len, pb.vocab_size,
                   tuple(pb.eos_token_ids), pb.device, pb.dtype, pb.packed_steps, pb.block_table_deltas,
                   max(1, pb.max_decode_steps), pb.step_stream, pb.sequence_state_reason)


@dataclass(frozen=True)
class Health:
    """Whether a component can do its work, and why not."""

    is_ready: bool
    detail: str = ""

    def to_pb(self) -> common_pb2.HealthResponse:
        return common_pb2.HealthResponse(ready=self.is_ready, detail=self.detail)

    @classmethod
    def from_pb(cls, pb: common_pb2.HealthResponse) -> Health:
        return cls(pb.ready, pb.detail)
