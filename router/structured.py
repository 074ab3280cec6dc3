"""Structured outputs at the API edge: the body fields that ask for them, mapped onto the contract, and the
check that their grammar compiles before anything reaches the scheduler.

In: OpenAI's `response_format` (`json_object`, `json_schema`, and vLLM's `structural_tag`), vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`, `structural_tag`) and vLLM's older
top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. A structural tag is free text with
constrained parts (a trigger such as `<function=` starts a tag whose content follows a schema), in xgrammar's
form or the older `structures` + `triggers` one (common/grammar.py maps it). Out: one contract `StructuredOutput` (protos/segserve/v1/sampling.py),
which every choice of the request carries, or a 400 naming the body field.

Three checks, cheapest first: the body models refuse wrong types, a schema that is not a JSON object and a
schema nested deeper than MAX_SCHEMA_DEPTH (xgrammar's conversion slows steeply with depth: ~1000 levels
take minutes); the contract's validate() checks the spec's shape and size (admission.check_request); and
`check_compiles` has the grammar built without a tokenizer, in a small thread pool, bounded by
COMPILE_TIMEOUT_S (a conversion cannot be stopped, so one past the bound is refused and left to finish in
its thread; one that could not even start, the threads being busy, is a 503 to retry). A JSON schema is
enforced exactly or refused: xgrammar builds it where it has nothing xgrammar would approximate, llguidance
where it does (schema_engines.py; a refusal names each construct and its JSON pointer). Each verdict is
cached by the spec's digest: a repeated schema costs one dictionary lookup.
The worker compiles the same spec against its tokenizer, with the same engine, and enforces it; what it
finishes is validated against its schema once more (output_validation.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import json
import time
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from common.grammar import JSON_SCHEMA_OPTIONS, ROOT_RULE, engine_message, structural_tag
from protos.segserve.v1.sampling import StructuredKind, StructuredOutput
from router.errors import RETRY_AFTER_S, SERVER_ERROR, APIError, bad_request
from router.schema_engines import json_schema_problem, structural_tag_problem

MAX_SCHEMA_DEPTH = 128
"""Deepest nesting of objects and arrays a JSON schema may have (a schema level is one or two of them)."""
COMPILE_TIMEOUT_S = 5.0
"""Longest a schema, regex or grammar may take to compile at the edge before it is refused."""
MAX_CACHED_VERDICTS = 256
MAX_ENGINE_MESSAGE_CHARS = 300
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""vLLM's older top-level names, each one kind of structured output."""
STRUCTURED_FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS)
"""The body fields that ask for a structured output; a request may use one."""
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


def json_object(value: object, what: str = "an object") -> dict:
    """An object given as itself or as its JSON text; ValueError says why not."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be {what} (got {type(value).__name__})")
    return value


def schema_object(value: object) -> dict:
    """A JSON schema given as an object or as its JSON text, as an object; ValueError says why not."""
    value = json_object(value, "a JSON schema: an object")
    if _depth(value) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels")
    return value


def _depth(value: object) -> int:
    """How deeply objects and arrays nest in `value` (iterative: the input may be hostile)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_SCHEMA_DEPTH:
                pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def tag_object(value: object) -> dict:
    """A structural tag given as an object or as its JSON text, in the engine's form (common.grammar's
    structural_tag); ValueError says why not."""
    tag = structural_tag(json_object(value, "a structural tag: an object"))
    if _depth(tag) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"nests objects and arrays deeper than {MAX_SCHEMA_DEPTH} levels")
    return tag


