"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}.

Bad input is always a 4xx naming the field: FastAPI's validation errors (422 by
default) and unparsable JSON become 400, an unknown model 404. Scheduler
failures map to the status a client can act on (429 with Retry-After when
overloaded, 503 when unavailable, 504 past the deadline).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from protos.segserve.v1.generate import GenerateError

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"

# GenerateError.code -> (HTTP status, OpenAI error type)
_FAILURE_STATUS = {
    "invalid_request": (400, INVALID_REQUEST),
    "overloaded": (429, RATE_LIMIT),
    "unavailable": (503, SERVER_ERROR),
    "timeout": (504, SERVER_ERROR),
}
RETRY_AFTER_S = 1


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error answer's body (`error_body`)."""

    error: ErrorDetail


# The OpenAPI description of the errors any route may answer (FastAPI's `responses`).
ERROR_RESPONSES: dict[int | str, dict] = {
    "4XX": {"model": ErrorBody, "description": "Invalid request (400 naming the field), unknown model or path "
                                               "(404), missing API key (401), body too large (413), overloaded "
                                               "(429, with Retry-After)"},
    "5XX": {"model": ErrorBody, "description": "The scheduler is unavailable (503) or past the deadline (504)"},
}


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(
        self, status: int, message: str, *, type: str = INVALID_REQUEST, param: str | None = None,
        code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", type=INVALID_REQUEST, param="model",
                    code="model_not_found")


def from_failure(failure: GenerateError) -> APIError:
    """The HTTP error for a scheduler failure."""
    status, type = _FAILURE_STATUS.get(failure.code, (500, SERVER_ERROR))
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return APIError(status, failure.message or failure.code, type=type, code=failure.code, headers=headers)


def _is_union_tag(segment: str) -> bool:
    """pydantic names the tried member of a union in `loc` ("str", "list[int]", "TextPart")."""
    return "[" in segment or segment in ("str", "int", "float", "bool") or segment[:1].isupper()


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic's error list; param is the first offending body field."""
    by_param: dict[str, list[dict]] = {}
    for err in errors:
        if err.get("type") == "json_invalid":
            return f"The request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        by_param.setdefault(loc[0] if loc else "", []).append({**err, "loc": loc})
    parts = []
    for param, errs in list(by_param.items())[:4]:
        custom = [e for e in errs if e.get("type") == "value_error"]
        chosen = (custom or errs)[0]
        path = ".".join(p for p in chosen["loc"] if not _is_union_tag(p))
        msg = str(chosen.get("msg", "invalid value")).removeprefix("Value error, ")
        if not path:
            parts.append(f"the request body must be a JSON object ({msg})")
            continue
        tags = [e["loc"][1] for e in errs if len(e["loc"]) > 1 and _is_union_tag(e["loc"][1])]
        if not custom and len(tags) > 1:
            msg = f"invalid type (accepted: {', '.join(dict.fromkeys(tags))})"
        parts.append(f"`{path}`: {msg}")
    params = [p for p in by_param if p]
    return "Invalid request: " + "; ".join(parts), params[0] if params else None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_errors(list(exc.errors()))
        return JSONResponse(error_body(message, INVALID_REQUEST, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST if exc.status_code < 500 else SERVER_ERROR
        return JSONResponse(error_body(str(exc.detail), type), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", SERVER_ERROR), status_code=500)
