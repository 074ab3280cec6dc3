"""The public gRPC API (segserve.v1.Generation), served by the router process beside HTTP.

In: GenerationRequest / TokenizeRequest / DetokenizeRequest / ListModelsRequest
over gRPC. Out: the same generations the HTTP routes run, through the same
pipeline and the same `RouterState` (tokenizer and chat template, admission,
stop strings, n choices, incremental detokenization, scheduler pool, metrics
labelled protocol="grpc", data reflow): grpc_convert.py turns the messages into
jobs and Deltas back into messages; this module owns the servicer, the error
mapping and the server. A structured output's grammar must compile before the
request is queued (structured.check_compiles, as /v1: bounded, cached, after the
contract's cheaper checks).

Every method goes through `_rpc` (the one place exceptions become statuses):
the API key first (the metadata `authorization: Bearer <key>`, router
`api_keys`), then the method; an `APIError` (what the HTTP routes raise) or a
scheduler failure becomes its status: 400 INVALID_ARGUMENT naming the field
(also in the trailing metadata `invalid-field`), 404 NOT_FOUND, overload
RESOURCE_EXHAUSTED with `retry-after-ms`, UNAVAILABLE, DEADLINE_EXCEEDED; any
other exception is a bug, logged and answered INTERNAL.

Tracing (when on): Generate and GenerateStream run in the request's span (traces.py), a child of the
caller's `traceparent` metadata when it sends one.

Cancellation: when the caller cancels or its deadline passes, gRPC cancels the
handler's task; leaving the handler closes the Delta stream, which closes
generate_deltas and so cancels the scheduler call (its slot and KV blocks are
freed within one step). The scheduler is also given the caller's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from protos.segserve.v1 import generation_pb2 as pb
from protos.segserve.v1 import generation_pb2_grpc
from protos.segserve.v1.generate import GenerateError
from router.choices import merge_choices
from router.config import RouterConfig
from router.detokenizer import IncrementalDetokenizer
from router.errors import RETRY_AFTER_S, APIError
from router.generation import GenerationJob, generate_deltas
from router.grpc_convert import (
    Prompt,
    Renderer,
    StepSizes,
    choice_jobs,
    prompt_of,
    reflow_body,
    stop_strings,
    structured_output,
)
from router.guard import is_authorized
from router.metrics import ProtocolMetrics, RequestTracker
from router.output_validation import validated_outputs
from router.tenants import InvalidTenant, current_tenant, tenant_for
from router.reflow.chunks import FinishState
from router.reflow.gateway import client_id, record_deltas, state_for_status
from router.reflow.recorder import RequestRecording
from router.state import RouterState
from router.stop import stop_at_strings
from router.structured import check_compiles
from router.traces import grpc_span
from common.health import Serving, start_serving
from common.tls import EXCLUSIVE_PORT

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_HTTP_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                404: grpc.StatusCode.NOT_FOUND, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
_FAILURE_STATUS = {"invalid_request": grpc.StatusCode.INVALID_ARGUMENT, "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
                   "unavailable": grpc.StatusCode.UNAVAILABLE, "timeout": grpc.StatusCode.DEADLINE_EXCEEDED,
                   "cancelled": grpc.StatusCode.CANCELLED}


class GenerationFailed(Exception):
    """The scheduler ended a generation with a GenerateError."""

    def __init__(self, failure: GenerateError) -> None:
        super().__init__(failure.message)
        self.failure = failure


def status_of(exc: Exception) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """(status, details, trailing metadata) answering `exc`."""
    if isinstance(exc, GenerationFailed):
        code = _FAILURE_STATUS.get(exc.failure.code, grpc.StatusCode.INTERNAL)
        details = exc.failure.message or exc.failure.code
    elif isinstance(exc, APIError):
        code = _HTTP_STATUS.get(exc.status, grpc.StatusCode.INTERNAL)
        details = exc.message
    else:
        return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}", ()
    metadata = ()
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        metadata = (("retry-after-ms", str(RETRY_AFTER_S * 1000)),)
    elif code is grpc.StatusCode.INVALID_ARGUMENT and getattr(exc, "param", None):
        metadata = (("invalid-field", exc.param),)
    return code, details, metadata


def _rpc(method):
    """Checks the API key, runs the method and maps its exceptions to statuses (unary or streaming)."""

    async def fail(context, exc: Exception):
        if not isinstance(exc, (APIError, GenerationFailed)):
            logger.exception("gRPC %s failed", method.__name__)
        code, details, metadata = status_of(exc)
        context.set_trailing_metadata(metadata)
        await context.abort(code, details)

    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self: GenerationServicer, request, context):
            try:
                self.authorize(context)
                async for message in method(self, request, context):
                    yield message
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await fail(context, exc)
        return stream

    @functools.wraps(method)
    async def unary(self: GenerationServicer, request, context):
        try:
            self.authorize(context)
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await fail(context, exc)
    return unary


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """segserve.v1.Generation over one RouterState."""

    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.metrics = ProtocolMetrics(state.metrics, "grpc")
        self._api_keys = [key.encode() for key in state.config.api_keys]

    def authorize(self, context: grpc.aio.ServicerContext) -> None:
        """Check the key, then set the call's tenant (router/tenants.py: the key's id, or a trusted header's)."""
        metadata = _metadata(context)
        authorization = metadata.get("authorization", "").encode()
        if self._api_keys and not is_authorized(authorization, self._api_keys):
            raise APIError(401, "Missing or invalid API key: send the metadata `authorization: Bearer <key>`.")
        header = self.state.config.tenant_header.lower()
        try:
            current_tenant.set(tenant_for(authorization, self._api_keys,
                                          metadata.get(header, "").encode() if header else None))
        except InvalidTenant as exc:
            raise APIError(400, str(exc)) from None

    @_rpc
    async def Generate(self, request: pb.GenerationRequest, context) -> pb.GenerationResponse:
        with grpc_span(context):
            run = await self._start(request, context)
            async with contextlib.aclosing(run.deltas(context)) as deltas:
                return run.renderer.response([delta async for delta in deltas])

    @_rpc
    async def GenerateStream(self, request: pb.GenerationRequest, context) -> AsyncIterator[pb.GenerationStreamResponse]:
        with grpc_span(context):
            run = await self._start(request, context)
            async with contextlib.aclosing(run.deltas(context)) as deltas:
                async for delta in deltas:
                    event = run.renderer.event(delta)
                    if event is not None:
                        yield event

    @_rpc
    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        self.state.check_model(request.model or None)
        token_ids = prompt_of(self.state, request.text, request.messages, "text").token_ids
        return pb.TokenizeResponse(token_ids=token_ids, tokens=[self.state.token_texts.get(t)[0] for t in token_ids],
                                   max_model_len=self.state.model_info.max_model_len)

    @_rpc
    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        self.state.check_model(request.model or None)
        text = self.state.decode(list(request.token_ids), "token_ids", skip_special_tokens=request.skip_special_tokens)
        return pb.DetokenizeResponse(text=text)

    @_rpc
    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        info = self.state.model_info
        return pb.ListModelsResponse(models=[pb.ModelCard(
            id=self.state.served_name, created=self.state.created, owned_by="segserve",
            max_model_len=info.max_model_len, vocab_size=info.vocab_size)])

    async def _start(self, request: pb.GenerationRequest, context) -> GenerationRun:
        """Record, validate and prepare one generation (not started yet); an APIError when refused."""
        arrived_s = time.monotonic()
        metadata = _metadata(context)
        response_id = request.request_id or f"grpc-{uuid.uuid4().hex}"
        recording = self._record(request, response_id, metadata)
        try:
            self.state.check_model(request.model or None)
            prompt = prompt_of(self.state, request.prompt, request.messages)
            stops = stop_strings(request.parameters)
            structured = structured_output(request.parameters)
            jobs = choice_jobs(self.state, request, prompt, f"grpc-{uuid.uuid4().hex}", self._timeout_s(context),
                               structured)
            if structured is not None:
                param, output = structured
                await check_compiles(output, param)
        except APIError as exc:
            if recording is not None:
                recording.finish(state_for_status(exc.status), error=exc.message)
            raise
        step_sizes = [StepSizes() for _ in jobs]
        renderer = Renderer(self.state, response_id, prompt.token_ids, step_sizes, request.parameters.details,
                            arrived_s)
        return GenerationRun(self.state, self.metrics, prompt, jobs, stops, step_sizes, renderer, recording)

    def _timeout_s(self, context) -> float | None:
        """The scheduler's deadline: the router's request timeout or the caller's deadline, the sooner."""
        limits = [self.state.config.request_timeout_s or float("inf")]
        remaining = context.time_remaining()
        if remaining is not None:
            limits.append(max(remaining, 0.001))
        timeout_s = min(limits)
        return None if timeout_s == float("inf") else timeout_s

    def _record(self, request: pb.GenerationRequest, request_id: str, metadata: dict[str, str]
                ) -> RequestRecording | None:
        recorder = self.state.recorder
        if recorder is None:
            return None
        body = reflow_body(request, self.state.served_name)
        session_id = request.session_id or metadata.get("x-session-id", "")
        return recorder.start_request(request_id, client_id(metadata), self.state.served_name,
                                      json.dumps(body, ensure_ascii=False).encode(), parsed_body=body,
                                      headers={"x-session-id": session_id} if session_id else None)


