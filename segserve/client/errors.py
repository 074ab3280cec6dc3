"""The client's one exception type, made from a gRPC status (or a request refused before it was sent)."""

from __future__ import annotations

import grpc

RETRY_AFTER_KEY = "retry-after-ms"
"""Trailing metadata of RESOURCE_EXHAUSTED: how long the server asks the caller to wait, in ms."""
INVALID_FIELD_KEY = "invalid-field"
"""Trailing metadata of INVALID_ARGUMENT: the path of the field at fault (e.g. `parameters.top_p`)."""


class SegserveError(Exception):
    """A call that failed: `code` is the gRPC status name ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED",
    "UNAUTHENTICATED", "NOT_FOUND", "UNAVAILABLE", "DEADLINE_EXCEEDED", ...), `message` the server's words."""

    def __init__(self, code: str, message: str, field: str | None = None, retry_after_s: float | None = None,
                 num_attempts: int = 1) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.field = field
        """With INVALID_ARGUMENT: the path of the field at fault, as the server named it."""
        self.retry_after_s = retry_after_s
        """The wait the server asked for (its `retry-after-ms`), if it asked."""
        self.num_attempts = num_attempts
        """Calls made, retries included."""

    @property
    def status(self) -> grpc.StatusCode | None:
        """The grpc.StatusCode of `code` (None for a name gRPC does not know)."""
        return grpc.StatusCode.__members__.get(self.code)

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> SegserveError:
        """From a failed call of grpc (a grpc.Call) or grpc.aio (an AioRpcError)."""
        code = error.code()
        trailers = {key: value for key, value in (error.trailing_metadata() or ()) if isinstance(value, str)}
        return cls(code.name if code is not None else "UNKNOWN", error.details() or "",
                   trailers.get(INVALID_FIELD_KEY), _milliseconds(trailers.get(RETRY_AFTER_KEY)))


def _milliseconds(value: str | None) -> float | None:
    """A non-negative millisecond count in seconds; None when absent or malformed (then the client's backoff)."""
    try:
        milliseconds = float(value) if value is not None else None
    except ValueError:
        return None
    return milliseconds / 1000 if milliseconds is not None and 0 <= milliseconds < float("inf") else None
