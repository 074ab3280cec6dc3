"""The last line of structured outputs: every finished JSON output checked against what it was asked to match.

In: one choice's events (generate_deltas', after stop strings) and its job, whose request carries the structured
output. Out: the same events, except that a choice that finished (finish_reason "stop") with text that does not
parse as strict JSON matching its schema (a JSON object, for json_object) ends failed instead: its last Delta
carries FinishReason.ERROR and the reason, which the renderers show as finish_reason "error", followed in a
stream by an error event (serving.py), as for a request that failed in the worker. Its text was sent already.
Each failure is logged with the schema's sha256 digest.

The edge accepts only schemas an engine enforces exactly (structured.py, schema_engines.py), so a failure here is
an engine's bug caught before a client takes the output for valid. Validators (jsonschema's, for the draft the
schema's `$schema` names, else 2020-12; `format` an annotation, as JSON Schema defines it) are cached by digest;
each check runs off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
from collections.abc import AsyncIterator

import jsonschema

from protos.segserve.v1.generate import FinishReason, GenerateComplete
from protos.segserve.v1.sampling import StructuredKind, StructuredOutput
from router.generation import Delta, GenerationJob

logger = logging.getLogger(__name__)

MAX_REASON_CHARS = 300
_VALIDATED_KINDS = (StructuredKind.JSON_SCHEMA, StructuredKind.JSON_OBJECT)


def validated_outputs(events: AsyncIterator, job: GenerationJob) -> AsyncIterator:
    """`events`, the finished output of a JSON structured output checked (events as they are otherwise)."""
    structured = job.request.sampling.structured_output
    if structured is None or structured.kind not in _VALIDATED_KINDS:
        return events
    return _checked(events, structured, job.request_id)


async def _checked(events: AsyncIterator, structured: StructuredOutput, request_id: str) -> AsyncIterator:
    texts: list[str] = []
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Delta):
                texts.append(event.text)
                if event.finish_reason == "stop":
                    problem = await asyncio.to_thread(output_problem, structured, "".join(texts))
                    if problem is not None:
                        logger.warning("request %s finished an output that breaks its structured output (%s, "
                                       "sha256 %s): %s", request_id, structured.kind.name.lower(),
                                       spec_digest(structured), problem)
                        event = _failed(event, f"the output does not match its {_what(structured)} "
                                               f"(sha256 {spec_digest(structured)[:16]}): {problem}")
            yield event


def output_problem(structured: StructuredOutput, text: str) -> str | None:
    """Why `text` is not an output of `structured` (a JSON_SCHEMA or JSON_OBJECT one); None when it is."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:  # (JSONDecodeError is one)
        return f"it is not JSON: {str(exc)[:MAX_REASON_CHARS]}"
    if structured.kind is StructuredKind.JSON_OBJECT:
        return None if isinstance(value, dict) else f"it is a JSON {type(value).__name__}, not an object"
    try:
        error = jsonschema.exceptions.best_match(_validator(structured.spec).iter_errors(value))
    except Exception as exc:  # noqa: BLE001 (the validator cannot follow the schema: a $ref it cannot resolve)
        return f"it could not be validated: {type(exc).__name__}: {str(exc)[:MAX_REASON_CHARS]}"
    if error is None:
        return None
    return f"{error.message[:MAX_REASON_CHARS]} (at {error.json_path})"


def spec_digest(structured: StructuredOutput) -> str:
    """The structured output's sha256, as the edge's compile check keys it."""
    return hashlib.sha256(f"{structured.kind.name}\0{structured.spec}".encode()).hexdigest()


@functools.lru_cache(maxsize=256)
def _validator(spec: str) -> jsonschema.protocols.Validator:
    schema = json.loads(spec)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def _failed(delta: Delta, reason: str) -> Delta:
    """`delta`, a choice's last, ending it failed with `reason`."""
    done = delta.complete
    if done is None:  # a stop string ended it at the router
        usage = delta.usage
        done = GenerateComplete(FinishReason.ERROR, usage.prompt_tokens if usage else 0,
                                usage.completion_tokens if usage else 0, error_message=reason)
    else:
        done = dataclasses.replace(done, finish_reason=FinishReason.ERROR, error_message=reason)
    return dataclasses.replace(delta, finish_reason="error", complete=done)


def _what(structured: StructuredOutput) -> str:
    return "JSON schema" if structured.kind is StructuredKind.JSON_SCHEMA else "json_object format"


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")
