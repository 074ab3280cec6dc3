"""The worker's in-process request and response types, converted from/to protobuf at the edge.

The gRPC server turns a `worker_pb2.StepRequest` into a `StepRequest` once with
`from_pb`; the model runner never sees a protobuf object. An in-process caller (a
scheduler test, a benchmark) builds these dataclasses directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from protos.segserve.v1 import common_pb2, worker_pb2
from worker.sampler import SamplingParams


class InvalidRequest(ValueError):
    """A step the worker cannot run as sent (unknown sequence, short block table, bad token id...)."""


def pack_mask(mask: np.ndarray) -> bytes:
    """Pack an n x n boolean attention mask for the wire (row-major, little-endian bit order)."""
    mask = np.asarray(mask, dtype=bool)
    if mask.ndim != 2 or mask.shape[0] != mask.shape[1]:
        raise ValueError(f"attention mask must be square, got shape {mask.shape}")
    return np.packbits(mask.reshape(-1), bitorder="little").tobytes()


def unpack_mask(data: bytes, n: int) -> np.ndarray:
    """Inverse of `pack_mask`: the [n, n] boolean mask, or InvalidRequest when the size is wrong."""
    if len(data) != (n * n + 7) // 8:
        raise InvalidRequest(f"attention_mask has {len(data)} bytes, expected {(n * n + 7) // 8} for {n} tokens")
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=n * n, bitorder="little")
    return bits.reshape(n, n).astype(bool)


@dataclass(frozen=True)
class NewSequence:
    """A sequence the worker has not seen yet (or must restart after a preemption)."""

    seq_id: str
    sampling: SamplingParams
    num_prompt_tokens: int

    @classmethod
    def from_pb(cls, pb: worker_pb2.NewSequence) -> NewSequence:
        try:
            sampling = SamplingParams.from_pb(pb.sampling)
        except ValueError as exc:
            raise InvalidRequest(f"sequence {pb.seq_id!r}: {exc}") from exc
        return cls(pb.seq_id, sampling, pb.num_prompt_tokens)


@dataclass
class ScheduledSequence:
    """One sequence's work in one step; see worker.proto for the meaning of each field."""

    seq_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    position_ids: list[int] | None = None
    """Rotary positions of token_ids; None = num_computed_tokens + i."""
    attention_mask: np.ndarray | None = None
    """[n, n] bool, True where token i may attend to token j; None = causal."""
    sample_indices: list[int] = field(default_factory=list)
    draft_parents: list[int] | None = None
    """Speculative verification: parent index (into token_ids) of each draft token_ids[i + 1];
    token_ids[0] is the root. None = a plain step. See worker/verify.py."""

    @property
    def num_tokens(self) -> int:
        """Tokens in the KV cache once this step has run."""
        return self.num_computed_tokens + len(self.token_ids)

    def positions(self) -> list[int]:
        """Rotary position of every token in token_ids."""
        if self.position_ids is not None:
            return list(self.position_ids)
        return list(range(self.num_computed_tokens, self.num_tokens))

    def visible_tokens(self, index: int) -> list[int]:
        """The new tokens token `index` sees (itself included), in order: its tree path or its prefix."""
        if self.attention_mask is None:
            return self.token_ids[: index + 1]
        return [t for t, seen in zip(self.token_ids, self.attention_mask[index]) if seen]

    @classmethod
    def from_pb(cls, pb: worker_pb2.ScheduledSequence) -> ScheduledSequence:
        n = len(pb.token_ids)
        return cls(
            seq_id=pb.seq_id,
            token_ids=list(pb.token_ids),
            num_computed_tokens=pb.num_computed_tokens,
            block_table=list(pb.block_table),
            position_ids=list(pb.position_ids) if pb.position_ids else None,
            attention_mask=unpack_mask(pb.attention_mask, n) if pb.attention_mask else None,
            sample_indices=list(pb.sample_indices),
            draft_parents=list(pb.draft_parents) or None,
        )

    def to_pb(self) -> worker_pb2.ScheduledSequence:
        return worker_pb2.ScheduledSequence(
            seq_id=self.seq_id,
            token_ids=self.token_ids,
            num_computed_tokens=self.num_computed_tokens,
            block_table=self.block_table,
            position_ids=self.position_ids or [],
            attention_mask=pack_mask(self.attention_mask) if self.attention_mask is not None else b"",
            sample_indices=self.sample_indices,
            draft_parents=self.draft_parents or [],
        )


@dataclass
class StepRequest:
    """Everything the worker does in one step: new sequences, the batch, and sequences to forget."""

    sequences: list[ScheduledSequence] = field(default_factory=list)
    new_sequences: list[NewSequence] = field(default_factory=list)
    finished_seq_ids: list[str] = field(default_factory=list)

    @classmethod
    def from_pb(cls, pb: worker_pb2.StepRequest) -> StepRequest:
        return cls(
            sequences=[ScheduledSequence.from_pb(s) for s in pb.sequences],
            new_sequences=[NewSequence.from_pb(s) for s in pb.new_sequences],
            finished_seq_ids=list(pb.finished_seq_ids),
        )


@dataclass
class SequenceOutput:
    """What was sampled for one sequence: one token per sample index, in the same order."""

    seq_id: str
    token_ids: list[int]
    scores: list[float]
    top_logprobs: list[tuple[list[int], list[float]] | None]

    def to_pb(self) -> worker_pb2.SequenceOutput:
        tops = [common_pb2.TopLogprobs(token_ids=t[0], logprobs=t[1]) for t in self.top_logprobs if t is not None]
        return worker_pb2.SequenceOutput(
            seq_id=self.seq_id, token_ids=self.token_ids, scores=self.scores, top_logprobs=tops
        )


@dataclass(frozen=True)
class WorkerInfo:
    """Static facts about the served model and its KV cache."""

    model_name: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    device: str
    dtype: str

    def to_pb(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            model_name=self.model_name,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            device=self.device,
            dtype=self.dtype,
        )
