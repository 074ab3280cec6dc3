"""Plain dataclasses crossing the scheduler's internal boundaries.

Scheduler.schedule() -> SchedulerOutput -> (worker step) -> dict[seq_id,
SampledTokens] -> Scheduler.postprocess() -> list[RequestOutput]. Protobuf is
converted to and from these at the gRPC edges only (worker_client, convert).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.sequence import RequestMetrics, SamplingParams, SequenceStatus


@dataclass(frozen=True)
class NewSequence:
    """A sequence the worker has not seen: sent once, before its first work."""

    seq_id: str
    sampling: SamplingParams
    num_prompt_tokens: int


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's work in one step."""

    seq_id: str
    token_ids: list[int]
    """Tokens to compute; they start at position num_computed_tokens."""
    num_computed_tokens: int
    """Tokens already in the KV cache (0 = start over, e.g. after a preemption)."""
    block_table: list[int]
    """Covers num_computed_tokens + len(token_ids) positions."""
    sample_indices: list[int]
    """Indices into token_ids whose next token is sampled; empty for a prefill chunk short of the end."""
    position_ids: list[int] = field(default_factory=list)
    """Empty = num_computed_tokens + i (candidate trees will set depths here)."""
    attention_mask: bytes = b""
    """Packed tree mask (see worker.proto); empty = causal."""
    draft_parents: list[int] = field(default_factory=list)
    """A candidate tree to verify (see worker.proto): token_ids[0] is the root (the last sampled
    token), draft_parents[i] is the index into token_ids of token_ids[i + 1]'s parent (0 = root).
    Empty = no speculation; when set, sample_indices is empty and the worker answers with the
    accepted drafts plus its own token."""

    @property
    def is_sampled(self) -> bool:
        """Whether the worker returns tokens for this work (a sampled position or a tree)."""
        return bool(self.sample_indices or self.draft_parents)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.draft_parents)


@dataclass(frozen=True)
class DraftTree:
    """A candidate tree from the drafter, rooted at the sequence's last token (drafter.proto)."""

    token_ids: list[int]
    """Draft tokens in topological order."""
    parents: list[int]
    """-1 = the root, else an index into token_ids smaller than the node's own."""
    segment: str = ""
    """The segment kind the request is in, for per-segment stats."""

    @property
    def depths(self) -> list[int]:
        """Depth of each node; the root's children have depth 1."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths


@dataclass
class SchedulerOutput:
    """Everything the worker needs for one step."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    new_sequences: list[NewSequence] = field(default_factory=list)
    finished_seq_ids: list[str] = field(default_factory=list)
    """Finished or aborted sequences whose sampling state the worker drops."""

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def num_draft_tokens(self) -> int:
        return sum(s.num_draft_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class TopLogprobs:
    """The most likely alternatives at one position, most likely first."""

    token_ids: list[int]
    logprobs: list[float]


@dataclass
class SampledTokens:
    """What the worker sampled for one sequence in one step: one entry per sample index.

    Lists, because speculative decoding accepts several tokens per step.
    """

    token_ids: list[int]
    scores: list[float]
    """Per token: the logit (greedy) or the log-probability (sampling)."""
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """Per token, when the sequence asked for num_top_logprobs > 0."""


@dataclass
class RequestOutput:
    """One step's news for one request: its new tokens and, at the end, why it stopped."""

    request_id: str
    token_ids: list[int]
    scores: list[float]
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_status: SequenceStatus | None = None
    """Set on the request's last output."""
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    """Output tokens so far, these included."""
    metrics: RequestMetrics | None = None
    """The request's timeline so far (final on its last output)."""

    @property
    def is_finished(self) -> bool:
        return self.finish_status is not None


@dataclass(frozen=True)
class RequestError:
    """The terminal event of a request that failed or was cancelled."""

    request_id: str
    code: str
    """Machine-readable kind: "internal", "cancelled", "invalid_request"."""
    message: str
