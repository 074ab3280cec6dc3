"""The generation contract between the router and the scheduler (scheduler.proto's Generate). Torch-free.

In: a `GenerateRequest` (prompt token ids, sampling, stopping). Out: a stream of
`TokenChunk`s ending with a `GenerateComplete` or a `GenerateError`.
`validate_request()` is the one admission check: the router runs it before
calling, the scheduler runs it again on what arrives over gRPC (a caller may skip
the router), so both refuse the same things with the same message.
GenerateStreams carries many requests over one call: `StartStream` /
`CancelStream` go in, and each response is a list of (request_id, event) pairs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protos.segserve.v1 import scheduler_pb2
from protos.segserve.v1.info import WorkerInfo
from protos.segserve.v1.sampling import InvalidParameter, SamplingParams, StoppingCriteria, validate
from protos.segserve.v1.step import as_tuple, per_entry, unless_default
from protos.segserve.v1.step_result import PromptLogprobs, TopLogprobs


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt to generate from."""

    request_id: str
    """Unique among live requests."""
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingCriteria = field(default_factory=StoppingCriteria)
    tenant: str = ""
    """Whose request (a stable non-secret id set by the router; "" = the default tenant): scopes online learning."""
    trace_context: tuple[tuple[str, str], ...] = ()
    """The W3C trace context (key, value) pairs of the request's span at the router; () = not traced."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))

    def to_pb(self) -> scheduler_pb2.GenerateRequest:
        pb = scheduler_pb2.GenerateRequest(request_id=self.request_id, prompt_token_ids=self.prompt_token_ids,
                                           sampling=self.sampling.to_pb(), stopping=self.stopping.to_pb(),
                                           tenant=self.tenant)
        if self.trace_context:
            pb.trace_context.update(self.trace_context)
        return pb

    @classmethod
    def from_pb(cls, pb: scheduler_pb2.GenerateRequest) -> GenerateRequest:
        """Convert as sent (an absent `sampling` is greedy with every default); validate before use."""
        sampling = SamplingParams.from_pb(pb.sampling) if pb.HasField("sampling") else SamplingParams()
        return cls(pb.request_id, tuple(pb.prompt_token_ids), sampling, StoppingCriteria.from_pb(pb.stopping),
                   pb.tenant, tuple(sorted(pb.trace_context.items())) if pb.trace_context else ())


MAX_TENANT_CHARS = 64
_TENANT_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-")


def is_valid_tenant(tenant: str) -> bool:
    """A tenant id is short and plain (it names files of the drafter's snapshots once encoded)."""
    return len(tenant) <= MAX_TENANT_CHARS and all(char in _TENANT_CHARS for char in tenant)


def validate_request(request: GenerateRequest, info: WorkerInfo) -> None:
    """Raise InvalidParameter unless `request` can run on the model `info` describes."""
    if not request.request_id:
        raise InvalidParameter("request_id", "must not be empty")
    if not is_valid_tenant(request.tenant):
        raise InvalidParameter("tenant", f"must be at most {MAX_TENANT_CHARS} of A-Z a-z 0-9 . _ : - ")
    prompt = request.prompt_token_ids
    if not prompt:
        raise InvalidParameter("prompt_token_ids", "must not be empty")
    if len(prompt) >= info.max_model_len:
        raise InvalidParameter("prompt_token_ids", f"has {len(prompt)} tokens; it must be shorter than the "
                                                   f"model's context of {info.max_model_len}")
    if not all(0 <= token_id < info.vocab_size for token_id in prompt):
        bad = next(t for t in prompt if not 0 <= t < info.vocab_size)
        raise InvalidParameter("prompt_token_ids", f"holds id {bad}, outside the vocabulary of {info.vocab_size}")
    validate(request.sampling, request.stopping, vocab_size=info.vocab_size)


class FinishReason(str, enum.Enum):
    """Why a request stopped (MindIE's names where it has them)."""

    UNSPECIFIED = "unspecified"
    EOS_TOKEN = "eos_token"
    LENGTH = "length"
    STOP_TOKEN = "stop_token"
    CONTEXT_LENGTH = "context_length"
    ERROR = "error"
    """This request alone failed; GenerateComplete.error_message says why."""


_FINISH_TO_PB = {
    FinishReason.UNSPECIFIED: scheduler_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.EOS_TOKEN: scheduler_pb2.FINISH_REASON_EOS_TOKEN,
    FinishReason.LENGTH: scheduler_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP_TOKEN: scheduler_pb2.FINISH_REASON_STOP_TOKEN,
    FinishReason.CONTEXT_LENGTH: scheduler_pb2.FINISH_REASON_CONTEXT_LENGTH,
    FinishReason.ERROR: scheduler_pb2.FINISH_REASON_ERROR,
}
_FINISH_FROM_PB = {pb: reason for reason, pb in _FINISH_TO_PB.items()}


@dataclass(slots=True)  # one per sequence per step: a frozen dataclass's __init__ costs ~5x a plain one's
class TokenChunk:
    """Newly accepted tokens (one or more per step)."""

    token_ids: tuple[int, ...]
    scores: tuple[float, ...]
    """Per token: the logit (greedy) or the log-probability (sampling)."""
    top_logprobs: tuple[TopLogprobs, ...] = ()
    """Per token, when num_top_logprobs > 0."""
    batch_size: int = 0
    """The largest batch the request has run in so far (0 = not reported)."""
    queue_wait_us: int = 0
    """Arrival to first scheduling."""
    prompt_logprobs: PromptLogprobs | None = None
    """Prompt tokens' log-probabilities computed this step, when asked for."""
    segment: str = ""
    """The segment kind the drafter last placed the request in ("" = not known)."""
    num_draft_tokens: int = 0
    """Draft tokens in the candidate tree verified this step (0 = no tree)."""
    draft_depth: int = 0
    """Depth of that tree's deepest draft (0 = no tree)."""
    num_accepted_draft_tokens: int = 0
    """The first this many token_ids are accepted drafts; the rest are the target model's own."""

    def __post_init__(self) -> None:  # runs for every token chunk: no loop over field names
        self.token_ids = as_tuple(self.token_ids)
        self.scores = as_tuple(self.scores)
        self.top_logprobs = as_tuple(self.top_logprobs)

    def to_pb(self) -> scheduler_pb2.GenerateResponse:
        # one per sequence per step: fields at their defaults are left out, not passed (each argument costs)
        chunk = scheduler_pb2.TokenChunk(token_ids=self.token_ids, scores=self.scores, batch_size=self.batch_size,
                                         queue_wait_us=self.queue_wait_us)
        if self.top_logprobs:
            chunk.top_logprobs.extend(t.to_pb() for t in self.top_logprobs)
        if self.prompt_logprobs is not None:
            chunk.prompt_logprobs.CopyFrom(self.prompt_logprobs.to_pb())
        if self.segment:
            chunk.segment = self.segment
        if self.num_draft_tokens:
            chunk.num_draft_tokens = self.num_draft_tokens
        if self.draft_depth:
            chunk.draft_depth = self.draft_depth
        if self.num_accepted_draft_tokens:
            chunk.num_accepted_draft_tokens = self.num_accepted_draft_tokens
        return scheduler_pb2.GenerateResponse(chunk=chunk)


@dataclass(frozen=True)
class GenerateComplete:
    """The successful end of a stream (or FinishReason.ERROR: this request alone failed)."""

    finish_reason: FinishReason
    num_prompt_tokens: int
    num_generated_tokens: int
    queue_wait_us: int = 0
    """Arrival to first scheduling."""
    first_token_us: int = 0
    """Arrival to the first token."""
    decode_us: int = 0
    """First token to the last."""
    max_batch_size: int = 0
    error_message: str = ""
    """Why, with FinishReason.ERROR."""
    num_cached_prompt_tokens: int = 0
    """Prompt tokens taken from the prefix cache at first scheduling (not computed)."""

    def to_pb(self) -> scheduler_pb2.GenerateResponse:
        complete = scheduler_pb2.GenerateComplete(
            finish_reason=_FINISH_TO_PB[self.finish_reason], num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens, queue_wait_us=self.queue_wait_us,
            first_token_us=self.first_token_us, decode_us=self.decode_us, max_batch_size=self.max_batch_size,
            error_message=self.error_message, num_cached_prompt_tokens=self.num_cached_prompt_tokens)
        return scheduler_pb2.GenerateResponse(complete=complete)


@dataclass(frozen=True)
class GenerateError:
    """The failed end of a stream. `code`: invalid_request, overloaded, unavailable, timeout, cancelled,
    internal."""

    code: str
    message: str

    def to_pb(self) -> scheduler_pb2.GenerateResponse:
        return scheduler_pb2.GenerateResponse(error=scheduler_pb2.GenerateError(code=self.code, message=self.message))


GenerateEvent = TokenChunk | GenerateComplete | GenerateError


def event_from_pb(pb: scheduler_pb2.GenerateResponse) -> GenerateEvent:
    kind = pb.WhichOneof("event")
    if kind == "chunk":
        c = pb.chunk
        prompt = PromptLogprobs.from_pb(c.prompt_logprobs) if c.HasField("prompt_logprobs") else None
        return TokenChunk(tuple(c.token_ids), tuple(c.scores), tuple(TopLogprobs.from_pb(t) for t in c.top_logprobs),
                          c.batch_size, c.queue_wait_us, prompt, c.segment, c.num_draft_tokens, c.draft_depth,
                          c.num_accepted_draft_tokens)
    if kind == "complete":
        d = pb.complete
        return GenerateComplete(_FINISH_FROM_PB.get(d.finish_reason, FinishReason.UNSPECIFIED), d.num_prompt_tokens,
                                d.num_generated_tokens, d.queue_wait_us, d.first_token_us, d.decode_us,
                                d.max_batch_size, d.error_message, d.num_cached_prompt_tokens)
    if kind == "error":
        return GenerateError(pb.error.code or "internal", pb.error.message)
    return GenerateError("internal", "the scheduler sent an empty event")


# GenerateStreams: many requests over one call, each step's events in one message.

@dataclass(frozen=True)
class StartStream:
    """Start `request` on a GenerateStreams call; with `timeout_s`, it ends with a "timeout" error once that long
    has passed since it arrived."""

    request: GenerateRequest
    timeout_s: float | None = None

    def to_pb(self) -> scheduler_pb2.StreamsRequest:
        timeout_ms = max(1, round(self.timeout_s * 1000)) if self.timeout_s else 0
        # packed_chunks: stream_events_from_pb, which every client of this module reads responses with, reads them
        return scheduler_pb2.StreamsRequest(start=scheduler_pb2.StartStream(request=self.request.to_pb(),
                                                                           timeout_ms=timeout_ms), packed_chunks=True)


@dataclass(frozen=True)
class CancelStream:
    """Abort the live request `request_id` of the call (its stream ends with "cancelled")."""

    request_id: str

    def to_pb(self) -> scheduler_pb2.StreamsRequest:
        return scheduler_pb2.StreamsRequest(cancel_request_id=self.request_id)


StreamAction = StartStream | CancelStream


def stream_action_from_pb(pb: scheduler_pb2.StreamsRequest) -> StreamAction | None:
    """The action a StreamsRequest carries; None for an empty one (a newer client's unknown action)."""
    kind = pb.WhichOneof("action")
    if kind == "start":
        timeout_ms = pb.start.timeout_ms
        return StartStream(GenerateRequest.from_pb(pb.start.request), timeout_ms / 1000 if timeout_ms else None)
    if kind == "cancel_request_id":
        return CancelStream(pb.cancel_request_id)
    return None


class MalformedEvents(ValueError):
    """A StreamsResponse whose packed chunks' columns do not fit together."""


def stream_events_to_pb(events: list[tuple[str, GenerateEvent]], packed: bool = False
                        ) -> scheduler_pb2.StreamsResponse:
    """(request_id, event) pairs, in order, as one StreamsResponse. With `packed` (for a client that reads them:
    StreamsRequest.packed_chunks), token chunks without log-probabilities go as PackedChunks columns, which cost
    a fraction of a message each; a request's events from its first other one on go one message each, after
    them, so that each request's events stay in order. A single event goes one message (2 us less than packed)."""
    response = scheduler_pb2.StreamsResponse()
    add = response.events.add
    if not packed or len(events) < 2:
        for request_id, event in events:
            add(request_id=request_id, event=event.to_pb())
        return response
    request_ids, num_token_ids, token_ids, scores, batch_sizes, queue_wait_us = [], [], [], [], [], []
    segments, num_draft_tokens, draft_depths, num_accepted = [], [], [], []
    unpacked: set[str] = set()  # requests with an event in `events` already
    for request_id, event in events:  # one loop of appends, as the packed step's
        if (type(event) is TokenChunk and not event.top_logprobs and event.prompt_logprobs is None
                and len(event.scores) == len(event.token_ids) and request_id not in unpacked):
            request_ids.append(request_id)
            num_token_ids.append(len(event.token_ids))
            token_ids += event.token_ids
            scores += event.scores
            batch_sizes.append(event.batch_size)
            queue_wait_us.append(event.queue_wait_us)
            segments.append(event.segment)
            num_draft_tokens.append(event.num_draft_tokens)
            draft_depths.append(event.draft_depth)
            num_accepted.append(event.num_accepted_draft_tokens)
        else:
            unpacked.add(request_id)
            add(request_id=request_id, event=event.to_pb())
    if request_ids:
        response.packed_chunks.CopyFrom(scheduler_pb2.PackedChunks(
            request_ids=request_ids, num_token_ids=num_token_ids, token_ids=token_ids, scores=scores,
            batch_sizes=unless_default(batch_sizes), queue_wait_us=unless_default(queue_wait_us),
            segments=unless_default(segments), num_draft_tokens=unless_default(num_draft_tokens),
            draft_depths=unless_default(draft_depths), num_accepted_draft_tokens=unless_default(num_accepted)))
    return response


def stream_events_from_pb(pb: scheduler_pb2.StreamsResponse) -> list[tuple[str, GenerateEvent]]:
    """The (request_id, event) pairs of a StreamsResponse: its packed chunks, then its events. Raises
    MalformedEvents for packed columns that do not fit together."""
    events = _unpack_chunks(pb.packed_chunks) if pb.HasField("packed_chunks") else []
    events += [(e.request_id, event_from_pb(e.event)) for e in pb.events]
    return events


def _unpack_chunks(pb: scheduler_pb2.PackedChunks) -> list[tuple[str, TokenChunk]]:
    request_ids = pb.request_ids[:]
    num_chunks = len(request_ids)
    lengths, token_ids, scores = pb.num_token_ids[:], tuple(pb.token_ids), tuple(pb.scores)
    if len(lengths) != num_chunks:
        raise MalformedEvents(f"{len(lengths)} num_token_ids for {num_chunks} packed chunks")
    if sum(lengths) != len(token_ids) or len(scores) != len(token_ids):
        raise MalformedEvents(f"{len(token_ids)} token_ids and {len(scores)} scores, their lengths sum to "
                              f"{sum(lengths)}")
    columns = [per_entry(column, num_chunks, name, default, MalformedEvents) for column, name, default in (
        (pb.batch_sizes, "batch_sizes", 0), (pb.queue_wait_us, "queue_wait_us", 0), (pb.segments, "segments", ""),
        (pb.num_draft_tokens, "num_draft_tokens", 0), (pb.draft_depths, "draft_depths", 0),
        (pb.num_accepted_draft_tokens, "num_accepted_draft_tokens", 0))]
    events, end = [], 0
    for request_id, length, batch_size, queue_wait, segment, num_draft, depth, num_accepted in zip(
            request_ids, lengths, *columns):
        start, end = end, end + length
        events.append((request_id, TokenChunk(token_ids[start:end], scores[start:end], (), batch_size, queue_wait,
                                              None, segment, num_draft, depth, num_accepted)))
    return events
