"""Running a generation and answering with it: one JSON body, or SSE; shared by every generate route.

In: the request's `GenerationJob`s (or any event stream of Deltas), a renderer
(responses.py for /v1, v2.py for /v2) and whether to stream. Out: the HTTP
response. A non-streamed request collects its deltas and renders one body; a
streamed one waits for the first event (so a request refused at once gets a
real HTTP status), then sends the renderer's chunks, keep-alive comments while
nothing arrives, an error event if the scheduler fails mid-stream, and the
renderer's end marker. A client that goes away, streamed or not, closes the
event stream, which cancels the gRPC call. Each response is recorded for data
reflow when the reflow middleware opened a recording.

A choice that ends with the scheduler's FinishReason.ERROR (that request alone
failed in the worker; the tokens before it are valid) ends with finish_reason
"error". In a stream, once every choice ended, an error event carrying the
worker's message follows (before `[DONE]`), as vLLM does for a failed stream:
the openai client raises APIError on it after having delivered the valid text.
A non-streamed answer stays 200, the failed choice's finish_reason saying "error".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from protos.segserve.v1.generate import FinishReason, GenerateError
from router.detokenizer import IncrementalDetokenizer
from router.errors import SERVER_ERROR, error_body, from_failure
from router.generation import Delta, GenerationJob, KeepAlive, generate_deltas
from router.metrics import RequestTracker
from router.reflow.gateway import STATE_KEY, record_deltas
from router.speculation import with_extension
from router.state import RouterState

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",
}
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it
GENERATION_ERROR = "generation_error"
"""The error code of a stream's error event after a choice failed in the worker."""

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client closed the connection before the answer was ready."""


def sse_data(payload: BaseModel | dict | str) -> str:
    """One SSE event carrying `payload` as JSON (a str is JSON already: a renderer's prebuilt chunk)."""
    return f"data: {_json(payload)}\n\n"


def _json(payload: BaseModel | dict | str) -> str:
    if isinstance(payload, str):
        return payload
    return payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)


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


def worker_error(delta: Delta) -> str | None:
    """The worker's message when this delta ends a choice with FinishReason.ERROR, else None."""
    done = delta.complete
    if done is None or done.finish_reason is not FinishReason.ERROR:
        return None
    return done.error_message or "the request failed in the worker"


async def sse_events(first, events: AsyncIterator, renderer, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body: the renderer's chunks, keep-alive comments, error events if any, then its end marker."""
    failed: list[str] = []  # worker messages of choices that ended with FinishReason.ERROR
    async with contextlib.aclosing(events):
        for chunk in renderer.start():
            yield sse_data(chunk)
        event = first
        while event is not None:
            if isinstance(event, KeepAlive):
                yield ": keep-alive\n\n"
            elif isinstance(event, GenerateError):
                yield sse_data(from_failure(event).body())
                break
            else:
                chunk = renderer.chunk(event)
                if event.speculation is not None and (chunk is not None or event.speculation.steps):
                    # Tokens without text of their own (held back, EOS) still get their chunk.
                    chunk = with_extension(_json(chunk if chunk is not None else renderer.text_chunk(event.index, "")),
                                           event.speculation)
                if chunk is not None:
                    yield sse_data(chunk)
                message = worker_error(event)
                if message is not None:
                    failed.append(message)
                # With n choices, each ends with a finish_reason; the last one carries the usage.
                if event.finish_reason is not None and include_usage and event.usage is not None:
                    yield sse_data(renderer.usage_chunk(event.usage))
            event = await anext(events, None)
        if renderer.stream_done is not None:  # /v2 streams end with their finish_reason event instead
            for message in failed:
                yield sse_data(error_body(message, SERVER_ERROR, code=GENERATION_ERROR))
            yield f"data: {renderer.stream_done}\n\n"


async def close_events(events: AsyncGenerator) -> None:
    """Close a response's event generator, on the event loop. (A BackgroundTask of `events.aclose` itself would
    not: Starlette sees no coroutine function and calls it in a worker thread, which only makes the awaitable.)"""
    await events.aclose()


async def collect(events: AsyncIterator) -> list[Delta]:
    """All deltas of a non-streamed request; a failure becomes the HTTP error."""
    deltas = []
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, GenerateError):
                raise from_failure(event)
            deltas.append(event)
    return deltas


def job_events(state: RouterState, job: GenerationJob, keepalive_s: float | None) -> AsyncIterator:
    """One job's Deltas, detokenized (generation.generate_deltas) from `state`'s schedulers, the request metrics
    observed under protocol "http"."""
    detokenizer = IncrementalDetokenizer(state.tokenizer, job.prompt_token_ids,
                                         hidden_token_ids=state.hidden_token_ids)
    return generate_deltas(state.scheduler, job, detokenizer, keepalive_s, (RequestTracker(state.metrics.http),))


async def respond(state: RouterState, request: Request, job: GenerationJob, renderer, stream: bool,
                  include_usage: bool) -> Response:
    """Run `job`, answering in `renderer`'s shapes: one JSON body, or SSE when `stream`."""
    return await respond_events(state, request, lambda keepalive_s: job_events(state, job, keepalive_s), renderer,
                                stream, include_usage)


async def respond_events(state: RouterState, request: Request, open_events: Callable[[float | None], AsyncIterator],
                         renderer, stream: bool, include_usage: bool) -> Response:
    """Like `respond`, for any event stream: `open_events(keepalive_s)` starts the generation."""
    recording = getattr(request.state, STATE_KEY, None)
    try:
        if not stream:
            deltas = await until_disconnected(request, collect(record_deltas(open_events(None), recording)))
            return JSONResponse(renderer.response(deltas).model_dump())
        events = record_deltas(open_events(state.config.keepalive_interval_s), recording)
        # Wait for the first event before answering, so that a request refused
        # at once (overloaded, invalid) gets a real HTTP status, not an SSE error.
        first = await until_disconnected(request, anext(events))
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    if isinstance(first, GenerateError):
        raise from_failure(first)
    # The background close covers a client that left before the body started.
    return StreamingResponse(sse_events(first, events, renderer, include_usage), headers=SSE_HEADERS,
                             background=BackgroundTask(close_events, events))
