"""The router's side of the Scheduler's GenerateStreams call, shared by all requests of one client.

All requests of one SchedulerClient share one GenerateStreams call (opened lazily in the running loop):
requests go out as start/cancel actions, and each response holds a whole step's events for every request,
which one reader task hands to the requests' inboxes (one gRPC message per step instead of one per request
and step). When that call fails, every request on it ends with the mapped error and the next request opens a
new call; a scheduler without GenerateStreams (UNIMPLEMENTED) gets one Generate call per request from then on
(`generate_per_request`).

Also the shapes every client shares: `RequestStream` (one request's events as its consumer takes them) and
`StreamObserver` (what watches them being taken: metrics.RequestTracker, grpc_convert.StepSizes).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc

from protos.segserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from protos.segserve.v1.generate import (
    CancelStream,
    GenerateError,
    GenerateEvent,
    GenerateRequest,
    MalformedEvents,
    StartStream,
    TokenChunk,
    event_from_pb,
    stream_events_from_pb,
)

logger = logging.getLogger(__name__)

# gRPC status -> the failure codes the router maps to HTTP statuses (errors.py).
FAILURE_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_request",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.CANCELLED: "cancelled",
}

UNIMPLEMENTED = object()
"""In an inbox: the scheduler has no GenerateStreams (nothing was sent for the request)."""
DEADLINE = object()
"""In an inbox: the request's deadline passed on this side."""


def failure_of(exc: grpc.aio.AioRpcError) -> GenerateError:
    return GenerateError(FAILURE_CODES.get(exc.code(), "internal"), f"scheduler: {exc.details() or exc.code().name}")


class Inbox:
    """One request's events, handed to its consumer all at once: one future per wait, no task per event.

    The keep-alive deadline of `take` is one timer per stream, not one per wait: a timer scheduled and cancelled
    for every token would cost more than the rest of the hand-over. When it fires before the current wait's
    deadline (the consumer waited again since it was set), it is set again for that deadline."""

    __slots__ = ("events", "waiter", "is_answered", "_timer", "_deadline")

    def __init__(self) -> None:
        self.events: list = []
        self.is_answered = False
        """The scheduler sent an event for the request (set by SharedCall's reader)."""
        self.waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        """When the current wait, if any, gives up (loop time)."""

    def put(self, event) -> None:
        self.events.append(event)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self, timeout_s: float | None = None) -> list:
        """Every event not taken yet, waiting for one if there is none; [] after `timeout_s` without any."""
        if not self.events:
            loop = asyncio.get_running_loop()
            self.waiter = waiter = loop.create_future()
            if timeout_s is not None:
                self._deadline = loop.time() + timeout_s
                if self._timer is None or self._timer.when() > self._deadline:
                    self.close()
                    self._timer = loop.call_at(self._deadline, self._on_timer)
            try:
                await waiter
            finally:
                self.waiter = None
        events, self.events = self.events, []
        return events

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self.waiter
        if waiter is None or waiter.done():
            return  # not waiting: the next wait sets the timer
        loop = waiter.get_loop()
        if loop.time() + _TIMER_SLACK_S >= self._deadline:
            waiter.set_result(None)
        else:
            self._timer = loop.call_at(self._deadline, self._on_timer)

    def close(self) -> None:
        """Cancel the keep-alive timer (the stream ended)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


_TIMER_SLACK_S = 0.001
"""The event loop runs a timer up to its clock resolution early."""


class SharedCall:
    """One GenerateStreams call: actions go out through a queue that the call reads, and one reader task puts
    each response's events into their requests' inboxes. When the call ends, every request still on it gets
    the failure (or UNIMPLEMENTED) and `on_end` is told.

    A request the scheduler had not answered yet when the call broke gets "unavailable", whatever the call's
    status: nothing of it is running there (the scheduler aborts every request of a call that ends), so a pool may
    send it elsewhere. A start written just as a draining scheduler ends its last call is one such request: the
    write races the call's end and gRPC reports INTERNAL ("Internal error from Core")."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub,
                 on_end: Callable[[SharedCall, bool], None]) -> None:
        self.inboxes: dict[str, Inbox] = {}
        self._fallbacks: dict[str, Callable[[], None]] = {}
        """Per request: what to call when the call turns out to be UNIMPLEMENTED."""
        self.is_ended = False
        self._on_end = on_end
        self._actions: asyncio.Queue = asyncio.Queue()
        self._call = stub.GenerateStreams(self._send())
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="segserve-scheduler-streams")

    def start(self, request: GenerateRequest, timeout_s: float | None,
              on_unimplemented: Callable[[], None] | None = None) -> Inbox:
        inbox = self.inboxes[request.request_id] = Inbox()
        if on_unimplemented is not None:
            self._fallbacks[request.request_id] = on_unimplemented
        self._actions.put_nowait(StartStream(request, timeout_s).to_pb())
        return inbox

    def forget(self, request_id: str, is_cancelled: bool) -> None:
        """The request's consumer is done with it; `is_cancelled`: before its end, so abort it at the scheduler."""
        self.inboxes.pop(request_id, None)
        self._fallbacks.pop(request_id, None)
        if is_cancelled and not self.is_ended:
            self._actions.put_nowait(CancelStream(request_id).to_pb())

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def _send(self) -> AsyncIterator[scheduler_pb2.StreamsRequest]:
        # Nothing goes out before the scheduler's initial metadata (it sends them at once): a write racing a
        # scheduler that refuses the call (UNIMPLEMENTED) would turn its status into an INTERNAL error.
        await self._call.initial_metadata()
        if self._call.done():
            return
        while True:
            yield await self._actions.get()

    async def _read(self) -> None:
        failure: object = GenerateError("unavailable", "scheduler: the scheduler ended the call")
        try:
            async for response in self._call:
                inboxes = self.inboxes
                for request_id, event in stream_events_from_pb(response):
                    inbox = inboxes.get(request_id)
                    if inbox is not None:
                        inbox.is_answered = True
                        inbox.put(event)
        except grpc.aio.AioRpcError as exc:
            failure = UNIMPLEMENTED if exc.code() == grpc.StatusCode.UNIMPLEMENTED else failure_of(exc)
        except MalformedEvents as exc:  # a scheduler bug: the call's requests fail, the router goes on
            logger.error("the scheduler sent a malformed response: %s", exc)
            failure = GenerateError("internal", f"scheduler: malformed response: {exc}")
        except asyncio.CancelledError:
            failure = GenerateError("unavailable", "scheduler: the client was closed")
            raise
        finally:
            self.is_ended = True
            self._call.cancel()
            self._on_end(self, failure is UNIMPLEMENTED)
            for request_id, inbox in list(self.inboxes.items()):
                on_unimplemented = self._fallbacks.get(request_id) if failure is UNIMPLEMENTED else None
                if on_unimplemented is not None:
                    on_unimplemented()  # the request goes on at once, whether or not its consumer waits now
                is_unanswered = isinstance(failure, GenerateError) and not inbox.is_answered
                inbox.put(dataclasses.replace(failure, code="unavailable") if is_unanswered else failure)


