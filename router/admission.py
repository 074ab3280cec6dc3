"""Admission: every generation request, whatever its API, checked by the contract's one validator.

In: a contract `GenerateRequest` an API edge built from its body (protocol.py for
/v1, v2.py for /v2, grpc_convert.py for the gRPC API), its max_tokens already the
output budget (prompts.output_budget), the model's `WorkerInfo`, and that API's
names for the contract's fields. Out: nothing, or an `APIError` 400 whose `param`
and message name the offending field as the client wrote it (`logprobs`,
`top_logprobs`, `max_completion_tokens`, `parameters.max_new_tokens`...). The
contract's validator runs first; then a budget the context cannot hold (prompt +
max_tokens over max_model_len) is a 400 `context_length_exceeded`.

The value ranges of contract fields are not the bodies' business: they live in
protos/segserve/v1/sampling.py alone (`validate`, called by `validate_request`),
which refuses non-finite numbers, values beyond float32 and out-of-range ints
before anything reaches the scheduler. The bodies check types, and the APIs'
own rules (n, stop strings, MindIE's seed > 0...). `bounds` documents the same
ranges in the OpenAPI document, generated from `sampling.RANGES`.
"""

from __future__ import annotations

from collections.abc import Mapping

from protos.segserve.v1.generate import GenerateRequest, validate_request
from protos.segserve.v1.info import WorkerInfo
from protos.segserve.v1.sampling import RANGES, InvalidParameter
from router.errors import APIError, bad_request


def check_request(request: GenerateRequest, info: WorkerInfo, api_names: Mapping[str, str]) -> None:
    """Raise a 400 naming the field (in the API's vocabulary) unless the contract admits `request` and the
    context holds its prompt and output budget."""
    try:
        validate_request(request, info)
    except InvalidParameter as exc:
        raise parameter_error(exc, api_names) from None
    num_prompt_tokens, max_tokens = len(request.prompt_token_ids), request.stopping.max_tokens
    room = info.max_model_len - num_prompt_tokens  # > 0: the contract refuses a prompt that fills the context
    if max_tokens > room:
        param = api_names.get("max_tokens", "max_tokens")
        raise bad_request(
            f"This model's maximum context length is {info.max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} tokens, so {param} can be at most {room} (got {max_tokens}).",
            param, "context_length_exceeded")


def parameter_error(exc: InvalidParameter, api_names: Mapping[str, str]) -> APIError:
    """The 400 for a contract refusal; a field the API has no name for keeps the contract's."""
    param = api_names.get(exc.field, exc.field)
    return bad_request(f"Invalid request: `{param}` {exc.message}", param)


def bounds(field: str, **changes: float | None) -> dict:
    """JSON Schema bounds of the contract field `field` (from sampling.RANGES), for pydantic's
    json_schema_extra. `changes` are the API's own mapping at the edge (OpenAI's temperature 0 is
    greedy: minimum=0, exclusiveMinimum=None); a None removes a keyword."""
    schema = {**RANGES[field].json_schema(), **changes}
    return {key: value for key, value in schema.items() if value is not None}
