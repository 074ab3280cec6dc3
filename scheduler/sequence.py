"""One request as the scheduler sees it: a token list, a few counters and a status.

There is no prefill or decode phase: `token_ids` is prompt + output, and
`num_computed_tokens` says how many of them are in the worker's KV cache. Each
step computes some of the rest (a prefill chunk, or the one sampled token).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen (the wire's SamplingParams, as plain Python)."""

    do_sample: bool = False
    """Sample from the distribution (True) or take the argmax (False)."""
    temperature: float = 1.0
    """Softmax temperature, > 0."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 = off."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1.0 = off."""
    typical_p: float = 1.0
    """Locally typical mass in (0, 1]; 1.0 = off."""
    repetition_penalty: float = 1.0
    """> 0; 1.0 = off."""
    frequency_penalty: float = 0.0
    """Subtract penalty * count of the token in the output; 0 = off."""
    presence_penalty: float = 0.0
    """Subtract penalty once per token present in the output; 0 = off."""
    seed: int | None = None
    """Seed of the request's own generator; None = random."""
    num_top_logprobs: int = 0
    """Top log-probabilities returned with every token; 0 = none."""
    watermark: bool = False
    """Bias sampling toward the green list (worker/watermark.py)."""


@dataclass(frozen=True)
class StoppingCriteria:
    """When a request stops generating (besides the context limit)."""

    max_new_tokens: int = 16
    """Upper bound on generated tokens, > 0."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS tokens."""


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_EOS_TOKEN = enum.auto()
    """The model produced one of its EOS tokens."""
    FINISHED_STOP_TOKEN = enum.auto()
    """One of stop_token_ids was produced."""
    FINISHED_LENGTH = enum.auto()
    """max_new_tokens reached."""
    FINISHED_CONTEXT_LENGTH = enum.auto()
    """The sequence filled the context (max_model_len or the whole KV cache)."""
    FINISHED_ABORTED = enum.auto()
    """Cancelled by the client, or failed by the engine."""

    @property
    def is_finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)


@dataclass(eq=False)
class Sequence:
    """A request's tokens, its place in the KV cache and its timeline.

    Invariant: num_computed_tokens <= num_tokens, and while RUNNING the block
    table covers at least num_computed_tokens positions.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingCriteria = field(default_factory=StoppingCriteria)
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    """Prompt followed by the output so far."""
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    is_known_to_worker: bool = False
    """Set once the worker has been sent this sequence's NewSequence."""
    num_drafter_tokens: int = 0
    """Tokens the drafter holds for this sequence (0 = send the whole sequence next time)."""
    is_known_to_drafter: bool = False
    """Set once a Draft call carried this sequence: the drafter must be told when it ends."""
    segment: str = ""
    """The segment kind the drafter last reported for this sequence ("" = unknown)."""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    max_batch_size: int = 0
    """Largest number of sequences in a step this one ran in."""

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now


@dataclass(frozen=True)
class RequestMetrics:
    """A finished request's timeline, in microseconds (0 where the event never happened)."""

    queue_wait_us: int
    """Arrival to first scheduling."""
    first_token_us: int
    """Arrival to the first token."""
    decode_us: int
    """First token to last token."""
    max_batch_size: int

    @classmethod
    def of(cls, seq: Sequence) -> "RequestMetrics":
        def us(start: float | None, end: float | None) -> int:
            return 0 if start is None or end is None else max(0, round((end - start) * 1e6))

        return cls(
            queue_wait_us=us(seq.arrival_time, seq.first_scheduled_time),
            first_token_us=us(seq.arrival_time, seq.first_token_time),
            decode_us=us(seq.first_token_time, seq.last_token_time),
            max_batch_size=seq.max_batch_size,
        )