async def generate_per_request(stub: scheduler_pb2_grpc.SchedulerStub, request: GenerateRequest,
                               timeout_s: float | None) -> AsyncIterator[GenerateEvent]:
    """The request as its own Generate call (a scheduler without GenerateStreams)."""
    call = stub.Generate(request.to_pb(), timeout=timeout_s or None)
    try:
        terminal: GenerateEvent | None = None
        # Read to the end of the stream before yielding the terminal event: a
        # consumer that stops right after it must not cancel a finished call.
        async for response in call:
            event = event_from_pb(response)
            if terminal is not None:
                continue
            if isinstance(event, TokenChunk):
                yield event
            else:
                terminal = event
        yield terminal or GenerateError("internal", "the scheduler ended the stream without a result")
    except grpc.aio.AioRpcError as exc:
        yield failure_of(exc)
    finally:
        if not call.done():
            call.cancel()


class RequestStream(Protocol):
    """One request's events as its consumer takes them (`SchedulerApi.open`): TokenChunks, then one terminal
    event (GenerateComplete or GenerateError), after which the stream is over."""

    async def take(self, timeout_s: float | None = None) -> list[GenerateEvent]:
        """Every event that arrived since the last take, waiting for one if there is none; [] after `timeout_s`
        without any (the request goes on)."""
        ...

    async def close(self) -> None:
        """Done with the request: one not ended yet is cancelled at the scheduler."""
        ...


class StreamObserver:
    """Watches one request's stream as its consumer reads it (generation.generate_deltas tells it), without
    being in the way: it sees the events, it cannot change them. Override what is needed; the rest does nothing."""

    def opened(self, now_s: float) -> None:
        """The request was sent (time.monotonic)."""

    def took(self, events: list[GenerateEvent], now_s: float) -> None:
        """The consumer took `events` (never empty) at `now_s`."""

    def closed(self) -> None:
        """The consumer closed the stream: after its terminal event, or before it (the client went away)."""


