"""A real router (uvicorn, and the public gRPC API on request) in a background thread, for tests that talk
HTTP or gRPC to it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

from router.config import RouterConfig
from router.grpc_api import start_grpc_server
from router.server import build_app, make_server



@contextlib.contextmanager
def serve_router(config: RouterConfig, tokenizer=None, log_level: str = "warning") -> Iterator[str]:
    """Start the router on config.port (set a free one); yield its base URL; shut it down
    (which runs the app's shutdown: the scheduler client and the reflow recorder close)."""
    with _serve(config, tokenizer, log_level, is_grpc=False) as (url, _):
        yield url


@contextlib.contextmanager
def serve_router_and_grpc(config: RouterConfig, tokenizer=None, log_level: str = "warning"
                          ) -> Iterator[tuple[str, str]]:
    """`serve_router` with the public gRPC API on config.grpc_port (0 = a free one): yield (base URL, gRPC
    target); shutting down stops the gRPC API first, as the router process does."""
    with _serve(config, tokenizer, log_level, is_grpc=True) as urls:
        yield urls


@contextlib.contextmanager
def _serve(config: RouterConfig, tokenizer, log_level: str, is_grpc: bool) -> Iterator[tuple[str, str | None]]:
    holder: dict = {}

    async def main() -> None:
        app = await (build_app(config, tokenizer) if tokenizer is not None else build_app(config))
        grpc_api = await start_grpc_server(app.state.router, config) if is_grpc else None
        holder["grpc_port"] = grpc_api.port if grpc_api is not None else None
        holder["server"] = server = make_server(config, app, log_level=log_level, grpc_api=grpc_api)
        await server.serve()

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (holder.get("server") and holder["server"].started):
        assert thread.is_alive() and time.monotonic() < deadline, "router did not start"
        time.sleep(0.05)
    grpc_target = None if holder["grpc_port"] is None else f"127.0.0.1:{holder['grpc_port']}"
    try:
        yield f"http://127.0.0.1:{config.port}", grpc_target
    finally:
        holder["server"].should_exit = True
        thread.join(timeout=20)
