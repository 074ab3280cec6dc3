"""One request's token stream turned into text deltas, shared by every endpoint.

In: the scheduler's event stream (the contract's TokenChunks, then a
GenerateComplete or a GenerateError). Out: `Delta`s (text, the token ids behind
it, per-token logprobs, prompt logprobs when asked for, and on the last one the
finish reason and usage), a `GenerateError`, or `KEEPALIVE` when nothing arrived
for a while (so
a streaming endpoint can send an SSE comment). The events are taken straight from
the request's stream (`SchedulerApi.open`, scheduler_client.py), with the
keep-alive as the wait's timeout: token chunks that arrived while the consumer was
busy come in one take and are merged into one Delta; closing the iterator (client
gone) closes the stream, which cancels the request at the scheduler. The request's
`StreamObserver`s (metrics, the gRPC API's step sizes) are told what is taken, as it is.

`OPENAI_FINISH_REASONS` is the one map of the contract's FinishReason to OpenAI's
`finish_reason` (also vLLM's `finished_reason` metric label, metrics.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from protos.segserve.v1.generate import (
    FinishReason,
    GenerateComplete,
    GenerateError,
    GenerateEvent,
    GenerateRequest,
    TokenChunk,
)
from protos.segserve.v1.step_result import PromptLogprobs
from protos.segserve.v1.usage import Usage
from router.detokenizer import IncrementalDetokenizer
from router.scheduler_client import SchedulerApi
from router.scheduler_streams import StreamObserver
from router.speculation import Speculation, StepQueue

logger = logging.getLogger(__name__)

OPENAI_FINISH_REASONS = {
    FinishReason.EOS_TOKEN: "stop",
    FinishReason.STOP_TOKEN: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT_LENGTH: "length",
    FinishReason.UNSPECIFIED: "stop",
    FinishReason.ERROR: "error",  # this request alone failed in the worker (serving.py: the stream's error event)
}


class KeepAlive:
    """Nothing happened for a keep-alive interval."""


KEEPALIVE = KeepAlive()


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely alternatives (id, logprob)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Delta:
    """Text that became final, with its tokens' logprobs; the last delta has finish_reason and usage."""

    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: tuple[int, ...] = ()
    """The generated token ids this delta covers (EOS included), in order."""
    prompt_logprobs: PromptLogprobs | None = None
    """Prompt tokens' log-probabilities that arrived with this delta (echo with logprobs)."""
    finish_reason: str | None = None
    usage: Usage | None = None
    num_tokens: int = 0
    """Tokens this delta covers (an EOS token counts, though its text is empty)."""
    received_s: float = field(default_factory=time.monotonic)
    """When the router read these tokens off the scheduler's stream (time.monotonic)."""
    complete: GenerateComplete | None = None
    """On the last delta: the scheduler's own account (raw finish reason, timings, batch size)."""
    index: int = 0
    """Which of the request's n choices this delta belongs to (choices.py sets it)."""
    batch_size: int = 0
    """The largest batch the request has run in so far, per the scheduler (0 = not reported)."""
    queue_wait_us: int = 0
    """Arrival to first scheduling, per the scheduler."""
    speculation: Speculation | None = None
    """Each token's text, origin and step, when the job asked for them (include_speculation)."""