def terminal_index(events: list) -> int:
    """Where the first event that is not a TokenChunk is in `events`; -1 when none is."""
    for index, event in enumerate(events):
        if not isinstance(event, TokenChunk):
            return index
    return -1


class SharedStream:
    """A request on a SharedCall: its consumer takes the events straight from the request's inbox. The deadline
    is the scheduler's and this side's too (one timer), so that a stuck connection still ends the request. When
    the call turns out to be UNIMPLEMENTED, the request goes on as its own Generate call (`fallback`)."""

    __slots__ = ("_shared", "_request", "_timeout_s", "_started_s", "_inbox", "_deadline", "_is_done", "_fallback",
                 "_open_fallback")

    def __init__(self, shared: SharedCall, request: GenerateRequest, timeout_s: float | None,
                 open_fallback: Callable[[GenerateRequest, float | None], AsyncIterator[GenerateEvent]]) -> None:
        loop = asyncio.get_running_loop()
        self._shared = shared
        self._request = request
        self._timeout_s = timeout_s
        self._started_s = loop.time()
        self._inbox = inbox = shared.start(request, timeout_s, self._go_per_request)
        self._deadline = loop.call_later(timeout_s, inbox.put, DEADLINE) if timeout_s else None
        self._is_done = False
        """Ended, or given up: no longer on the shared call."""
        self._fallback: PumpStream | None = None
        self._open_fallback = open_fallback

    async def take(self, timeout_s: float | None = None) -> list[GenerateEvent]:
        if self._fallback is not None:
            return await self._fallback.take(timeout_s)
        if self._is_done:
            return []
        events = await self._inbox.take(timeout_s)
        index = terminal_index(events)
        if index < 0:
            return events
        event = events[index]
        if event is UNIMPLEMENTED:
            self._go_per_request()
            return events[:index] or await self._fallback.take(timeout_s)
        if event is DEADLINE:
            self._end(is_cancelled=True)
            return [*events[:index],
                    GenerateError("timeout", f"scheduler: no result within the deadline of {self._timeout_s:g} s")]
        self._end(is_cancelled=False)  # a consumer that stops at the end cancels nothing
        return events[:index + 1]

    def _go_per_request(self) -> None:
        """The shared call is UNIMPLEMENTED (nothing was sent for the request): go on the old way."""
        if self._fallback is not None or self._is_done:
            return
        self._end(is_cancelled=False)
        timeout_s_left = self._timeout_s
        if timeout_s_left:
            elapsed_s = asyncio.get_running_loop().time() - self._started_s
            timeout_s_left = max(0.001, timeout_s_left - elapsed_s)
        self._fallback = PumpStream(self._open_fallback(self._request, timeout_s_left), self._request.request_id)

    def _end(self, is_cancelled: bool) -> None:
        if self._is_done:
            return
        self._is_done = True
        if self._deadline is not None:
            self._deadline.cancel()
        self._inbox.close()
        self._shared.forget(self._request.request_id, is_cancelled)

    async def close(self) -> None:
        self._end(is_cancelled=True)
        if self._fallback is not None:
            await self._fallback.close()


class PumpStream:
    """A request read from an async iterator of its events (its own Generate call, or a test double's) by a task
    that puts them into an inbox, so that taking with a timeout never disturbs the iterator. Closing it cancels
    the task, which closes the iterator."""

    __slots__ = ("_inbox", "_task")

    def __init__(self, events: AsyncIterator[GenerateEvent], request_id: str) -> None:
        self._inbox = Inbox()
        self._task = asyncio.get_running_loop().create_task(self._pump(events, request_id))

    async def _pump(self, events: AsyncIterator[GenerateEvent], request_id: str) -> None:
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    self._inbox.put(event)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug, not a scheduler answer: still end the stream
            logger.exception("generation %s failed", request_id)
            self._inbox.put(GenerateError("internal", f"router: {type(exc).__name__}: {exc}"))

    async def take(self, timeout_s: float | None = None) -> list[GenerateEvent]:
        return await self._inbox.take(timeout_s)

    async def close(self) -> None:
        self._inbox.close()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


class ReadyStream:
    """A request answered on this side (a refusal): its events come out on the first take."""

    __slots__ = ("_events",)

    def __init__(self, events: list[GenerateEvent]) -> None:
        self._events = events

    async def take(self, timeout_s: float | None = None) -> list[GenerateEvent]:
        events, self._events = self._events, []
        return events

    async def close(self) -> None:
        pass
