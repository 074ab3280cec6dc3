"""The router's gRPC client of the Scheduler service: the one place protobuf is touched.

Requests go out as `GenerateParams` + prompt token ids; the response stream comes
back as router-side dataclasses (`TokenChunk`, `GenerateComplete`,
`GenerateFailure`). gRPC failures become a `GenerateFailure` too, so callers have
a single error path. Closing the `generate` iterator before the stream ended
(the HTTP client went away) cancels the gRPC call, which is how cancellation
reaches the scheduler.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from protos.segserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2


class FinishReason(str, enum.Enum):
    """Why a request stopped (the names MindIE-style APIs report)."""

    UNSPECIFIED = "unspecified"
    EOS_TOKEN = "eos_token"
    LENGTH = "length"
    STOP_TOKEN = "stop_token"
    CONTEXT_LENGTH = "context_length"


_FINISH_FROM_PB = {
    scheduler_pb2.FINISH_REASON_EOS_TOKEN: FinishReason.EOS_TOKEN,
    scheduler_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    scheduler_pb2.FINISH_REASON_STOP_TOKEN: FinishReason.STOP_TOKEN,
    scheduler_pb2.FINISH_REASON_CONTEXT_LENGTH: FinishReason.CONTEXT_LENGTH,
}

# gRPC status -> the failure codes the router maps to HTTP statuses (errors.py).
_FAILURE_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_request",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.CANCELLED: "cancelled",
}


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the served model, from the scheduler's GetInfo."""

    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class GenerateParams:
    """Sampling and stopping of one request, with the proto's "off" defaults."""

    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    num_top_logprobs: int = 0
    watermark: bool = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True)
class TokenChunk:
    """Newly accepted tokens. `top_logprobs[i]` lists (token id, logprob), most likely first."""

    token_ids: list[int]
    scores: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    batch_size: int = 0
    """The largest batch the request has run in so far (0 = not reported)."""
    queue_wait_us: int = 0
    """Arrival to first scheduling, as the scheduler measured it."""


@dataclass(frozen=True)
class GenerateComplete:
    """The successful end of a stream."""

    finish_reason: FinishReason
    num_prompt_tokens: int
    num_generated_tokens: int
    queue_wait_us: int = 0
    first_token_us: int = 0
    decode_us: int = 0
    max_batch_size: int = 0


@dataclass(frozen=True)
class GenerateFailure:
    """The failed end of a stream. `code`: invalid_request, overloaded, unavailable, timeout, internal, ..."""

    code: str
    message: str


GenerateEvent = TokenChunk | GenerateComplete | GenerateFailure


@dataclass(frozen=True)
class SpecTotals:
    """Speculative decoding since the scheduler started (all segment kinds together)."""

    num_drafts: int
    """Sequence-steps that verified a non-empty candidate tree."""
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_by_position: tuple[int, ...]
    """[p]: drafts whose accepted path reached depth p + 1."""


@dataclass(frozen=True)
class SchedulerLoad:
    """The scheduler's GetStats: current load, and counters since it started."""

    num_running: int
    num_waiting: int
    num_used_kv_blocks: int
    num_total_kv_blocks: int
    num_preemptions: int
    spec: SpecTotals


def to_pb(request_id: str, prompt_token_ids: list[int], params: GenerateParams) -> scheduler_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(
        do_sample=params.do_sample, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
        typical_p=params.typical_p, repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
        num_top_logprobs=params.num_top_logprobs, watermark=params.watermark,
    )
    if params.seed is not None:
        sampling.seed = params.seed
    stopping = common_pb2.StoppingCriteria(
        max_new_tokens=params.max_new_tokens, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos
    )
    return scheduler_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling, stopping=stopping
    )