class GenerationRun:
    """One admitted generation: its jobs, how its Deltas are read and rendered, and its recording."""

    def __init__(self, state: RouterState, metrics: ProtocolMetrics, prompt: Prompt, jobs: list[GenerationJob],
                 stops: list[str], step_sizes: list[StepSizes], renderer: Renderer,
                 recording: RequestRecording | None) -> None:
        self.state, self.metrics, self.prompt, self.jobs, self.stops = state, metrics, prompt, jobs, stops
        self.step_sizes, self.renderer, self.recording = step_sizes, renderer, recording

    def _choice(self, index: int) -> AsyncIterator:
        job = self.jobs[index]
        detokenizer = IncrementalDetokenizer(self.state.tokenizer, job.prompt_token_ids,
                                             hidden_token_ids=self.state.hidden_token_ids)
        observers = (RequestTracker(self.metrics), self.step_sizes[index])
        events = generate_deltas(self.state.scheduler, job, detokenizer, observers=observers)
        events = stop_at_strings(events, self.stops, len(self.prompt.token_ids)) if self.stops else events
        return validated_outputs(events, job)

    async def deltas(self, context) -> AsyncIterator:
        """The Deltas (choices merged); a scheduler failure raises GenerationFailed. Closing this (the handler
        was cancelled) cancels the scheduler calls; a caller past its deadline is recorded as `deadline`."""
        events = self._choice(0) if len(self.jobs) == 1 else merge_choices(
            [self._choice(index) for index in range(len(self.jobs))])
        async with contextlib.aclosing(record_deltas(events, self.recording)) as recorded:
            try:
                async for event in recorded:
                    if isinstance(event, GenerateError):
                        raise GenerationFailed(event)
                    yield event
            except (asyncio.CancelledError, GeneratorExit):
                if self.recording is not None and context.time_remaining() is not None \
                        and context.time_remaining() <= 0:
                    self.recording.finish(FinishState.DEADLINE)
                raise