def compact_json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema` (what `client.chat.completions.parse` sends)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    """The JSON schema the output must match."""
    strict: bool | None = None
    """Accepted; the output always follows the schema."""

    @field_validator("schema_", mode="before")
    @classmethod
    def _schema(cls, schema: object) -> dict:
        if isinstance(schema, str):
            raise ValueError("must be a JSON schema: an object (got str)")
        return schema_object(schema)


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: `text` (the default), `json_object` or `json_schema`."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model_config = ConfigDict(extra="allow", strict=True)  # a structural tag's fields sit beside `type`

    type: str
    json_schema: JsonSchemaFormat | None = None

    @field_validator("type")
    @classmethod
    def _known_type(cls, type: str) -> str:
        if type not in RESPONSE_FORMAT_TYPES:
            raise ValueError(f"type {type!r} is not supported (accepted: {', '.join(RESPONSE_FORMAT_TYPES)})")
        return type

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type \'json_schema\' needs `json_schema`: {"name": ..., "schema": {...}}')
        if self.type == "structural_tag":
            tag_object(self.model_extra)  # ValueError says what it lacks
        return self

    def to_structured(self) -> StructuredOutput | None:
        """The contract's structured output; None for free text."""
        if self.type == "json_object":
            return StructuredOutput(StructuredKind.JSON_OBJECT)
        if self.type == "json_schema":
            return StructuredOutput(StructuredKind.JSON_SCHEMA, compact_json(self.json_schema.schema_))
        if self.type == "structural_tag":
            return StructuredOutput(StructuredKind.STRUCTURAL_TAG, compact_json(tag_object(self.model_extra)))
        return None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs`: exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`."""

    model_config = ConfigDict(extra="ignore", strict=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    """A JSON schema, as an object or as JSON text."""
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    """EBNF (GBNF) whose root rule is `root`."""
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    """A structural tag, as an object or as JSON text: {"type": "structural_tag", "format": {...}}, or
    {"structures": [{"begin", "schema", "end"}], "triggers": [...]}."""

    @field_validator("json_", mode="before")
    @classmethod
    def _schema(cls, schema: object) -> dict | None:
        return None if schema is None else schema_object(schema)

    @field_validator("structural_tag", mode="before")
    @classmethod
    def _tag(cls, tag: object) -> dict | None:
        return None if tag is None else tag_object(tag)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        given = [name for name, value in self._specs().items() if value is not None and value is not False]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object, structural_tag (got "
                             f"{', '.join(given) or 'none'})")
        return self

    def _specs(self) -> dict[str, object]:
        return {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                "json_object": self.json_object, "structural_tag": self.structural_tag}

    def to_structured(self) -> StructuredOutput:
        if self.json_ is not None:
            return StructuredOutput(StructuredKind.JSON_SCHEMA, compact_json(self.json_))
        if self.regex is not None:
            return StructuredOutput(StructuredKind.REGEX, self.regex)
        if self.choice is not None:
            return StructuredOutput(StructuredKind.CHOICE, compact_json(self.choice))
        if self.grammar is not None:
            return StructuredOutput(StructuredKind.GRAMMAR, self.grammar)
        if self.structural_tag is not None:
            return StructuredOutput(StructuredKind.STRUCTURAL_TAG, compact_json(self.structural_tag))
        return StructuredOutput(StructuredKind.JSON_OBJECT)


def guided_structure(field: str, value: object) -> StructuredOutput:
    """The structured output of one of vLLM's `guided_*` fields (already type-checked by the body)."""
    if field == "guided_json":
        return StructuredOutput(StructuredKind.JSON_SCHEMA, compact_json(value))
    if field == "guided_choice":
        return StructuredOutput(StructuredKind.CHOICE, compact_json(value))
    return StructuredOutput(StructuredKind.REGEX if field == "guided_regex" else StructuredKind.GRAMMAR, value)


def is_requested(value: object) -> bool:
    """Whether the value of one of STRUCTURED_FIELDS asks for a structured output."""
    if isinstance(value, ResponseFormat):
        return value.type != "text"
    return value is not None


# The edge's compile check. Verdicts: None (compiles) or the engine's reason.
_COMPILED_KINDS = (StructuredKind.JSON_SCHEMA, StructuredKind.REGEX, StructuredKind.GRAMMAR,
                   StructuredKind.STRUCTURAL_TAG)
_executor = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-check")
_verdicts: OrderedDict[str, tuple[concurrent.futures.Future, float]] = OrderedDict()
"""Spec digest -> (the compile's future, when it was submitted); touched by the event loop only."""


@functools.cache
def _xgrammar():
    import xgrammar  # imports torch: loaded on the first structured request, not at startup

    return xgrammar


@functools.cache
def _byte_compiler():
    """A compiler over a vocabulary of the 256 bytes and an end token: what any text of a grammar can start with."""
    xgrammar = _xgrammar()
    info = xgrammar.TokenizerInfo([bytes([byte]) for byte in range(256)] + [b"</s>"],
                                  vocab_type=xgrammar.VocabType.RAW, stop_token_ids=[256])
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def _compile_error(kind: StructuredKind, spec: str) -> str | None:
    """Why no engine enforces `spec` exactly: "does not compile: ..." (the engine's reason; also when the grammar
    matches no text at all, its rules never reaching an end, which no model could ever finish) or, for a JSON
    schema, "cannot be enforced exactly: ..."; None when one does (runs in a thread)."""
    if kind is StructuredKind.JSON_SCHEMA:
        return json_schema_problem(spec, functools.partial(_xgrammar_error, kind))
    if kind is StructuredKind.STRUCTURAL_TAG and (problem := structural_tag_problem(spec)) is not None:
        return problem
    reason = _xgrammar_error(kind, spec)
    return None if reason is None else f"does not compile: {reason}"


def _xgrammar_error(kind: StructuredKind, spec: str) -> str | None:
    """Build xgrammar's grammar without the model's tokenizer; the engine's reason when it cannot, or when the
    grammar matches no text at all."""
    xgrammar = _xgrammar()
    grammar = xgrammar.Grammar
    try:
        if kind is StructuredKind.JSON_SCHEMA:
            built = grammar.from_json_schema(spec, **JSON_SCHEMA_OPTIONS)  # as the worker compiles it
        elif kind is StructuredKind.REGEX:
            built = grammar.from_regex(spec)
        elif kind is StructuredKind.STRUCTURAL_TAG:
            built = grammar.from_structural_tag(spec)
        else:
            built = grammar.from_ebnf(spec, root_rule_name=ROOT_RULE)
        matcher = xgrammar.GrammarMatcher(_byte_compiler().compile_grammar(built))
        bitmask = xgrammar.allocate_token_bitmask(1, 257)
        matcher.fill_next_token_bitmask(bitmask)
    except Exception as exc:  # xgrammar raises RuntimeError (C++) and others; every one is the input's fault
        return engine_message(exc)[:MAX_ENGINE_MESSAGE_CHARS]
    if not bitmask.any():  # not even the end token: no text matches
        return "it matches no output at all (its rules never reach an end)"
    return None


def _submit(structured: StructuredOutput) -> tuple[str, concurrent.futures.Future, float]:
    """(the spec's digest, its compile's future, when that was submitted): a cached one, or a new one."""
    key = hashlib.sha256(f"{structured.kind.name}\0{structured.spec}".encode()).hexdigest()
    if key in _verdicts:
        _verdicts.move_to_end(key)
        return key, *_verdicts[key]
    entry = _verdicts[key] = _executor.submit(_compile_error, structured.kind, structured.spec), time.monotonic()
    if len(_verdicts) > MAX_CACHED_VERDICTS:
        _verdicts.popitem(last=False)
    return key, *entry


async def check_compiles(structured: StructuredOutput, param: str, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
    """Raise a 400 naming `param` unless `structured`'s schema, regex or grammar compiles within `timeout_s`
    of the first time it was asked for."""
    try:
        structured.spec.encode()
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" in the body's JSON) cannot go on the wire
        raise bad_request(f"Invalid request: `{param}` is not valid Unicode: {exc.reason} at {exc.start}",
                          param) from None
    if structured.kind not in _COMPILED_KINDS:
        return
    try:
        if not _xgrammar.cache_info().currsize:  # the first import takes seconds: not the request's compile time
            await asyncio.to_thread(_xgrammar)
    except ImportError:
        raise APIError(500, "structured outputs need the xgrammar package, which this router lacks",
                       type=SERVER_ERROR, param=param) from None
    key, future, submitted_s = _submit(structured)
    if not future.done():
        left_s = submitted_s + timeout_s - time.monotonic()
        await asyncio.wait([asyncio.wrap_future(future)], timeout=max(left_s, 0.0))
    if future.cancel():  # it never started: the threads are busy with slow compiles, not this spec's fault
        _verdicts.pop(key, None)
        raise APIError(503, "the structured output's compile check is busy; retry", type=SERVER_ERROR,
                       param=param, headers={"Retry-After": str(RETRY_AFTER_S)})
    if not future.done():
        raise bad_request(f"Invalid request: `{param}` took longer than {timeout_s:g} s to compile; "
                          "simplify it", param)
    reason = future.result()
    if reason is not None:
        raise bad_request(f"Invalid request: `{param}` {reason}", param)
