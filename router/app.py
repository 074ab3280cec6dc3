"""The OpenAI-compatible HTTP app: validate, tokenize, call the scheduler, stream text back.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE when `stream`),
GET /v1/models, GET /v1/models/{model}, the MindIE-style
/v2/models/{model}/generate[_stream] routes (v2.py), and GET /health, /ready,
/metrics with API keys and the body limit (ops.py). A request's life: the
pydantic body is checked, the prompt tokenized (prompts.py), the budget fixed,
and `generate_deltas` drives the gRPC stream (one per choice when n > 1, merged
by choices.py; stop strings cut by stop.py); a renderer (responses.py) shapes
the output. A client that goes away, streamed or not, cancels the gRPC call.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from router.choices import merge_choices
from router.config import RouterConfig
from router.detokenizer import IncrementalDetokenizer, TokenTexts
from router.errors import ERROR_RESPONSES, bad_request, from_failure, install_error_handlers, model_not_found
from router.generation import KEEPALIVE, Delta, GenerationJob, KeepAlive, generate_deltas
from router.ops import install_ops
from router.reflow import RecorderConfig, open_recorder
from router.reflow.gateway import STATE_KEY, ReflowCollector, ReflowMiddleware, record_deltas
from router.prompts import chat_prompt_ids, completion_prompt_ids, max_new_tokens
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.responses import ChatRenderer, CompletionRenderer
from router.scheduler_client import GenerateFailure, ModelInfo, SchedulerClient
from router.stop import stop_at_strings
from router.v2 import install_v2_routes

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",
}
# OpenAPI: a 200 is either a JSON body or, with `stream`, SSE events.
STREAM_OR_JSON = {200: {"content": {"application/json": {}, "text/event-stream": {"schema": {
    "type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}}}}}
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client closed the connection before the answer was ready."""


def sse_data(payload: BaseModel | dict) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it (and raising ClientDisconnected) if the client goes away first."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ClientDisconnected()
    return work.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def sse_events(first, events: AsyncIterator, renderer, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: the renderer's chunks, keep-alive comments, an error event if any, then its end marker."""
    async with contextlib.aclosing(events):
        for chunk in renderer.start():
            yield sse_data(chunk)
        event = first
        while event is not None:
            if isinstance(event, KeepAlive):
                yield ": keep-alive\n\n"
            elif isinstance(event, GenerateFailure):
                yield sse_data(from_failure(event).body())
                break
            else:
                chunk = renderer.chunk(event)
                if chunk is not None:
                    yield sse_data(chunk)
                # With n choices, each ends with a finish_reason; the last one carries the usage.
                if event.finish_reason is not None and include_usage and event.usage is not None:
                    yield sse_data(renderer.usage_chunk(event.usage))
            event = await anext(events, None)
        if renderer.stream_done is not None:
            yield f"data: {renderer.stream_done}\n\n"


async def collect(events: AsyncIterator) -> list[Delta]:
    """All deltas of a non-streamed request; a failure becomes the HTTP error."""
    deltas = []
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, GenerateFailure):
                raise from_failure(event)
            deltas.append(event)
    return deltas


