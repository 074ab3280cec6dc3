"""One GenerateStreams call: many requests over one connection, each step's events in one message.

In: the call's StreamsRequests (start a request, with an optional deadline; cancel one). Out: StreamsResponses,
each holding every event produced since the previous one for this call's requests (a step's, as SGLang's
scheduler sends one batched output per step), tagged with their request ids. No task per request: each
request's RequestEvents has a listener that appends to the call's outbox, and one writer takes the whole outbox
per message. Admission is Generate's (validate_request, then the engine), its refusals an error event. When
the call ends, every request of it still live is aborted: no slot or KV block outlives its connection.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable

from protos.segserve.v1 import scheduler_pb2
from protos.segserve.v1.generate import (
    CancelStream,
    GenerateError,
    GenerateEvent,
    StartStream,
    TokenChunk,
    stream_action_from_pb,
    stream_events_to_pb,
    validate_request,
)
from protos.segserve.v1.sampling import InvalidParameter
from scheduler import traces
from scheduler.engine import Engine, EngineNotReady
from scheduler.request_events import is_terminal
from scheduler.group import EngineGroup
from scheduler.scheduler import QueueFull

logger = logging.getLogger(__name__)


MAX_HEAVY_BYTES = 2 << 20
"""Bytes of logprob-carrying events per message, well under gRPC's default 4 MiB receive limit: a step where
many requests get their prompt logprobs at once goes out as several messages, not one the router refuses."""


def split_messages(events: list[tuple[str, GenerateEvent]], max_heavy_bytes: int = MAX_HEAVY_BYTES,
                   packed: bool = False) -> list[scheduler_pb2.StreamsResponse]:
    """The events, in order, as one message (with `packed`, its plain token chunks as columns), or several,
    one message per event, when their logprobs pass `max_heavy_bytes`. Only those heavy events are measured
    (plain token chunks are a few dozen bytes each)."""
    if not any(_is_heavy(event) for _, event in events):
        return [stream_events_to_pb(events, packed)]
    messages, response, num_heavy_bytes = [], scheduler_pb2.StreamsResponse(), 0
    for request_id, event in events:
        pb = event.to_pb()
        if _is_heavy(event):
            size = pb.ByteSize()
            if num_heavy_bytes and num_heavy_bytes + size > max_heavy_bytes:
                messages.append(response)
                response, num_heavy_bytes = scheduler_pb2.StreamsResponse(), 0
            num_heavy_bytes += size
        response.events.add(request_id=request_id, event=pb)
    messages.append(response)
    return messages


def _is_heavy(event: GenerateEvent) -> bool:
    return isinstance(event, TokenChunk) and (event.prompt_logprobs is not None or bool(event.top_logprobs))


class StreamsCall:
    """The requests of one GenerateStreams call and the events waiting to be written to it."""

    def __init__(self, engine: Engine | EngineGroup, is_draining: Callable[[], bool]) -> None:
        self.engine = engine
        self._is_draining = is_draining
        self._live: dict[str, asyncio.TimerHandle | None] = {}
        """Requests started on this call and not ended yet -> their deadline's timer."""
        self._outbox: list[tuple[str, GenerateEvent]] = []
        self._ended: list[str] = []
        """Requests whose terminal event is in the outbox: released from the engine once taken."""
        self._waiter: asyncio.Future | None = None
        self.is_reading = True
        """The client may still send actions (it has not closed its side)."""
        self.is_packed = False
        """The client reads packed chunks (it said so in a StreamsRequest): responses carry them."""

    async def read(self, requests: AsyncIterator[scheduler_pb2.StreamsRequest]) -> None:
        """Apply the client's actions as they arrive, until it closes its side (or the call breaks)."""
        try:
            async for pb in requests:
                if pb.packed_chunks:
                    self.is_packed = True
                action = stream_action_from_pb(pb)
                if isinstance(action, StartStream):
                    self.start(action)
                elif isinstance(action, CancelStream):
                    self.cancel(action.request_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the call broke: the handler's end aborts what is left
            logger.debug("GenerateStreams: reading stopped: %s", exc)
        finally:
            self.is_reading = False
            self.wake()

    def start(self, action: StartStream) -> None:
        """Admit the request as Generate does; a refusal is its error event."""
        request = action.request
        request_id = request.request_id
        if self._is_draining():
            return self._refuse(request_id, "unavailable", "the scheduler is shutting down")
        if self.engine.info is None:
            return self._refuse(request_id, "unavailable", "the scheduler is not connected to its worker yet")
        if request_id in self._live:
            return self._refuse(request_id, "invalid_request", f"request_id: {request_id!r} is already live")
        try:
            with traces.admission(request):
                validate_request(request, self.engine.info)
                stream = self.engine.add_request(request)
        except InvalidParameter as exc:  # RequestRejected included
            return self._refuse(request_id, "invalid_request", str(exc))
        except EngineNotReady as exc:
            return self._refuse(request_id, "unavailable", str(exc))
        except QueueFull as exc:
            return self._refuse(request_id, "overloaded", str(exc))
        timer = None
        if action.timeout_s:
            timer = asyncio.get_running_loop().call_later(action.timeout_s, self._on_deadline, request_id,
                                                          action.timeout_s)
        self._live[request_id] = timer
        stream.listen(functools.partial(self._on_event, request_id))

    def cancel(self, request_id: str) -> None:
        """Abort a live request of this call; the engine's "cancelled" event ends it."""
        if request_id in self._live and not self.engine.abort(request_id):
            # Not in any engine's hands right now (moving between workers): end it here.
            self._end(request_id, GenerateError("cancelled", "the request was cancelled"))

    def close(self) -> None:
        """The call ended: abort every request of it still live."""
        live, self._live = self._live, {}
        for request_id, timer in live.items():
            if timer is not None:
                timer.cancel()
            self.engine.abort(request_id)

    async def responses(self) -> AsyncIterator[scheduler_pb2.StreamsResponse]:
        """Everything in the outbox as one message, whenever it is not empty; ends once the client closed its
        side (or the scheduler drains) and no request of the call is live."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._outbox:
                if not self._live and (not self.is_reading or self._is_draining()):
                    return
                self._waiter = loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
                continue
            events, self._outbox = self._outbox, []
            ended, self._ended = self._ended, []
            for request_id in ended:  # as Generate's end: a no-op for the engine, an EngineGroup forgets it
                self.engine.abort(request_id)
            for response in split_messages(events, packed=self.is_packed):
                yield response

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_event(self, request_id: str, event: GenerateEvent) -> None:
        """A request's RequestEvents listener (called from the engine's step loop)."""
        if request_id not in self._live:
            return  # ended here already (its deadline, a cancel in transit): the engine's late event is dropped
        if is_terminal(event):
            self._end(request_id, event)
            return
        self._outbox.append((request_id, event))
        self.wake()

    def _on_deadline(self, request_id: str, timeout_s: float) -> None:
        if request_id in self._live:
            self._live[request_id] = None  # fired: nothing to cancel
            self._end(request_id, GenerateError("timeout", f"the request passed its deadline of {timeout_s:g} s"))
            self.engine.abort(request_id)  # its "cancelled" event is dropped: the request is not live any more

    def _end(self, request_id: str, event: GenerateEvent) -> None:
        timer = self._live.pop(request_id, None)
        if timer is not None:
            timer.cancel()
        self._outbox.append((request_id, event))
        self._ended.append(request_id)
        self.wake()

    def _refuse(self, request_id: str, code: str, message: str) -> None:
        self._outbox.append((request_id, GenerateError(code, message)))
        self.wake()
