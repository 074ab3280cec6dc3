"""The MindIE/Triton-style API: POST /v2/models/{model}[/versions/{version}]/generate[_stream].

In: `{"id", "text_input", "parameters": {...}}` (SPEC section 4), checked strictly:
wrong types, out-of-range values and unknown fields are a 400 whose `param` is the
dotted path of the field (`parameters.top_k`). Out: `{"id", "model_name",
"model_version", "text_output", "details"}`; streamed, one SSE event per delta,
every event with `details`, the last one's carrying `finish_reason`, and no end
marker after it. The request runs through the OpenAI routes' machinery (app.py's
`respond`: generate_deltas, keep-alive comments, an error event inside the stream,
cancellation when the client leaves); this module owns only the body and the renderer.

Limits, in MindIE's names: maxSeqLen is the model's max_model_len (the scheduler's
context limit, which the worker keeps within max_position_embeddings) and
maxIterTimes is what the prompt leaves of it. So `max_new_tokens` may be at most
max_model_len - prompt tokens (default 20, cut to the room left), and `text_input`
at most max_model_len - max_new_tokens tokens.

Where `details` come from:
- generated_tokens: tokens the router has read so far (the scheduler's count at the end).
- first_token_cost (ms), router clock: the HTTP request's arrival to the first token
  read, i.e. what the client waits (tokenization and the gRPC hop included).
- decode_cost (ms), router clock: the first token to the newest one.
- batch_size (the largest batch the request ran in) and queue_wait_time (us, arrival
  at the scheduler to first scheduling): the scheduler's measurements, sent with
  every token chunk (so every stream event carries them, as of its newest token).
`perf_stat: true` adds the router's per-token latencies and the scheduler's own
first-token and decode times (its clock: no HTTP, tokenization or gRPC in them).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from router.config import RouterConfig
from router.errors import ErrorBody, bad_request, describe_validation_errors, model_not_found
from router.generation import Delta, GenerationJob
from router.prompts import max_new_tokens
from router.scheduler_client import FinishReason, GenerateComplete, GenerateParams, ModelInfo

MAX_TEXT_INPUT_CHARS = 512 * 1024
DEFAULT_MAX_NEW_TOKENS = 20
MAX_SEED = 2**64 - 1

_FINISH = {
    FinishReason.EOS_TOKEN: "eos_token",
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT_LENGTH: "length",
    FinishReason.STOP_TOKEN: "stop_sequence",
}

# app.py's `respond(request, job, renderer, stream, include_usage)`.
Respond = Callable[[Request, GenerationJob, Any, bool, bool], Awaitable[Response]]


class Parameters(BaseModel):
    """`parameters`: every field optional, with MindIE's defaults."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    details: bool = False
    """Non-streamed responses: add `details` (streams always carry them)."""
    do_sample: bool = False
    max_new_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, gt=0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = Field(default=None, gt=0, le=MAX_SEED)
    """None = the scheduler picks one."""
    temperature: float = Field(default=1.0, gt=0.0)
    top_k: int = Field(default=0, ge=0)
    """0 = off; below the vocabulary size (checked by the route, which knows the model)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    batch_size: int = Field(default=1, gt=0)
    """Accepted for compatibility; the scheduler batches continuously, so it picks the batch."""
    typical_p: float | None = Field(default=None, gt=0.0, le=1.0)
    """None = off (MindIE's -1, which may not be sent)."""
    watermark: bool = False
    """Green-list watermark (worker/watermark.py); `segserve watermark detect` tests text for it."""
    perf_stat: bool = False

    def to_params(self, budget: int) -> GenerateParams:
        return GenerateParams(
            max_new_tokens=budget, do_sample=self.do_sample, temperature=self.temperature, top_k=self.top_k,
            top_p=self.top_p, typical_p=1.0 if self.typical_p is None else self.typical_p,
            repetition_penalty=self.repetition_penalty, seed=self.seed, watermark=self.watermark,
        )


class GenerateRequest(BaseModel):
    """The body of both routes."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str | None = Field(default=None, min_length=1)
    """Echoed in the response; None = the router's request id."""
    text_input: str = Field(min_length=1, max_length=MAX_TEXT_INPUT_CHARS)
    parameters: Parameters = Field(default_factory=Parameters)


class _OmitNone(BaseModel):
    """Serializes without the fields that are None, except those in `_keep_null`."""

    _keep_null: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None or k in self._keep_null}


