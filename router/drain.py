"""Graceful shutdown of the router's HTTP side: on SIGTERM readiness goes false, new requests are refused, and
the requests under way (streams included) get a bounded time to finish.

In: `Drain.start()` when the server is told to stop (server.py's RouterServer.shutdown), then
`wait_idle(timeout_s)` before the listening sockets close. Out: `DrainGuard`, the ASGI middleware that counts the
/v1 and /v2 requests under way and, once draining, answers new ones 503 (`shutting_down`, Retry-After) so a
client or load balancer retries another replica; GET /ready (ops.py) answers 503 while draining.
"""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from router.errors import SERVER_ERROR, error_body

SHUTTING_DOWN = "shutting_down"


class Drain:
    """Whether the router is shutting down, and how many API requests are under way."""

    def __init__(self) -> None:
        self.is_draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self) -> None:
        self.is_draining = True

    def enter(self) -> None:
        self.num_in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is under way; False when `timeout_s` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False


class DrainGuard:
    """ASGI middleware: counts the API requests under way; refuses new ones with 503 while draining."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(("/v1", "/v2")):
            await self.app(scope, receive, send)
            return
        if self.drain.is_draining:
            refusal = JSONResponse(
                error_body("The server is shutting down; retry the request.", SERVER_ERROR,
                           code=SHUTTING_DOWN),
                status_code=503, headers={"Retry-After": "1", "Connection": "close"})
            await refusal(scope, receive, send)
            return
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()
