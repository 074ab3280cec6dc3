"""One request as the scheduler sees it: a token list, a few counters and a status.

There is no prefill or decode phase: `token_ids` is prompt + output, and
`num_computed_tokens` says how many of them are in the worker's KV cache. Each
step computes some of the rest (a prefill chunk, or the one sampled token).
Sampling and stopping are the contract's types (protos/segserve/v1/sampling.py).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from protos.segserve.v1.generate import FinishReason, GenerateRequest
from protos.segserve.v1.sampling import SamplingParams, StoppingCriteria


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()
    """Ended on its own; `finish_reason` says why (FinishReason.ERROR: it failed in the worker)."""
    ABORTED = enum.auto()
    """Cancelled by the client, or failed by the engine with a GenerateError."""

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED, SequenceStatus.ABORTED)


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
    block_hashes: list[bytes] = field(default_factory=list)
    """Prefix-cache hashes of the full blocks of token_ids computed so far (block_manager.hash_block)."""
    num_hashed_blocks: int = 0
    """Leading blocks of block_table that are in the prefix cache (taken from it, or computed and hashed)."""
    num_blocks_sent: int = 0
    """Leading entries of block_table that the worker has as they are, from earlier steps: a step sends only the
    ones after them (ScheduledSequence.block_table_start). Every change to block_table lowers it to where the
    change starts (block_manager.py); 0 sends the whole table."""
    num_cached_prompt_tokens: int | None = None
    """Prompt tokens taken from the prefix cache at first admission (None until then)."""
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    """Set when status is FINISHED."""
    error_message: str = ""
    """Why, with FinishReason.ERROR."""
    is_known_to_worker: bool = False
    """Set once the worker has been sent this sequence's NewSequence."""
    num_failed_steps: int = 0
    """Whole worker steps in a row that failed with this sequence in them (it was preempted and retried)."""
    next_prompt_logprob_index: int = 1
    """First prompt index whose log-probability has not been streamed (recomputation repeats them)."""
    first_scheduled_time: float | None = None
    queue_wait_us: int = 0
    """Arrival to first scheduling, kept from the first scheduling on (every token chunk reports it)."""
    first_token_time: float | None = None
    last_token_time: float | None = None
    max_batch_size: int = 0
    """Largest number of sequences in a step this one ran in."""
    segment: str = ""
    """The segment kind the drafter last placed this request in ("" = not known); the speculator sets it."""
    tenant: str = ""
    """Whose request (GenerateRequest.tenant); the drafter learns its segments only for this tenant."""
    forced_span: tuple[int, ...] = ()
    """A structured output under speculation: the tokens its grammar forces after its output as the worker last
    found them (SequenceOutput.forced_token_ids), a draft that costs no drafter call."""
    forced_span_at: int = -1
    """num_output_tokens when forced_span came: it is drafted only at exactly that length (a step built before
    that answer, e.g. ahead of it, leaves it stale)."""
    trace: object | None = None
    """The request's traces.RequestTrace when the router traced it (scheduler/traces.py: its spans' parent)."""

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)

    @classmethod
    def of(cls, request: GenerateRequest, arrival_time: float | None = None) -> Sequence:
        """A new sequence for a validated GenerateRequest."""
        return cls(request.request_id, list(request.prompt_token_ids), request.sampling, request.stopping,
                   time.monotonic() if arrival_time is None else arrival_time, tenant=request.tenant)

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
    """A request's timeline, in microseconds (0 where the event never happened)."""

    queue_wait_us: int
    """Arrival to first scheduling."""
    first_token_us: int
    """Arrival to the first token."""
    decode_us: int
    """First token to last token."""
    max_batch_size: int

    @classmethod
    def of(cls, seq: Sequence) -> RequestMetrics:
        def us(start: float | None, end: float | None) -> int:
            return 0 if start is None or end is None else max(0, round((end - start) * 1e6))

        return cls(
            queue_wait_us=us(seq.arrival_time, seq.first_scheduled_time),
            first_token_us=us(seq.arrival_time, seq.first_token_time),
            decode_us=us(seq.first_token_time, seq.last_token_time),
            max_batch_size=seq.max_batch_size,
        )
