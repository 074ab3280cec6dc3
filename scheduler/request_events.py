"""One request's stream of events, from the engine to whoever reads it (a Generate call, or GenerateStreams).

In: the engine's events for the request (put). Out: the same events, by async iteration until the terminal one,
or handed to a listener as they come.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from protos.segserve.v1.generate import GenerateEvent, TokenChunk


def is_terminal(event: GenerateEvent) -> bool:
    return not isinstance(event, TokenChunk)


class RequestEvents:
    """Async iterator over one request's events; ends after its terminal event. With a listener (listen()),
    each event goes to it instead, as it is put: no task waits on the stream (GenerateStreams). The listener
    lives on the stream, so it follows the request when an EngineGroup moves it to another engine."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: asyncio.Queue[GenerateEvent] = asyncio.Queue()
        self._is_done = False
        self._listener: Callable[[GenerateEvent], None] | None = None

    def put(self, event: GenerateEvent) -> None:
        if self._listener is not None:
            self._listener(event)
        else:
            self._queue.put_nowait(event)

    def listen(self, listener: Callable[[GenerateEvent], None]) -> None:
        """Hand every event to `listener` from now on (the ones queued already first), instead of iterating."""
        self._listener = listener
        while not self._queue.empty():
            listener(self._queue.get_nowait())

    def __aiter__(self) -> AsyncIterator[GenerateEvent]:
        return self

    async def __anext__(self) -> GenerateEvent:
        if self._is_done:
            raise StopAsyncIteration
        event = await self._queue.get()
        self._is_done = is_terminal(event)
        return event
