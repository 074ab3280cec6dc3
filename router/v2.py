"""The MindIE/Triton-style API: POST /v2/models/{model}[/versions/{version}]/generate[_stream].

In: `{"id", "text_input", "parameters": {...}}` (SPEC section 4). The body checks
types strictly, unknown fields and MindIE's own rules (seed > 0, batch_size > 0,
id non-empty, text_input at most 512 KiB characters); the value ranges of the
sampling contract's fields are the contract's: the parameters become a contract
GenerateRequest (router/sampling.py, router/jobs.py: the same rule and builder as /v1's
and gRPC's) checked by admission.py. Any
problem is a 400 whose `param` is the dotted path of the field
(`parameters.top_k`, `parameters.max_new_tokens`). Out: `{"id", "model_name",
"model_version", "text_output"}`, plus `finish_reason` on the last event (and in
the non-streamed body), plus `details` only when the request asked for them
(`details: true`, streamed or not; then the last event's details carry the
finish_reason too); streamed, one SSE event per delta and no end marker after
the last. A request that failed alone in the worker ends with finish_reason
"error". The request runs through serving.py (generate_deltas, keep-alive
comments, an error event inside the stream, cancellation when the client
leaves); this module owns only the routes, the body and the renderer.

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
  every token chunk (so every stream event with details carries them, as of its newest token).
`perf_stat: true` adds the router's per-token latencies and the scheduler's own
first-token and decode times (its clock: no HTTP, tokenization or gRPC in them).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from protos.segserve.v1.generate import FinishReason, GenerateComplete
from protos.segserve.v1.sampling import RANGES, UINT32_MAX, SamplingParams
from router.admission import bounds
from router.errors import ErrorBody, bad_request, describe_validation_errors
from router.generation import Delta
from router.jobs import build_jobs
from router.responses import TextTemplate
from router.sampling import AskedSampling, sampling_params
from router.serving import respond
from router.state import StateDep

MAX_TEXT_INPUT_CHARS = 512 * 1024
DEFAULT_MAX_NEW_TOKENS = 20

_FINISH = {
    FinishReason.EOS_TOKEN: "eos_token",
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT_LENGTH: "length",
    FinishReason.STOP_TOKEN: "stop_sequence",
    FinishReason.ERROR: "error",
}
# The contract's field names -> /v2's (admission.check_request).
API_NAMES = {
    **{name: f"parameters.{name}" for name in (*RANGES, "do_sample", "watermark", "ignore_eos", "stop_token_ids")},
    "max_tokens": "parameters.max_new_tokens",
    "prompt_token_ids": "text_input",
    "request_id": "id",
}


class Parameters(BaseModel):
    """`parameters`: every field optional, with MindIE's defaults. Types here; ranges: the contract's."""

    model_config = ConfigDict(extra="forbid", strict=True)

    details: bool = False
    """Add `details` to the body, or to every stream event."""
    do_sample: bool = False
    max_new_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, json_schema_extra=bounds("max_tokens"))
    """At most what the prompt leaves of the context."""
    repetition_penalty: float = Field(default=1.0, json_schema_extra=bounds("repetition_penalty"))
    seed: int | None = Field(default=None, gt=0, json_schema_extra=bounds("seed", minimum=None))
    """None = the scheduler picks one; MindIE's range is (0, 2**64 - 1] (0 may not be sent)."""
    temperature: float = Field(default=1.0, json_schema_extra=bounds("temperature"))
    top_k: int = Field(default=0, json_schema_extra=bounds("top_k"))
    """0 = off; below the vocabulary size."""
    top_p: float = Field(default=1.0, json_schema_extra=bounds("top_p"))
    batch_size: int = Field(default=1, gt=0, le=UINT32_MAX)
    """Accepted for compatibility (a uint32); the scheduler batches continuously, so it picks the batch."""
    typical_p: float | None = Field(default=None, json_schema_extra=bounds("typical_p"))
    """None = off (MindIE's -1, which may not be sent: outside the contract's range)."""
    watermark: bool = False
    """Green-list watermark (worker/watermark.py); `segserve watermark detect` tests text for it."""
    perf_stat: bool = False

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_new_tokens` when the client sent it; None = the default, cut to the room the prompt leaves."""
        return self.max_new_tokens if "max_new_tokens" in self.model_fields_set else None

    def to_sampling(self) -> SamplingParams:
        """The contract's sampling (router/sampling.py): a sampling parameter sent, not only do_sample, samples;
        the temperature is MindIE's, > 0 (a 0 is refused, not greedy)."""
        sent = self.model_fields_set
        return sampling_params(AskedSampling(
            do_sample=self.do_sample, is_zero_temperature_greedy=False,
            temperature=self.temperature if "temperature" in sent else None,
            top_k=self.top_k, top_p=self.top_p, typical_p=self.typical_p, repetition_penalty=self.repetition_penalty,
            seed=self.seed, watermark=self.watermark))


class GenerateBody(BaseModel):
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
    finish_reason: str | None = None
    """On the last stream event and in the non-streamed body."""
    details: Details | None = None
    """Only when the request asked for `details`."""
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
        self._text_event = TextTemplate(lambda _, text: self._body(text, None))

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
            finish_reason=finish_reason(done),
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

    def _body(self, text: str, done: GenerateComplete | None) -> GenerateResponse:
        return GenerateResponse(
            id=self.response_id, model_name=self.model_name, model_version=self.model_version, text_output=text,
            finish_reason=None if done is None else finish_reason(done),
            details=self._details(done) if self.is_details else None, perf_stat=self._perf_stat(done),
        )

    def start(self) -> list[BaseModel]:
        return []

    def chunk(self, delta: Delta) -> GenerateResponse | str | None:
        """One stream event; None while tokens have no final text yet (they count in the next event)."""
        self._read(delta)
        if not delta.text and delta.finish_reason is None:
            return None
        if delta.finish_reason is None and not self.is_details and not self.is_perf_stat:
            return self._text_event.fill(0, delta.text)  # the common case, without a model per token
        return self._body(delta.text, delta.complete)

    def response(self, deltas: list[Delta]) -> GenerateResponse:
        for delta in deltas:
            self._read(delta)
        return self._body("".join(d.text for d in deltas), deltas[-1].complete)


def parse_body(raw: bytes) -> GenerateBody:
    """The validated body; any problem is a 400 whose `param` is the dotted path of the first bad field."""
    try:
        return GenerateBody.model_validate_json(raw)
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
    body_schema, response_schema = _json_schema(GenerateBody), _json_schema(GenerateResponse)
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


def finish_reason(done: GenerateComplete) -> str:
    return _FINISH.get(done.finish_reason, done.finish_reason.value)


def router_for(served_name: str) -> APIRouter:
    """The four /v2 generate routes; `served_name` only documents the `model` path parameter."""
    router = APIRouter()
    for suffix, stream in (("generate", False), ("generate_stream", True)):
        # The versioned path first: `{model:path}` would otherwise take "m/versions/1" as a model name.
        router.add_api_route(f"/v2/models/{{model:path}}/versions/{{version}}/{suffix}", _endpoint(stream),
                             methods=["POST"], name=f"v2_{suffix}_version",
                             openapi_extra=_openapi(served_name, stream, is_versioned=True))
        router.add_api_route(f"/v2/models/{{model:path}}/{suffix}", _endpoint(stream), methods=["POST"],
                             name=f"v2_{suffix}", openapi_extra=_openapi(served_name, stream, is_versioned=False))
    return router


def _endpoint(stream: bool):
    async def generate_route(request: Request, state: StateDep) -> Response:
        arrived_s = time.monotonic()
        model, version = request.path_params["model"], request.path_params.get("version")
        state.check_model(model)
        body = parse_body(await request.body())
        params = body.parameters
        prompt_ids = list(state.tokenizer(body.text_input).input_ids)
        if not prompt_ids:
            raise bad_request("text_input tokenizes to no tokens", "text_input")
        request_id = f"gen-{uuid.uuid4().hex}"
        (job,) = build_jobs(state, prompt_ids, [request_id], params.requested_max_tokens, DEFAULT_MAX_NEW_TOKENS,
                            lambda _: params.to_sampling(), API_NAMES, timeout_s=state.config.request_timeout_s or None)
        renderer = V2Renderer(body.id or request_id, state.served_name, version, arrived_s, params.details,
                              params.perf_stat)
        return await respond(state, request, job, renderer, stream, False)

    return generate_route