class Details(_OmitNone):
    """What the request cost so far (units and sources in the module docstring)."""

    finish_reason: str | None = None
    generated_tokens: int
    first_token_cost: float
    decode_cost: float
    batch_size: int | None = None
    queue_wait_time: int | None = None


class PerfStat(_OmitNone):
    token_latencies_ms: list[float]
    """Per token of this body, router clock: ms since the previous token (the first: since arrival).
    Tokens that arrived together (one step, several with speculation) share that step's time."""
    scheduler_first_token_ms: float | None = None
    scheduler_decode_ms: float | None = None


class GenerateResponse(_OmitNone):
    """The non-streamed body and every stream event."""

    _keep_null: ClassVar[frozenset[str]] = frozenset({"model_version"})

    id: str
    model_name: str
    model_version: str | None
    text_output: str
    details: Details | None = None
    perf_stat: PerfStat | None = None


def _ms(start_s: float, end_s: float) -> float:
    return round((end_s - start_s) * 1e3, 3)


class V2Renderer:
    """Builds /v2 bodies from Deltas, timing each against the request's arrival."""

    stream_done = None  # a /v2 stream ends with the event that carries finish_reason

    def __init__(self, response_id: str, model_name: str, model_version: str | None, arrived_s: float,
                 is_details: bool, is_perf_stat: bool) -> None:
        self.response_id = response_id
        self.model_name = model_name
        self.model_version = model_version
        self.arrived_s = arrived_s
        self.is_details = is_details
        self.is_perf_stat = is_perf_stat
        self._num_tokens = 0
        self._batch_size: int | None = None  # the scheduler's figures, from its latest chunk
        self._queue_wait_us: int | None = None
        self._first_token_s: float | None = None
        self._last_token_s = arrived_s
        self._pending_latencies_ms: list[float] = []  # tokens read but not yet sent in a body

    def _read(self, delta: Delta) -> None:
        if not delta.num_tokens:
            return
        if delta.batch_size:
            self._batch_size, self._queue_wait_us = delta.batch_size, delta.queue_wait_us
        if self._first_token_s is None:
            self._first_token_s = delta.received_s
        step_ms = _ms(self._last_token_s, delta.received_s)
        self._pending_latencies_ms += [round(step_ms / delta.num_tokens, 3)] * delta.num_tokens
        self._num_tokens += delta.num_tokens
        self._last_token_s = delta.received_s

    def _details(self, done: GenerateComplete | None) -> Details:
        first_s = self._last_token_s if self._first_token_s is None else self._first_token_s
        if done is None:
            return Details(generated_tokens=self._num_tokens, first_token_cost=_ms(self.arrived_s, first_s),
                           decode_cost=_ms(first_s, self._last_token_s), batch_size=self._batch_size,
                           queue_wait_time=self._queue_wait_us)
        return Details(
            finish_reason=_FINISH.get(done.finish_reason, done.finish_reason.value),
            generated_tokens=done.num_generated_tokens, first_token_cost=_ms(self.arrived_s, first_s),
            decode_cost=_ms(first_s, self._last_token_s), batch_size=done.max_batch_size,
            queue_wait_time=done.queue_wait_us,
        )

    def _perf_stat(self, done: GenerateComplete | None) -> PerfStat | None:
        if not self.is_perf_stat:
            return None
        latencies, self._pending_latencies_ms = self._pending_latencies_ms, []
        if done is None:
            return PerfStat(token_latencies_ms=latencies)
        return PerfStat(token_latencies_ms=latencies, scheduler_first_token_ms=done.first_token_us / 1e3,
                        scheduler_decode_ms=done.decode_us / 1e3)

    def _body(self, text: str, done: GenerateComplete | None, with_details: bool) -> GenerateResponse:
        return GenerateResponse(
            id=self.response_id, model_name=self.model_name, model_version=self.model_version, text_output=text,
            details=self._details(done) if with_details else None, perf_stat=self._perf_stat(done),
        )

    def start(self) -> list[BaseModel]:
        return []

    def chunk(self, delta: Delta) -> GenerateResponse | None:
        """One stream event; None while tokens have no final text yet (they count in the next event)."""
        self._read(delta)
        if not delta.text and delta.finish_reason is None:
            return None
        return self._body(delta.text, delta.complete, with_details=True)

    def response(self, deltas: list[Delta]) -> GenerateResponse:
        for delta in deltas:
            self._read(delta)
        return self._body("".join(d.text for d in deltas), deltas[-1].complete, self.is_details)