def from_pb(response: scheduler_pb2.GenerateResponse) -> GenerateEvent:
    kind = response.WhichOneof("event")
    if kind == "chunk":
        chunk = response.chunk
        top = [list(zip(t.token_ids, t.logprobs)) for t in chunk.top_logprobs]
        return TokenChunk(token_ids=list(chunk.token_ids), scores=list(chunk.scores), top_logprobs=top,
                          batch_size=chunk.batch_size, queue_wait_us=chunk.queue_wait_us)
    if kind == "complete":
        done = response.complete
        return GenerateComplete(
            finish_reason=_FINISH_FROM_PB.get(done.finish_reason, FinishReason.UNSPECIFIED),
            num_prompt_tokens=done.num_prompt_tokens, num_generated_tokens=done.num_generated_tokens,
            queue_wait_us=done.queue_wait_us, first_token_us=done.first_token_us, decode_us=done.decode_us,
            max_batch_size=done.max_batch_size,
        )
    if kind == "error":
        return GenerateFailure(code=response.error.code or "internal", message=response.error.message)
    return GenerateFailure(code="internal", message="the scheduler sent an empty event")


def load_from_pb(stats: scheduler_pb2.SchedulerStats) -> SchedulerLoad:
    spec = SpecTotals(stats.spec.num_verified, stats.spec.num_draft_tokens, stats.spec.num_accepted_tokens,
                      tuple(stats.spec.num_accepted_by_depth))
    return SchedulerLoad(stats.num_running, stats.num_waiting, stats.num_used_kv_blocks, stats.num_total_kv_blocks,
                         stats.num_preemptions, spec)


def info_from_pb(worker: worker_pb2.WorkerInfo) -> ModelInfo:
    return ModelInfo(
        model_name=worker.model_name, max_model_len=worker.max_model_len, vocab_size=worker.vocab_size,
        eos_token_ids=tuple(worker.eos_token_ids),
    )


class SchedulerClient:
    """Async client of one scheduler. The channel is opened lazily in the running event loop."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.SchedulerStub | None = None

    def _get_stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.address)
            self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        return self._stub

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: GenerateParams, timeout_s: float | None = None
    ) -> AsyncIterator[GenerateEvent]:
        """Stream one request's events; the last one is a GenerateComplete or a GenerateFailure."""
        call = self._get_stub().Generate(to_pb(request_id, prompt_token_ids, params), timeout=timeout_s or None)
        try:
            terminal: GenerateEvent | None = None
            # Read to the end of the stream before yielding the terminal event: a
            # consumer that stops right after it must not cancel a finished call.
            async for response in call:
                event = from_pb(response)
                if terminal is not None:
                    continue
                if isinstance(event, TokenChunk):
                    yield event
                else:
                    terminal = event
            yield terminal or GenerateFailure("internal", "the scheduler ended the stream without a result")
        except grpc.aio.AioRpcError as exc:
            code = _FAILURE_CODES.get(exc.code(), "internal")
            yield GenerateFailure(code, f"scheduler: {exc.details() or exc.code().name}")
        finally:
            if not call.done():
                call.cancel()

    async def get_info(self, timeout_s: float = 5.0) -> ModelInfo:
        """The served model's facts; raises grpc.aio.AioRpcError when the scheduler does not answer."""
        info = await self._get_stub().GetInfo(scheduler_pb2.SchedulerInfoRequest(), timeout=timeout_s)
        return info_from_pb(info.worker)

    async def get_stats(self, timeout_s: float = 2.0) -> SchedulerLoad:
        """Current load and counters; raises grpc.aio.AioRpcError when the scheduler does not answer."""
        return load_from_pb(await self._get_stub().GetStats(scheduler_pb2.StatsRequest(), timeout=timeout_s))

    async def health(self, timeout_s: float = 2.0) -> tuple[bool, str]:
        """(ready, detail); an unreachable scheduler is simply not ready."""
        try:
            reply = await self._get_stub().Health(worker_pb2.HealthRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return False, f"scheduler unreachable: {exc.code().name}"
        return reply.ready, reply.detail

    async def wait_ready(self, timeout_s: float, retry_interval_s: float = 0.5) -> ModelInfo:
        """Retry GetInfo until it answers; raise TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await self.get_info(timeout_s=max(0.1, min(5.0, deadline - time.monotonic())))
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() + retry_interval_s >= deadline:
                    raise TimeoutError(
                        f"scheduler at {self.address} did not answer GetInfo within {timeout_s:.0f}s "
                        f"(last error: {exc.code().name})"
                    ) from exc
            await asyncio.sleep(retry_interval_s)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None
