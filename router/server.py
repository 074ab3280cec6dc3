"""Start the router: load the tokenizer, wait for the scheduler, serve HTTP with uvicorn and the public
gRPC API (grpc_api.py) beside it, on one event loop and one RouterState.

`run(config)` blocks until the server stops. `build_app(config)` does the
start-up (tokenizer, bounded wait for the scheduler's GetInfo, over mutual TLS
with the config's internal_tls_* files) and returns the app; `make_server` wraps
an app in a uvicorn server (HTTPS with tls_cert_file/tls_key_file) that tests
can stop, which, given the gRPC API, stops it first when it shuts down (before
the app's shutdown closes the scheduler client the gRPC calls use).

Shutdown (SIGTERM, SIGINT) drains first: /ready turns 503 and the gRPC API's health NOT_SERVING, new requests
are refused on both, and the requests under way get config.drain_timeout_s to finish (drain.py) before the
listening sockets close.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket

import uvicorn
from fastapi import FastAPI

from router.app import create_app
from router.config import RouterConfig
from router.drain import Drain
from router.grpc_api import GrpcApi, start_grpc_server
from router.scheduler_pool import SchedulerPool
from common import tracing
from common.discovery import parse_targets
from common.heap import freeze_startup_heap
from common.ports import announce_ports, bind_free
from common.tls import internal_tls

logger = logging.getLogger(__name__)


def load_tokenizer(model: str | None):
    """The tokenizer (with its chat template) of the served model directory."""
    from transformers import AutoTokenizer

    from common.checkpoint import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model(model)))


def with_model_card(config: RouterConfig) -> RouterConfig:
    """`config` with the tool-call parser its model's catalog entry names, where it names none itself."""
    from common.checkpoint import model_card, resolve_model

    if config.tool_call_parser:
        return config
    parser = model_card(resolve_model(config.model)).get("tool_call_parser", "")
    return dataclasses.replace(config, tool_call_parser=parser) if parser else config


async def build_app(config: RouterConfig, tokenizer=None) -> FastAPI:
    """The app, once the scheduler answers GetInfo (TimeoutError after config.scheduler_wait_s). Without a
    `tokenizer`, it and the model card come from config.model."""
    if tokenizer is None:
        tokenizer = await asyncio.to_thread(load_tokenizer, config.model)
        config = await asyncio.to_thread(with_model_card, config)
    client = SchedulerPool(parse_targets(config.scheduler_address, "--scheduler-address"), tls=internal_tls(config),
                           retry_s=config.scheduler_retry_s)
    logger.info("waiting for a scheduler at %s", config.scheduler_address)
    try:
        model_info = await client.wait_ready(config.scheduler_wait_s)
    except BaseException:
        await client.close()
        raise
    client.start()
    if model_info.vocab_size and len(tokenizer) > model_info.vocab_size:
        logger.warning("tokenizer has %d tokens, the model's vocabulary %d", len(tokenizer), model_info.vocab_size)
    logger.info("serving %s (max_model_len %d)", model_info.model_name, model_info.max_model_len)
    return create_app(config, client, tokenizer, model_info)


class RouterServer(uvicorn.Server):
    """uvicorn's server, stopping the gRPC API (when there is one) before its own shutdown."""

    def __init__(self, config: uvicorn.Config, grpc_api: GrpcApi | None = None, drain: Drain | None = None,
                 drain_timeout_s: float = 0.0) -> None:
        super().__init__(config)
        self.grpc_api = grpc_api
        self.drain = drain
        self.drain_timeout_s = drain_timeout_s

    async def shutdown(self, sockets=None) -> None:
        """Drain (HTTP and the gRPC API together, for at most drain_timeout_s), then uvicorn's own shutdown, then
        export the spans still queued (tracing): uvicorn then raises the signal that stopped it again, which ends
        the process before anything after its serve() runs."""
        grpc_stop = None
        if self.grpc_api is not None:  # NOT_SERVING, new calls refused, calls under way get the timeout
            grpc_stop = asyncio.create_task(self.grpc_api.stop(grace_s=self.drain_timeout_s))
        if self.drain is not None:
            self.drain.start()
            if not await self.drain.wait_idle(self.drain_timeout_s):
                logger.warning("%d requests still under way after %.0f s of draining; stopping anyway",
                               self.drain.num_in_flight, self.drain_timeout_s)
        if grpc_stop is not None:
            await grpc_stop
        await super().shutdown(sockets)
        await asyncio.to_thread(tracing.shutdown)


def make_server(config: RouterConfig, app: FastAPI, log_level: str = "info",
                grpc_api: GrpcApi | None = None) -> RouterServer:
    # Streams rely on our own keep-alives; uvicorn's default 5 s idle timeout only
    # concerns idle keep-alive connections between requests.
    # The drain (RouterServer.shutdown) has waited for the requests under way; uvicorn's own graceful shutdown
    # then only closes connections, with a few seconds for a response being written.
    tls = config.tls
    return RouterServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                                       timeout_graceful_shutdown=5, ssl_certfile=tls.cert_file if tls else None,
                                       ssl_keyfile=tls.key_file if tls else None), grpc_api,
                        app.state.router.drain, config.drain_timeout_s)


async def serve(config: RouterConfig) -> None:
    """HTTP, and the gRPC API unless config turns it off, until a signal stops both."""
    check_tls(config)
    app = await build_app(config)
    grpc_api = await start_grpc_server(app.state.router, config) if config.is_grpc_api else None
    sockets = [http_socket(config.host)] if config.port == 0 else None
    announce_ports(port=sockets[0].getsockname()[1] if sockets else config.port,
                   **({"grpc_port": grpc_api.port} if grpc_api is not None else {}))
    freeze_startup_heap()  # the tokenizer, templates and apps stay out of every later collection
    try:
        await make_server(config, app, grpc_api=grpc_api).serve(sockets)
    finally:
        if grpc_api is not None:
            await grpc_api.stop()  # HTTP failed to start, or an error ended it before its shutdown


def http_socket(host: str) -> socket.socket:
    """A socket bound to any free port of `host` (common/ports.py's bind_free), for uvicorn to listen on: the
    router's HTTP port 0."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def bind(port: int) -> int:
        try:
            sock.bind((host, port))
        except OSError:
            return 0
        return sock.getsockname()[1]

    if not bind_free(bind):
        sock.close()
        raise OSError(f"cannot bind the router's HTTP API to {host}")
    return sock


def check_tls(config: RouterConfig) -> None:
    """ValueError naming the file when a TLS file cannot be used; before the tokenizer loads and anything binds."""
    for tls in (config.tls, internal_tls(config)):
        if tls is not None:
            tls.check()


def run(config: RouterConfig) -> None:
    """Serve until interrupted, traced when the config says so (RouterServer.shutdown exports the last spans)."""
    tracing.setup("router", config)
    try:
        asyncio.run(serve(config))
    finally:
        tracing.shutdown()  # a start that failed