def parse_body(raw: bytes) -> GenerateRequest:
    """The validated body; any problem is a 400 whose `param` is the dotted path of the first bad field."""
    try:
        return GenerateRequest.model_validate_json(raw)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        message, _ = describe_validation_errors(errors)
        loc = next((err["loc"] for err in errors if err["type"] != "json_invalid"), ())
        raise bad_request(message, ".".join(str(part) for part in loc) or None) from None


def _inline_refs(node: Any, defs: dict) -> Any:
    """`node` with every `{"$ref": "#/$defs/X"}` replaced by X itself (OpenAPI has no place for `$defs`)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline_refs(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {key: _inline_refs(value, defs) for key, value in node.items()}
    if isinstance(node, list):
        return [_inline_refs(value, defs) for value in node]
    return node


def _json_schema(model: type[BaseModel]) -> dict:
    schema = model.model_json_schema()
    return _inline_refs(schema, schema.pop("$defs", {}))


def _openapi(served_name: str, stream: bool, is_versioned: bool) -> dict:
    """The route's OpenAPI description: FastAPI cannot infer it, as `parse_body` reads the body by hand."""
    body_schema, response_schema = _json_schema(GenerateRequest), _json_schema(GenerateResponse)
    path_params = [{"name": "model", "in": "path", "required": True,
                    "schema": {"type": "string", "enum": [served_name]}}]
    if is_versioned:
        path_params.append({"name": "version", "in": "path", "required": True, "schema": {"type": "string"}})
    # A stream's `schema` describes each SSE event: its data is a body, or the error that ended the stream.
    event_data = {"type": "string", "contentMediaType": "application/json",
                  "contentSchema": {"anyOf": [response_schema, _json_schema(ErrorBody)]}}
    ok = ({"text/event-stream": {"schema": {"type": "object", "properties": {"data": event_data},
                                            "required": ["data"]}}} if stream
          else {"application/json": {"schema": response_schema}})
    return {
        "parameters": path_params,
        "requestBody": {"required": True, "content": {"application/json": {"schema": body_schema}}},
        "responses": {"200": {"description": "The generated text", "content": ok}},
    }


def install_v2_routes(app: FastAPI, config: RouterConfig, model_info: ModelInfo, served_name: str, tokenizer,
                      respond: Respond) -> None:
    """Add the four /v2 generate routes to `app`; `respond` runs a job as the OpenAI routes do."""
    eos_token_ids = frozenset(model_info.eos_token_ids)

    def endpoint(stream: bool):
        async def generate(request: Request) -> Response:
            arrived_s = time.monotonic()
            model, version = request.path_params["model"], request.path_params.get("version")
            if model != served_name:
                raise model_not_found(model)
            body = parse_body(await request.body())
            params = body.parameters
            if params.top_k >= model_info.vocab_size:
                raise bad_request(f"top_k must be below the vocabulary size {model_info.vocab_size}",
                                  "parameters.top_k")
            prompt_ids = list(tokenizer(body.text_input).input_ids)
            if not prompt_ids:
                raise bad_request("text_input tokenizes to no tokens", "text_input")
            requested = params.max_new_tokens if "max_new_tokens" in params.model_fields_set else None
            budget = max_new_tokens(requested, len(prompt_ids), model_info.max_model_len, DEFAULT_MAX_NEW_TOKENS,
                                    "text_input", "parameters.max_new_tokens")
            request_id = f"gen-{uuid.uuid4().hex}"
            job = GenerationJob(request_id=request_id, prompt_token_ids=prompt_ids, params=params.to_params(budget),
                                eos_token_ids=eos_token_ids, timeout_s=config.request_timeout_s or None)
            renderer = V2Renderer(body.id or request_id, served_name, version, arrived_s, params.details,
                                  params.perf_stat)
            return await respond(request, job, renderer, stream, False)

        return generate

    for suffix, stream in (("generate", False), ("generate_stream", True)):
        # The versioned path first: `{model:path}` would otherwise take "m/versions/1" as a model name.
        app.add_api_route(f"/v2/models/{{model:path}}/versions/{{version}}/{suffix}", endpoint(stream),
                          methods=["POST"], name=f"v2_{suffix}_version",
                          openapi_extra=_openapi(served_name, stream, is_versioned=True))
        app.add_api_route(f"/v2/models/{{model:path}}/{suffix}", endpoint(stream), methods=["POST"],
                          name=f"v2_{suffix}", openapi_extra=_openapi(served_name, stream, is_versioned=False))
