"""The request guard in front of every HTTP route: API keys, tenants and the body-size limit.

In: each HTTP request's path and headers (and, without a declared length, its body). Out: the request passed on
to the app, or answered at once: 401 on /v1, /v2, /(de)tokenize and /tokenizer_info without one of
`config.api_keys`, 413 for a body over `config.max_request_body_bytes`, both before the body is parsed or any
work starts; with `metrics_require_key`, /metrics and /status want a key too. It also sets the request's
tenant (router/tenants.py: from its key, or a trusted tenant header; 400 for an invalid one), which
scheduler_client.py sends in the GenerateRequest. `is_authorized` is the key check the gRPC API shares.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import INVALID_REQUEST, error_body
from router.tenants import InvalidTenant, current_tenant, matching_key, tenant_for


class RequestGuard:
    """ASGI middleware: API keys on /v1, /v2, /(de)tokenize and /tokenizer_info and the body-size limit, checked
    before any route runs."""

    def __init__(self, app: ASGIApp, api_keys: list[str], max_body_bytes: int, tenant_header: str = "",
                 is_metrics_key_required: bool = False) -> None:
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]
        self.max_body_bytes = max_body_bytes
        self.tenant_header = tenant_header.lower()
        """A header whose value is the tenant when no keys are configured ("" = none trusted; router/tenants.py)."""
        self.is_metrics_key_required = is_metrics_key_required
        """/metrics and /status want a key too."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1").lower(): value for name, value in scope["headers"]}
        path = scope["path"]
        is_keyed = _is_api_path(path) or (self.is_metrics_key_required and _is_ops_path(path))
        if self.api_keys and is_keyed and not self._is_authorized(headers):
            error = JSONResponse(
                error_body("Missing or invalid API key: send `Authorization: Bearer <key>`.", INVALID_REQUEST,
                           code="invalid_api_key"),
                status_code=401, headers={"WWW-Authenticate": "Bearer"})
            await error(scope, receive, send)
            return
        try:  # the API route's GenerateRequests carry it (router/scheduler_client.py)
            if _is_api_path(path):
                current_tenant.set(tenant_for(headers.get("authorization", b""), self.api_keys,
                                              headers.get(self.tenant_header) if self.tenant_header else None))
        except InvalidTenant as exc:
            await JSONResponse(error_body(str(exc), INVALID_REQUEST, code="invalid_tenant"),
                               status_code=400)(scope, receive, send)
            return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
            await self.app(scope, receive, send)  # the server holds the body to its declared length
            return
        # No declared length (chunked): read the body here, bounded, then replay it to the app.
        messages: list[Message] = []
        num_bytes = 0
        while not messages or messages[-1].get("more_body", False):
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left mid-body
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
            messages.append(message)

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    def _is_authorized(self, headers: dict[str, bytes]) -> bool:
        return is_authorized(headers.get("authorization", b""), self.api_keys)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = JSONResponse(
            error_body(f"The request body is larger than {self.max_body_bytes} bytes.", INVALID_REQUEST,
                       code="request_too_large"),
            status_code=413)
        await error(scope, receive, send)


def is_authorized(authorization: bytes, api_keys: list[bytes]) -> bool:
    """Whether an `Authorization` header (HTTP) or metadata value (gRPC) is `Bearer <one of api_keys>`."""
    return matching_key(authorization, api_keys) is not None


def _is_api_path(path: str) -> bool:
    return path.startswith(("/v1/", "/v2/")) or path in ("/v1", "/v2", "/tokenize", "/detokenize", "/tokenizer_info")


def _is_ops_path(path: str) -> bool:
    """What operators read: /metrics and /status (a key is asked for with is_metrics_key_required)."""
    return path in ("/metrics", "/status") or path.startswith(("/metrics/", "/status/"))