def create_app(config: RouterConfig, client: SchedulerClient, tokenizer, model_info: ModelInfo) -> FastAPI:
    """The router's FastAPI app, serving `model_info`'s model through `client`."""
    served_name = config.served_model_name or model_info.model_name
    created = int(time.time())
    token_texts = TokenTexts(tokenizer)
    eos_token_ids = frozenset(model_info.eos_token_ids)

    recorder = None
    if config.reflow_queue_url:
        recorder = open_recorder(RecorderConfig(queue_url=config.reflow_queue_url, spill_dir=config.reflow_spill_dir))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await client.close()
        if recorder is not None:
            recorder.close()  # flushes what is still in memory

    app = FastAPI(title="segserve router", lifespan=lifespan, responses=ERROR_RESPONSES)
    install_error_handlers(app)
    if recorder is not None:  # added before the guard, so it runs inside it
        app.add_middleware(ReflowMiddleware, recorder=recorder, service_id=served_name)
    client = install_ops(app, config, client, served_name)
    if recorder is not None:
        app.state.metrics_registry.register(ReflowCollector(recorder))

    def check_model(model: str | None) -> None:
        if model is not None and model != served_name:
            raise model_not_found(model)

    def job_events(job: GenerationJob, keepalive_s: float | None) -> AsyncIterator:
        return generate_deltas(client, job, IncrementalDetokenizer(tokenizer, job.prompt_token_ids), keepalive_s)

    async def respond(request: Request, job: GenerationJob, renderer, stream: bool, include_usage: bool) -> Response:
        """Run `job`, answering in `renderer`'s shapes: one JSON body, or SSE when `stream`."""
        return await respond_events(request, functools.partial(job_events, job), renderer, stream, include_usage)

    async def respond_events(request: Request, open_events: Callable[[float | None], AsyncIterator], renderer,
                             stream: bool, include_usage: bool) -> Response:
        """Like `respond`, for any event stream: `open_events(keepalive_s)` starts the generation."""
        recording = getattr(request.state, STATE_KEY, None)
        try:
            if not stream:
                deltas = await until_disconnected(request, collect(record_deltas(open_events(None), recording)))
                return JSONResponse(renderer.response(deltas).model_dump())
            events = record_deltas(open_events(config.keepalive_interval_s), recording)
            # Wait for the first event before answering, so that a request refused
            # at once (overloaded, invalid) gets a real HTTP status, not an SSE error.
            first = await until_disconnected(request, anext(events))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if isinstance(first, GenerateFailure):
            raise from_failure(first)
        # The background close covers a client that left before the body started.
        return StreamingResponse(sse_events(first, events, renderer, include_usage), headers=SSE_HEADERS,
                                 background=BackgroundTask(events.aclose))

    async def serve(request: Request, body, prompt_ids: list[int], kind: str) -> Response:
        is_chat = kind == "chat"
        budget = max_new_tokens(
            body.requested_max_tokens, len(prompt_ids), model_info.max_model_len, config.default_max_tokens,
            "messages" if is_chat else "prompt",
            "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
        )
        if body.top_k is not None and body.top_k >= model_info.vocab_size:
            raise bad_request(f"top_k must be below the vocabulary size {model_info.vocab_size}", "top_k")
        request_id = f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}"
        num_choices, stops = body.num_choices, body.stop_strings
        jobs = [
            GenerationJob(
                # With one choice the scheduler's request id is the response id.
                request_id=request_id if num_choices == 1 else f"{request_id}-{index}", prompt_token_ids=prompt_ids,
                params=body.to_params(budget, index), eos_token_ids=eos_token_ids,
                num_top_logprobs=body.num_top_logprobs, timeout_s=config.request_timeout_s or None,
            )
            for index in range(num_choices)
        ]
        renderer = (ChatRenderer if is_chat else CompletionRenderer)(
            request_id, int(time.time()), served_name, token_texts, body.num_top_logprobs is not None, num_choices
        )

        def choice_events(job: GenerationJob, keepalive_s: float | None) -> AsyncIterator:
            events = job_events(job, keepalive_s)
            return stop_at_strings(events, stops, len(prompt_ids)) if stops else events

        def open_events(keepalive_s: float | None) -> AsyncIterator:
            if num_choices == 1:
                return choice_events(jobs[0], keepalive_s)
            return merge_choices([choice_events(job, None) for job in jobs], keepalive_s)

        return await respond_events(request, open_events, renderer, body.stream, body.include_usage)

    @app.post("/v1/completions", responses=STREAM_OR_JSON)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        prompt_ids = completion_prompt_ids(tokenizer, body.prompt, model_info.vocab_size)
        return await serve(request, body, prompt_ids, "completion")

    @app.post("/v1/chat/completions", responses=STREAM_OR_JSON)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        prompt_ids = chat_prompt_ids(tokenizer, body.template_messages())
        return await serve(request, body, prompt_ids, "chat")

    install_v2_routes(app, config, model_info, served_name, tokenizer, respond)

    def model_card() -> dict:
        return {"id": served_name, "object": "model", "created": created, "owned_by": "segserve",
                "max_model_len": model_info.max_model_len}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict:
        check_model(model)
        return model_card()

    return app


__all__ = ["create_app", "SSE_HEADERS", "KEEPALIVE", "sse_events", "until_disconnected"]
