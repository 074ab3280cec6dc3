"""The blocking client (grpc's synchronous channel): for scripts, threads and synchronous services."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import grpc

from protos.segserve.v1 import generation_pb2 as pb
from protos.segserve.v1 import generation_pb2_grpc
from segserve.client.base import ChatMessages, ClientBase, channel_of, generation_request, tokenize_request
from segserve.client.errors import SegserveError
from segserve.client.results import GenerationResult, ModelCard, StreamEvent, TokenizeResult


class Client(ClientBase):
    """A blocking client of segserve.v1.Generation (the router's gRPC API).

    target: host:port of the router's gRPC port (or any gRPC target: dns:///name:8001, unix:path).
    api_key: sent with every call as the metadata `authorization: Bearer <key>`.
    timeout_s: the default deadline of a call, retries included (None = none); each method's timeout_s
      overrides it.
    retry: which failures are retried and how long to wait (RetryPolicy; RetryPolicy(max_attempts=1) = never).
    tls, ca_file, cert_file, key_file: TLS (implied by any file): ca_file verifies the server (None = the
      system's roots), cert_file/key_file are the client certificate for mutual TLS. server_name: the name the
      server's certificate carries when it is not the target's host.
    metadata: more metadata for every call (e.g. ("x-client-id", "billing") for data reflow).
    options: grpc channel options (e.g. ("grpc.max_receive_message_length", ...)).

    Failures raise SegserveError. Use it as a context manager, or call close().
    """

    def __init__(self, target: str = "localhost:8001", **settings) -> None:
        super().__init__(target, **settings)
        self._channel = channel_of(self, grpc)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def generate(self, prompt: str | None = None, *, messages: ChatMessages | None = None, model: str = "",
                 request_id: str = "", session_id: str = "", timeout_s: float | None = None,
                 **parameters) -> GenerationResult:
        """Generate for a prompt (or a chat, `messages`) and return the finished result. `parameters` are
        GenerationParameters' fields: max_tokens, temperature (0 = greedy), top_k, top_p, stop, n, logprobs,
        details, ignore_eos, seed, ... (protos/segserve/v1/generation.proto), and at most one structured output:
        json_schema (a dict, its JSON text or a pydantic model class), json_object=True, regex, choice (a list
        of strings) or grammar (EBNF whose root rule is `root`)."""
        request = generation_request(prompt, messages, model, request_id, session_id, parameters)
        return GenerationResult.from_pb(self._unary(self._stub.Generate, request, timeout_s))

    def stream(self, prompt: str | None = None, *, messages: ChatMessages | None = None, model: str = "",
               request_id: str = "", session_id: str = "", timeout_s: float | None = None,
               **parameters) -> Iterator[StreamEvent]:
        """As `generate`, streamed: one event per text delta. The call starts when iteration does; leaving the
        loop early cancels the request on the server."""
        request = generation_request(prompt, messages, model, request_id, session_id, parameters)
        return self._stream(request, timeout_s)

    def tokenize(self, text: str | None = None, *, messages: ChatMessages | None = None, model: str = "",
                 timeout_s: float | None = None) -> TokenizeResult:
        """Token ids of a prompt (or of a chat rendered with the chat template), as generate() tokenizes it."""
        return TokenizeResult.from_pb(self._unary(self._stub.Tokenize, tokenize_request(text, messages, model),
                                                  timeout_s))

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False, model: str = "",
                   timeout_s: float | None = None) -> str:
        """The text of token ids."""
        request = pb.DetokenizeRequest(model=model, token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return self._unary(self._stub.Detokenize, request, timeout_s).text

    def list_models(self, *, timeout_s: float | None = None) -> tuple[ModelCard, ...]:
        """The served models (one)."""
        reply = self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout_s)
        return tuple(ModelCard.from_pb(card) for card in reply.models)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _unary(self, method: Callable, request, timeout_s: float | None):
        deadline = self._deadline(timeout_s)
        num_attempts = 0
        while True:
            num_attempts += 1
            try:
                return method(request, timeout=self._remaining_s(deadline), metadata=self.metadata)
            except grpc.RpcError as exc:
                error = SegserveError.from_rpc_error(exc)
                delay_s = self._retry_delay_s(error, num_attempts, deadline)
                if delay_s is None:
                    raise error from exc
            time.sleep(delay_s)

    def _stream(self, request: pb.GenerationRequest, timeout_s: float | None) -> Iterator[StreamEvent]:
        deadline = self._deadline(timeout_s)
        num_attempts = 0
        while True:
            num_attempts += 1
            call = self._stub.GenerateStream(request, timeout=self._remaining_s(deadline), metadata=self.metadata)
            is_started = False
            try:
                for message in call:
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
            time.sleep(delay_s)
