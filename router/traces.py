"""The router's spans: one per generation request, the root of the request's trace (or a child of the client's).

In: a request on a generate route (`TraceMiddleware`, HTTP: /v1/completions, /v1/chat/completions,
/v2/models/.../generate[_stream]) or a Generate / GenerateStream call of the public gRPC API (`grpc_span`), with
its `traceparent` (an HTTP header, gRPC metadata), honoured as the span's parent. Out: the span `router.request`,
current while the request runs (its stream included), with the attributes segserve.api (API_NAMES, or "grpc"),
segserve.request_id and segserve.tenant, and the HTTP method, path and status on HTTP; and, through `traced`
(called where every GenerateRequest leaves, scheduler_client.py), its W3C context in the GenerateRequest's
trace_context, which the scheduler's spans of the request hang under.

app.py adds the middleware only while tracing is on (common/tracing.py), so a router without it runs none of this.
"""

from __future__ import annotations

import dataclasses

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from protos.segserve.v1.generate import GenerateRequest
from common import tracing

SPAN_NAME = "router.request"
API_NAMES = {"/v1/chat/completions": "openai.chat", "/v1/completions": "openai.completions"}
"""segserve.api of the OpenAI routes by path; /v2's generate routes are "v2", the gRPC API's calls "grpc"."""
_CONTEXT_HEADERS = (b"traceparent", b"tracestate")


def api_of(path: str) -> str | None:
    """The API a request path is a generation of (API_NAMES, "v2"); None for any other route."""
    api = API_NAMES.get(path)
    if api is None and path.startswith("/v2/models/") and path.endswith(("/generate", "/generate_stream")):
        api = "v2"
    return api


class TraceMiddleware:
    """ASGI middleware: a generate route's request runs in its router.request span (outermost, so that a refusal
    by the guard or the drain is in it too, with its status)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = api_of(scope["path"]) if scope["type"] == "http" else None
        if api is None:
            await self.app(scope, receive, send)
            return
        carrier = {name.decode(): value.decode("latin-1") for name, value in scope["headers"]
                   if name in _CONTEXT_HEADERS}
        attributes = {"segserve.api": api, "http.request.method": scope["method"], "url.path": scope["path"]}
        with tracing.root_span(SPAN_NAME, carrier, attributes=attributes) as span:

            async def send_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        tracing.set_error(span, f"HTTP {status}")
                await send(message)

            await self.app(scope, receive, send_status)


def grpc_span(context):
    """A context manager running a public gRPC generation call (its servicer `context`) in its router.request span;
    nothing when tracing is off."""
    if not tracing.is_enabled():
        return tracing.NO_SPAN
    carrier = {key.lower(): value for key, value in context.invocation_metadata() or ()
               if key.lower() in ("traceparent", "tracestate") and isinstance(value, str)}
    return tracing.root_span(SPAN_NAME, carrier, attributes={"segserve.api": "grpc"})


def traced(request: GenerateRequest) -> GenerateRequest:
    """`request` carrying the current router.request span's context (GenerateRequest.trace_context), the span
    its request id (the first generation's, when a request has n) and tenant; `request` itself when there is no
    sampled span (tracing off, or not sampled)."""
    span = tracing.current_span()
    if span is None:
        return request
    if "segserve.request_id" not in span.attributes:
        span.set_attributes({"segserve.request_id": request.request_id, "segserve.tenant": request.tenant})
    carrier: dict[str, str] = {}
    tracing.inject(carrier)
    return dataclasses.replace(request, trace_context=tuple(sorted(carrier.items())))
