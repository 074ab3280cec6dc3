"""A real router (uvicorn) in a background thread, for tests that talk HTTP to it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

from router.config import RouterConfig
from router.server import build_app, make_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_router(config: RouterConfig, tokenizer=None, log_level: str = "warning") -> Iterator[str]:
    """Start the router on config.port (set a free one); yield its base URL; shut it down
    (which runs the app's shutdown: the scheduler client and the reflow recorder close)."""
    holder: dict = {}

    async def main() -> None:
        app = await (build_app(config, tokenizer) if tokenizer is not None else build_app(config))
        holder["server"] = server = make_server(config, app, log_level=log_level)
        await server.serve()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (holder.get("server") and holder["server"].started):
        assert thread.is_alive() and time.monotonic() < deadline, "router did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        holder["server"].should_exit = True
        thread.join(timeout=20)