def _metadata(context) -> dict[str, str]:
    """The call's metadata, text values only, keys in lower case."""
    return {key.lower(): value for key, value in (context.invocation_metadata() or ())
            if isinstance(value, str)}


def server_options(config: RouterConfig) -> list[tuple[str, int]]:
    """Message limits, and keep-alive settings that let long streams live behind load balancers: the server
    pings idle connections, accepts the clients' own pings (with or without calls under way, every 10 s at
    most) and keeps pinging a stream that sends no data for a long time (prefill, a long queue). The port is
    bound exclusively (EXCLUSIVE_PORT), so a second router on a taken port fails to start as it does on HTTP's."""
    return [
        EXCLUSIVE_PORT,
        ("grpc.max_receive_message_length", config.grpc_max_message_bytes),
        ("grpc.max_send_message_length", config.grpc_max_message_bytes),
        ("grpc.keepalive_time_ms", int(config.grpc_keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.grpc_keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.max_ping_strikes", 2),
    ]


class GrpcApi:
    """The running gRPC server of the public API: Generation, health and reflection on one port."""

    def __init__(self, server: grpc.aio.Server, serving: Serving, port: int) -> None:
        self.server = server
        self.serving = serving
        self.port = port
        """The bound port (the chosen one with grpc_port 0)."""

    async def stop(self, grace_s: float = 5.0) -> None:
        """NOT_SERVING, then stop; calls under way get `grace_s` to finish. Safe to call twice."""
        await self.serving.set(False)
        await self.server.stop(grace_s)


async def start_grpc_server(state: RouterState, config: RouterConfig) -> GrpcApi:
    """Serve the public gRPC API on config.host:config.grpc_port (in the running event loop, the one of
    `state`'s scheduler client): over TLS with the HTTPS certificate and key when the router has them
    (config.tls), in plaintext otherwise."""
    server = grpc.aio.server(options=server_options(config))
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(state), server)
    serving = Serving([SERVICE_NAME])
    port = await start_serving(server, serving, f"{config.host}:{config.grpc_port}", config.tls, "the gRPC API")
    await serving.set(True)
    logger.info("public gRPC API on %s:%d (%s)", config.host, port, "TLS" if config.tls else "plaintext")
    return GrpcApi(server, serving, port)
