"""The router's side of data reflow: every inference request recorded, on every exit path.

In: the router app (an ASGI middleware around it) and the event stream of each
generation (`record_deltas`). Out: one RequestRecording per POST to
/v1/completions, /v1/chat/completions or /v2/models/.../generate[_stream],
with the raw body, one response chunk per delta the client received (after
stop strings; of every choice, and of each of a completion's prompts) holding
its choice's index, its text and the generated token ids behind it (a delta
whose tokens made no text yet, e.g. half a character or the EOS token, is
recorded with its ids alone), and exactly one finish state:
- the generation's own end: complete (with usage), a failure (deadline for a
  timeout, rejected for overload or invalid input, else error), or cancelled
  when the stream is closed early (the client went away);
- otherwise a client that went away is cancelled, else the HTTP status
  decides: 2xx complete, 499 cancelled, 408/504
  deadline, other 4xx rejected (validation, 404, 429), 5xx error; an exception
  out of the app is an error, and no response at all is cancelled.
Requests the guard in router/guard.py refuses (401, 413) never reach this
middleware and are not recorded: they are not requests of any client we know.

The client id is the `X-Client-Id` header, else a hash of the API key (never the
key itself), else "anonymous". Recording never blocks the request: the
recorder only appends to its bounded buffer.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import uuid
from collections.abc import AsyncIterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protos.segserve.v1.generate import FinishReason, GenerateError
from router.generation import Delta
from router.reflow.chunks import FinishState
from router.reflow.recorder import Recorder, RequestRecording

_INFERENCE_PATH = re.compile(r"^/v1/(chat/)?completions$|^/v2/models/.+/generate(_stream)?$")
_FAILURE_STATES = {"timeout": FinishState.DEADLINE, "overloaded": FinishState.REJECTED,
                   "invalid_request": FinishState.REJECTED}
STATE_KEY = "reflow"
"""Where the middleware leaves the request's recording in the ASGI scope's state."""


def client_id(headers: dict[str, str]) -> str:
    if headers.get("x-client-id"):
        return headers["x-client-id"]
    scheme, _, key = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and key:
        return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return "anonymous"


def state_for_status(status: int | None) -> FinishState:
    if status is None or status == 499:
        return FinishState.CANCELLED
    if status < 400:
        return FinishState.COMPLETE
    if status in (408, 504):
        return FinishState.DEADLINE
    return FinishState.REJECTED if status < 500 else FinishState.ERROR


class ReflowMiddleware:
    """ASGI middleware: opens a recording for each inference request and closes it on every exit."""

    def __init__(self, app: ASGIApp, recorder: Recorder, service_id: str) -> None:
        self.app = app
        self.recorder = recorder
        self.service_id = service_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not _INFERENCE_PATH.match(scope["path"]):
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []  # the body, read here and replayed (the guard in front bounds it)
        while not messages or messages[-1].get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body: nothing was asked
            messages.append(message)
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        recording = self.recorder.start_request(
            headers.get("x-request-id") or uuid.uuid4().hex, client_id(headers), self.service_id,
            b"".join(m.get("body", b"") for m in messages), headers=headers)
        scope.setdefault("state", {})[STATE_KEY] = recording
        status: int | None = None
        is_disconnected = False

        async def replay() -> Message:
            nonlocal is_disconnected
            if messages:
                return messages.pop(0)
            message = await receive()
            is_disconnected = is_disconnected or message["type"] == "http.disconnect"
            return message

        async def watch_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, replay, watch_status)
        except BaseException as exc:
            recording.finish(FinishState.ERROR if isinstance(exc, Exception) else FinishState.CANCELLED,
                             error=f"{type(exc).__name__}: {exc}")
            raise
        # Ignored when the generation already finished the recording (it ran to its end).
        recording.finish(FinishState.CANCELLED if is_disconnected else state_for_status(status))


def record_deltas(events: AsyncIterator, recording: RequestRecording | None) -> AsyncIterator:
    """A generation's events, recording its text and how it ended; the events themselves when
    the request is not recorded (no wrapper on the hot path)."""
    return events if recording is None else _recorded(events, recording)


async def _recorded(events: AsyncIterator, recording: RequestRecording) -> AsyncIterator:
    usage, error_message = None, None
    async with contextlib.aclosing(events):
        try:
            async for event in events:
                if isinstance(event, GenerateError):
                    recording.finish(_FAILURE_STATES.get(event.code, FinishState.ERROR), error=event.message)
                elif isinstance(event, Delta):
                    if event.text or event.token_ids:
                        recording.delta(event.text, event.token_ids, event.index)
                    usage = event.usage or usage
                    if event.complete is not None and event.complete.finish_reason is FinishReason.ERROR:
                        error_message = event.complete.error_message  # this request alone failed
                yield event
        except GeneratorExit:
            recording.finish(FinishState.CANCELLED)
            raise
    usage_record = None if usage is None else {"prompt_tokens": usage.prompt_tokens,
                                                "completion_tokens": usage.completion_tokens}
    if error_message is not None:
        recording.finish(FinishState.ERROR, usage=usage_record, error=error_message)
    else:
        recording.finish(FinishState.COMPLETE, usage=usage_record)


class ReflowCollector:
    """The recorder's counters for /metrics: queue depth and age, spill bytes, drops by reason."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def collect(self):
        stats = self.recorder.stats()
        yield GaugeMetricFamily("segserve:reflow_queue_depth", "Chunks in the durable queue not yet consumed",
                                value=stats.queue_depth)
        yield GaugeMetricFamily("segserve:reflow_oldest_chunk_age_seconds",
                                "Age of the oldest unconsumed chunk in the queue", value=stats.queue_oldest_age_s)
        yield GaugeMetricFamily("segserve:reflow_buffered_bytes", "Payload bytes waiting in the router's memory",
                                value=stats.buffered_bytes)
        yield GaugeMetricFamily("segserve:reflow_spill_bytes", "Bytes spilled to disk while the queue refused writes",
                                value=stats.spill_bytes)
        recorded = CounterMetricFamily("segserve:reflow_chunks_recorded", "Chunks handed to the recorder")
        recorded.add_metric([], stats.num_chunks_recorded)
        yield recorded
        dropped = CounterMetricFamily("segserve:reflow_chunks_dropped", "Chunks dropped, by reason", labels=["reason"])
        for reason, count in sorted(stats.num_chunks_dropped.items()):
            dropped.add_metric([reason], count)
        yield dropped
