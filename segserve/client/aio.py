"""The asyncio client (grpc.aio): for services that run an event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from protos.segserve.v1 import generation_pb2 as pb
from protos.segserve.v1 import generation_pb2_grpc
from segserve.client.base import ChatMessages, ClientBase, channel_of, generation_request, tokenize_request
from segserve.client.errors import SegserveError
from segserve.client.results import GenerationResult, ModelCard, StreamEvent, TokenizeResult


class AsyncClient(ClientBase):
    """The asyncio form of Client: the same settings and methods, as coroutines (`stream` is an async iterator).

    Its channel opens at the first call, in the running event loop; use one client per loop, as an async
    context manager or with `await close()`.
    """

    def __init__(self, target: str = "localhost:8001", **settings) -> None:
        super().__init__(target, **settings)
        self._channel: grpc.aio.Channel | None = None
        self._stub: generation_pb2_grpc.GenerationStub | None = None

    def _get_stub(self) -> generation_pb2_grpc.GenerationStub:
        if self._stub is None:
            self._channel = channel_of(self, grpc.aio)
            self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        return self._stub

    async def generate(self, prompt: str | None = None, *, messages: ChatMessages | None = None, model: str = "",
                       request_id: str = "", session_id: str = "", timeout_s: float | None = None,
                       **parameters) -> GenerationResult:
        """See Client.generate."""
        request = generation_request(prompt, messages, model, request_id, session_id, parameters)
        return GenerationResult.from_pb(await self._unary(self._get_stub().Generate, request, timeout_s))

    async def stream(self, prompt: str | None = None, *, messages: ChatMessages | None = None, model: str = "",
                     request_id: str = "", session_id: str = "", timeout_s: float | None = None,
                     **parameters) -> AsyncIterator[StreamEvent]:
        """See Client.stream: `async for event in client.stream(...)`; leaving the loop (or cancelling the task)
        cancels the request on the server."""
        request = generation_request(prompt, messages, model, request_id, session_id, parameters)
        deadline = self._deadline(timeout_s)
        num_attempts = 0
        while True:
            num_attempts += 1
            call = self._get_stub().GenerateStream(request, timeout=self._remaining_s(deadline),
                                                   metadata=self.metadata)
            is_started = False
            try:
                async for message in call:
                    is_started = True
                    yield StreamEvent.from_pb(message)
                return
            except grpc.RpcError as exc:
                error = SegserveError.from_rpc_error(exc)
                delay_s = None if is_started else self._retry_delay_s(error, num_attempts, deadline)
                if delay_s is None:
                    error.num_attempts = num_attempts
                    raise error from exc
            finally:
                call.cancel()  # a no-op once the call ended; else the caller left the loop: cancel the request
            await asyncio.sleep(delay_s)

    async def tokenize(self, text: str | None = None, *, messages: ChatMessages | None = None, model: str = "",
                       timeout_s: float | None = None) -> TokenizeResult:
        """See Client.tokenize."""
        request = tokenize_request(text, messages, model)
        return TokenizeResult.from_pb(await self._unary(self._get_stub().Tokenize, request, timeout_s))

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False, model: str = "",
                         timeout_s: float | None = None) -> str:
        """See Client.detokenize."""
        request = pb.DetokenizeRequest(model=model, token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return (await self._unary(self._get_stub().Detokenize, request, timeout_s)).text

    async def list_models(self, *, timeout_s: float | None = None) -> tuple[ModelCard, ...]:
        """See Client.list_models."""
        reply = await self._unary(self._get_stub().ListModels, pb.ListModelsRequest(), timeout_s)
        return tuple(ModelCard.from_pb(card) for card in reply.models)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _unary(self, method: Callable, request, timeout_s: float | None):
        deadline = self._deadline(timeout_s)
        num_attempts = 0
        while True:
            num_attempts += 1
            try:
                return await method(request, timeout=self._remaining_s(deadline), metadata=self.metadata)
            except grpc.RpcError as exc:
                error = SegserveError.from_rpc_error(exc)
                delay_s = self._retry_delay_s(error, num_attempts, deadline)
                if delay_s is None:
                    raise error from exc
            await asyncio.sleep(delay_s)
