"""The router's per-request plumbing stays on the event loop: no thread hand-off per request."""

from __future__ import annotations

import asyncio
import inspect
import threading

from starlette.background import BackgroundTask

from router.serving import close_events
from router.state import get_state


async def test_the_background_close_closes_the_events_on_the_loop():
    closed_on: list[threading.Thread] = []

    async def events():
        try:
            yield "first"
            yield "never read"
        finally:
            closed_on.append(threading.current_thread())

    stream = events()
    assert await anext(stream) == "first"  # the response read its first event, then the client left
    await BackgroundTask(close_events, stream)()
    assert closed_on == [threading.current_thread()]
    await asyncio.sleep(0)
    assert stream.ag_frame is None  # finished: nothing left to run


def test_the_state_dependency_is_a_coroutine_function():
    # FastAPI runs a plain-function dependency in its thread pool: a thread hand-off on every request.
    assert inspect.iscoroutinefunction(get_state)
