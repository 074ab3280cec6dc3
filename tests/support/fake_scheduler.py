"""An in-process fake Scheduler gRPC service for router tests.

It answers every Generate with the same deterministic tokens (a fixed text
encoded by the given tokenizer, two tokens per chunk) and records what it was
sent (as the contract's GenerateRequest) and which calls were cancelled. Events
are built from the contract types (protos/segserve/v1/generate.py) and sent with
their to_pb. Words in the prompt pick a behaviour: SLOW (a long stream, 50 ms
per chunk), WAIT (1 s queued before the first token), FAIL_MID (an error event
after the first chunks), WORKER_ERROR (FinishReason.ERROR after the first chunk:
that request alone failed in the worker), OVERLOAD (RESOURCE_EXHAUSTED at once),
REJECT (an invalid_request error event at once). A request with
num_prompt_logprobs first gets its prompt's logprobs (PROMPT_LOGPROB and
alternatives), in two chunks without generated tokens. GetStats reports the streams under
way as running; is_refusing makes every Generate a full queue.

`ScriptedClient` is the in-process double for tests below the gRPC wire: a SchedulerApi whose every request
streams the same scripted events.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent import futures

import grpc

from protos.segserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from protos.segserve.v1.generate import (
    FinishReason,
    GenerateComplete,
    GenerateError,
    GenerateEvent,
    GenerateRequest,
    TokenChunk,
)
from protos.segserve.v1.info import Health, WorkerInfo
from protos.segserve.v1.step_result import PromptLogprobs, TopLogprobs
from router.scheduler_client import SchedulerApi, SchedulerLoad
from router.scheduler_streams import PumpStream, RequestStream

OUTPUT_TEXT = "Hello 🙂 東京 Übermäßig!\n    def add(a, b):\n        return a + b\n"
GREEDY_LOGIT = 7.0  # what the fake reports as the score of a greedy token (a logit, not a logprob)
TOP_LOGPROB = -0.25  # the chosen token's logprob in the top list
WORKER_ERROR_MESSAGE = "non-finite logits in this sequence"


FAKE_SEGMENT = "code"
"""The segment kind every chunk of the fake reports."""


def prompt_logprob(position: int) -> float:
    """The fake's logprob of the prompt token at `position` (>= 1)."""
    return -1.0 - position / 100


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, tokenizer, model_name: str = "tiny-test", max_model_len: int = 256,
                 is_refusing: bool = False) -> None:
        self.tokenizer = tokenizer
        self.is_refusing = is_refusing
        """Answer every Generate with RESOURCE_EXHAUSTED (a full queue)."""
        self.num_streaming = 0
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.output_ids: list[int] = tokenizer(OUTPUT_TEXT, add_special_tokens=False).input_ids
        self.eos_token_id: int = tokenizer.eos_token_id
        self.requests: list[GenerateRequest] = []
        self.cancelled: list[str] = []
        self.completed: list[str] = []
        self._lock = threading.Lock()

    def expected_ids(self, max_tokens: int) -> tuple[list[int], FinishReason]:
        """(tokens, finish reason) a plain request with this budget gets."""
        if max_tokens < len(self.output_ids) + 1:
            return self.output_ids[:max_tokens], FinishReason.LENGTH
        return self.output_ids + [self.eos_token_id], FinishReason.EOS_TOKEN

    def Generate(self, pb, context):
        request = GenerateRequest.from_pb(pb)
        with self._lock:
            self.requests.append(request)
        prompt = self.tokenizer.decode(request.prompt_token_ids)
        if "OVERLOAD" in prompt or self.is_refusing:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full")
        if "REJECT" in prompt:
            yield GenerateError("invalid_request", "prompt rejected by the scheduler").to_pb()
            return
        arrived_s = time.monotonic()
        with self._lock:
            self.num_streaming += 1
        state = {"is_finished": False}
        context.add_callback(lambda: self._on_end(request.request_id, state))
        budget = request.stopping.max_tokens
        if "SLOW" in prompt:
            tokens = (self.output_ids * (budget // len(self.output_ids) + 1))[:budget]
            finish = FinishReason.LENGTH
        else:
            tokens, finish = self.expected_ids(budget)
        if "WAIT" in prompt:
            time.sleep(1.0)
        scheduled_s = first_token_s = time.monotonic()
        queue_wait_us = _us(arrived_s, scheduled_s)
        if request.sampling.num_prompt_logprobs is not None:
            yield from self._prompt_chunks(request, queue_wait_us)
        for start in range(0, len(tokens), 2):
            if "SLOW" in prompt:
                time.sleep(0.05)
            if not context.is_active():
                return
            if start == 0:
                first_token_s = time.monotonic()
            yield self._chunk(tokens[start:start + 2], request, queue_wait_us).to_pb()
            if "FAIL_MID" in prompt and start >= 2:
                state["is_finished"] = True
                yield GenerateError("internal", "worker crashed").to_pb()
                return
            if "WORKER_ERROR" in prompt:
                tokens, finish = tokens[:start + 2], FinishReason.ERROR
                break
        state["is_finished"] = True
        yield GenerateComplete(
            finish, num_prompt_tokens=len(request.prompt_token_ids), num_generated_tokens=len(tokens),
            queue_wait_us=queue_wait_us, first_token_us=_us(arrived_s, first_token_s),
            decode_us=_us(first_token_s, time.monotonic()), max_batch_size=1,  # each request runs alone
            error_message=WORKER_ERROR_MESSAGE if finish is FinishReason.ERROR else "").to_pb()

    def GetStats(self, request, context) -> scheduler_pb2.SchedulerStats:
        """num_running: the streams under way; the rest zeros."""
        return scheduler_pb2.SchedulerStats(num_running=self.num_streaming, num_total_kv_blocks=64)

    def _on_end(self, request_id: str, state: dict) -> None:
        with self._lock:
            self.num_streaming -= 1
        with self._lock:
            (self.completed if state["is_finished"] else self.cancelled).append(request_id)

    def _alternatives(self, token_id: int, num: int, best: float) -> TopLogprobs:
        vocab = len(self.tokenizer)
        ids = [token_id] + [(token_id + k) % vocab for k in range(1, num)]
        return TopLogprobs(tuple(ids), tuple(best - k for k in range(len(ids))))

    def _prompt_chunks(self, request: GenerateRequest, queue_wait_us: int):
        """The prompt's logprobs (positions 1.. of the prompt), split over two chunks without tokens."""
        prompt, num = request.prompt_token_ids, request.sampling.num_prompt_logprobs
        middle = max(1, len(prompt) // 2)
        for start, end in ((1, middle), (middle, len(prompt))):
            if start >= end:
                continue
            logprobs = tuple(prompt_logprob(p) for p in range(start, end))
            top = tuple(self._alternatives(prompt[p], num, 0.0) for p in range(start, end)) if num else ()
            yield TokenChunk((), (), batch_size=1, queue_wait_us=queue_wait_us,
                             prompt_logprobs=PromptLogprobs(start, logprobs, top)).to_pb()

    def _chunk(self, token_ids: list[int], request: GenerateRequest, queue_wait_us: int = 0) -> TokenChunk:
        sampling = request.sampling
        scores = [TOP_LOGPROB if sampling.do_sample else GREEDY_LOGIT] * len(token_ids)
        top = [self._alternatives(t, sampling.num_top_logprobs, TOP_LOGPROB) for t in token_ids] \
            if sampling.num_top_logprobs else []
        # Each chunk is a step whose tree of 4 drafts (depth 2) gave all but its last token.
        return TokenChunk(tuple(token_ids), tuple(scores), tuple(top), batch_size=1, queue_wait_us=queue_wait_us,
                          segment=FAKE_SEGMENT, num_draft_tokens=4, draft_depth=2,
                          num_accepted_draft_tokens=len(token_ids) - 1)

    def GetInfo(self, request, context):
        info = WorkerInfo(self.model_name, num_kv_blocks=64, block_size=16, max_model_len=self.max_model_len,
                          vocab_size=len(self.tokenizer), eos_token_ids=(self.eos_token_id,), device="cpu",
                          dtype="float32")
        return scheduler_pb2.SchedulerInfo(worker=info.to_pb())

    def Health(self, request, context) -> common_pb2.HealthResponse:
        return Health(True).to_pb()

    def wait_cancelled(self, request_id_prefix: str = "", timeout_s: float = 5.0) -> list[str]:
        """Cancelled request ids (with the prefix), waiting up to timeout_s for at least one."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                found = [r for r in self.cancelled if r.startswith(request_id_prefix)]
            if found:
                return found
            time.sleep(0.02)
        return []


def _us(start_s: float, end_s: float) -> int:
    return round((end_s - start_s) * 1e6)


def start_fake_scheduler(tokenizer, port: int = 0, **kwargs) -> tuple[grpc.Server, FakeScheduler, int]:
    """Serve a FakeScheduler on localhost's `port` (0: a free one): (server, fake, port)."""
    fake = FakeScheduler(tokenizer, **kwargs)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, fake, port


class ScriptedClient(SchedulerApi):
    """A scheduler client whose every request gets `events`: all at once (the consumer fell behind), or each
    `delay_s` after the previous one."""

    def __init__(self, events: Sequence[GenerateEvent], delay_s: float = 0.0) -> None:
        self.events = list(events)
        self.delay_s = delay_s

    def open(self, request: GenerateRequest, timeout_s: float | None = None) -> RequestStream:
        return PumpStream(self._script(), request.request_id)

    async def _script(self) -> AsyncIterator[GenerateEvent]:
        for event in self.events:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            yield event

    async def health(self, timeout_s: float = 2.0) -> Health:
        return Health(True, "")

    async def get_stats(self, timeout_s: float = 2.0) -> SchedulerLoad:
        raise ConnectionError("a scripted client has no stats")

    async def close(self) -> None:
        pass