@dataclass(frozen=True)
class GenerationJob:
    """Everything one request sends to the scheduler and needs to read the answer."""

    request: GenerateRequest
    """What goes to the scheduler, already validated (protos' validate_request)."""
    eos_token_ids: frozenset[int]
    num_top_logprobs: int | None = None
    """Alternatives per token in the response; None = no logprobs."""
    timeout_s: float | None = None
    include_speculation: bool = False
    """Give each Delta its Speculation (speculation.py): per-token text, origin and step."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.request.prompt_token_ids


def to_logprobs(chunk: TokenChunk, num_top: int) -> list[TokenLogprob]:
    """Per token: its logprob (from the top list when present: under greedy decoding the score is a logit)."""
    out = []
    for i, token_id in enumerate(chunk.token_ids):
        top = list(zip(chunk.top_logprobs[i].token_ids, chunk.top_logprobs[i].logprobs)) \
            if i < len(chunk.top_logprobs) else []
        logprob = next((lp for tid, lp in top if tid == token_id), None)
        if logprob is None:
            logprob = chunk.scores[i] if i < len(chunk.scores) else float("nan")
        out.append(TokenLogprob(token_id, logprob, top[:num_top]))
    return out


def finish_delta(done: GenerateComplete, job: GenerationJob, text: str) -> Delta:
    usage = Usage(done.num_prompt_tokens or len(job.prompt_token_ids), done.num_generated_tokens,
                  done.num_cached_prompt_tokens)
    return Delta(text=text, finish_reason=OPENAI_FINISH_REASONS[done.finish_reason], usage=usage, complete=done)


async def generate_deltas(
    client: SchedulerApi,
    job: GenerationJob,
    detokenizer: IncrementalDetokenizer,
    keepalive_s: float | None = None,
    observers: Sequence[StreamObserver] = (),
) -> AsyncIterator[Delta | GenerateError | KeepAlive]:
    """Stream one request; ends after the Delta carrying finish_reason or after a GenerateError.

    Token chunks that piled up while the consumer was busy (a slow client, a
    loaded router) come out as one Delta, as vLLM merges the outputs of a
    request its client has not read yet: one detokenization and one SSE event
    for all of them. `observers` see every event as it is taken, before the merge.
    """
    stream = client.open(job.request, job.timeout_s)
    if observers:
        now_s = time.monotonic()
        for observer in observers:
            observer.opened(now_s)
    steps = StepQueue() if job.include_speculation else None
    try:
        while True:
            try:
                events = await stream.take(keepalive_s)
            except Exception as exc:  # a bug, not a scheduler answer: still end the stream
                logger.exception("generation %s failed", job.request_id)
                yield GenerateError("internal", f"router: {type(exc).__name__}: {exc}")
                return
            if not events:
                yield KEEPALIVE
                continue
            if observers:
                now_s = time.monotonic()
                for observer in observers:
                    observer.took(events, now_s)
            if steps is not None:
                steps.note(events)
            for event in merge_chunks(events):
                if isinstance(event, TokenChunk):
                    yield _chunk_delta(event, job, detokenizer, steps)
                elif isinstance(event, GenerateComplete):
                    yield finish_delta(event, job, detokenizer.flush())
                    return
                else:
                    yield event
                    return
    finally:
        try:
            await stream.close()
        finally:
            for observer in observers:
                observer.closed()


def _chunk_delta(chunk: TokenChunk, job: GenerationJob, detokenizer: IncrementalDetokenizer,
                 steps: StepQueue | None = None) -> Delta:
    eos = job.eos_token_ids
    token_ids = chunk.token_ids
    logprobs = [] if job.num_top_logprobs is None else to_logprobs(chunk, job.num_top_logprobs)
    speculation = None
    if steps is None:
        text_ids = [t for t in token_ids if t not in eos] if eos.intersection(token_ids) else token_ids
        text = detokenizer.add(text_ids)
    else:  # token by token, so that each token's text is known (an EOS token's is "")
        token_texts = tuple("" if t in eos else detokenizer.add((t,)) for t in token_ids)
        text = "".join(token_texts)
        speculation = Speculation(token_texts, steps.take(len(token_ids)))
    return Delta(text=text, logprobs=logprobs, token_ids=token_ids, prompt_logprobs=chunk.prompt_logprobs,
                 num_tokens=len(token_ids), batch_size=chunk.batch_size, queue_wait_us=chunk.queue_wait_us,
                 speculation=speculation)


def merge_chunks(events: list[GenerateEvent]) -> list[GenerateEvent]:
    """`events` with each run of consecutive TokenChunks joined into one (tokens, scores and top
    logprobs in order; batch size and queue wait of the newest chunk that reported them). A chunk
    with prompt logprobs stays apart: they are placed by their own chunk."""
    merged: list[GenerateEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if (isinstance(event, TokenChunk) and isinstance(last, TokenChunk) and event.prompt_logprobs is None
                and last.prompt_logprobs is None):
            newest = event if event.batch_size else last  # 0 = not reported
            merged[-1] = TokenChunk(last.token_ids + event.token_ids, last.scores + event.scores,
                                    last.top_logprobs + event.top_logprobs, newest.batch_size, newest.queue_wait_us)
        else:
            merged.append(event)
    return merged
