"""Structured outputs at the router's edge: each body form reaches the scheduler as the contract's
`structured_output` (every choice, every prompt), and what cannot compile is a 400 naming the field.

Through real HTTP against the fake scheduler of test_server.py (which does not constrain its output: the
worker does); the compile check's time bound and cache are unit-tested on router.structured directly.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections import OrderedDict
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from protos.segserve.v1.sampling import MAX_STRUCTURED_SPEC_CHARS, StructuredKind, StructuredOutput
from router import structured
from router.errors import APIError
from tests.router.test_server import MODEL, router_url, scheduler, tokenizer  # noqa: F401

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city"]}
COMPACT_SCHEMA = json.dumps(SCHEMA, separators=(",", ":"))
LEGACY_TAG = {"structures": [{"begin": "<city>", "schema": SCHEMA, "end": "</city>"}], "triggers": ["<city>"]}
"""vLLM's older structural tag: free text until a trigger, then a structure whose content matches its schema."""
TAG = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<city>"], "tags": [
    {"type": "tag", "begin": "<city>", "end": "</city>", "content": {"type": "json_schema", "json_schema": SCHEMA}}]}}
"""The same in the grammar engine's form."""
COMPACT_TAG = json.dumps(TAG, separators=(",", ":"))
ROUTES = {"chat": ("/v1/chat/completions", {"messages": USER}), "completions": ("/v1/completions", {"prompt": "x"})}


class Answer(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]
    is_capital: bool


def _post(router_url: str, route: str, body: dict) -> httpx.Response:
    path, base = ROUTES[route]
    content = json.dumps({"model": MODEL, "max_tokens": 4, **base, **body})  # ASCII: "\ud800" stays an escape
    return httpx.post(f"{router_url}{path}", content=content.encode(), headers={"Content-Type": "application/json"},
                      timeout=30)


def _sent_structured_outputs(fake, num_before: int) -> list[StructuredOutput | None]:
    return [request.sampling.structured_output for request in fake.requests[num_before:]]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("body, expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutput(StructuredKind.JSON_OBJECT, "")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True,
                                                                 "description": "a city"}}},
     StructuredOutput(StructuredKind.JSON_SCHEMA, COMPACT_SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(StructuredKind.JSON_SCHEMA, COMPACT_SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}},
     StructuredOutput(StructuredKind.JSON_SCHEMA, COMPACT_SCHEMA)),
    ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]+"}}, StructuredOutput(StructuredKind.REGEX, r"[0-9]{3}-[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput(StructuredKind.CHOICE, '["yes","no"]')),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
     StructuredOutput(StructuredKind.GRAMMAR, 'root ::= "a" | "b"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput(StructuredKind.JSON_OBJECT, "")),
    ({"guided_json": SCHEMA}, StructuredOutput(StructuredKind.JSON_SCHEMA, COMPACT_SCHEMA)),
    ({"guided_regex": "a|b"}, StructuredOutput(StructuredKind.REGEX, "a|b")),
    ({"guided_choice": ["東京", "Paris"]}, StructuredOutput(StructuredKind.CHOICE, '["東京","Paris"]')),
    ({"guided_grammar": 'root ::= "x"+'}, StructuredOutput(StructuredKind.GRAMMAR, 'root ::= "x"+')),
    ({"response_format": {"type": "structural_tag", **LEGACY_TAG}}, StructuredOutput(StructuredKind.STRUCTURAL_TAG,
                                                                                    COMPACT_TAG)),
    ({"response_format": {"type": "structural_tag", "format": TAG["format"]}},
     StructuredOutput(StructuredKind.STRUCTURAL_TAG, COMPACT_TAG)),
    ({"structured_outputs": {"structural_tag": json.dumps(TAG)}},
     StructuredOutput(StructuredKind.STRUCTURAL_TAG, COMPACT_TAG)),
    ({"response_format": {"type": "text"}}, None),
    ({}, None),
])  # fmt: skip
def test_each_form_reaches_the_scheduler_as_the_contract(router_url, scheduler, route, body, expected):
    fake, _ = scheduler
    num_before = len(fake.requests)
    response = _post(router_url, route, body)
    assert response.status_code == 200, response.text
    assert _sent_structured_outputs(fake, num_before) == [expected]


def test_every_choice_of_every_prompt_carries_it(router_url, scheduler):
    fake, _ = scheduler
    num_before = len(fake.requests)
    body = {"prompt": ["one", "two", "three"], "n": 2, "response_format": {"type": "json_object"}}
    response = _post(router_url, "completions", body)
    assert response.status_code == 200, response.text
    assert _sent_structured_outputs(fake, num_before) == [StructuredOutput(StructuredKind.JSON_OBJECT)] * 6
    num_before = len(fake.requests)
    response = _post(router_url, "chat", {"n": 3, "structured_outputs": {"choice": ["a", "b"]}, "stream": True})
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n"), response.text
    assert _sent_structured_outputs(fake, num_before) == [StructuredOutput(StructuredKind.CHOICE, '["a","b"]')] * 3


def test_the_openai_clients_parse_sends_its_models_schema(router_url, scheduler):
    fake, _ = scheduler
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(pydantic.ValidationError):  # the fake scheduler's text is not JSON: the worker constrains it
        client.chat.completions.parse(model=MODEL, messages=USER, response_format=Answer, temperature=0)
    sent = fake.requests[-1].sampling.structured_output
    assert sent.kind is StructuredKind.JSON_SCHEMA
    schema = json.loads(sent.spec)
    assert schema["properties"]["city"]["enum"] == ["Paris", "Rome"]
    assert schema["required"] == ["city", "is_capital"] and schema["additionalProperties"] is False


def _nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def _enum(num_values: int) -> dict:
    return {"type": "string", "enum": [f"value-{number:06d}" for number in range(num_values)]}


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"regex": "(a+)+$"}},  # catastrophic for a backtracking matcher, not for a grammar
    {"structured_outputs": {"json": _nested_arrays(structured.MAX_SCHEMA_DEPTH - 1)}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": _enum(10_000)}}},
])  # fmt: skip
def test_hard_but_valid_specs_compile_within_the_bound(router_url, scheduler, body):
    fake, _ = scheduler
    num_before = len(fake.requests)
    response = _post(router_url, "chat", body)
    assert response.status_code == 200, response.text  # past COMPILE_TIMEOUT_S it would be a 400
    assert _sent_structured_outputs(fake, num_before)[0] is not None


def _json_schema(schema: object) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


@pytest.mark.parametrize("body, param, words", [
    (_json_schema([1, 2]), "response_format", "must be a JSON schema: an object (got list)"),
    (_json_schema("{}"), "response_format", "must be a JSON schema: an object (got str)"),
    (_json_schema({"type": "frob"}), "response_format", 'does not compile: Unsupported type "frob"'),
    (_json_schema({"$ref": "#/$defs/missing"}), "response_format", "does not compile"),
    (_json_schema({"$ref": "#"}), "response_format", "does not compile: Circular $ref chain with no schema content"),
    (_json_schema({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}),
     "response_format", "cannot be enforced exactly: `uniqueItems` at /properties/tags"),
    ({"structured_outputs": {"json": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}},
     "structured_outputs", "cannot be enforced exactly: `oneOf` at / (its branches are not provably disjoint"),
    (_json_schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
     "response_format", "Circular $ref chain"),
    ({"structured_outputs": {"grammar": 'root ::= root'}}, "structured_outputs", "matches no output at all"),
    (_json_schema(_enum(30_000)), "response_format", f"longer than {MAX_STRUCTURED_SPEC_CHARS} characters"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs `json_schema`"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "'xml' is not supported"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "needs `format`, or non-empty"),
    ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<f>", "end": "</f>"}],
                          "triggers": ["<f"]}}, "response_format", "structures[0] needs"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "bogus"}}}, "response_format",
     "does not compile: Invalid structural tag error: Format type not recognized: bogus"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "is not valid JSON"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs", "an object (got list)"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "does not compile: Regex parsing error"),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs", "does not compile"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs", 'Rule "missing" is not defined'),
    ({"structured_outputs": {"grammar": 'start ::= "a"'}}, "structured_outputs", "root"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"structural_tag": {"format": {}}}}, "structured_outputs", "does not compile"),
    ({"structured_outputs": {"structural_tag": "{oops"}}, "structured_outputs", "is not valid JSON"),
    ({"structured_outputs": {"structural_tag": {"format": 3}}}, "structured_outputs", "`format` must be an object"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "not both `response_format` and `structured_outputs`"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice", "not both"),
    ({"guided_regex": "(", "guided_grammar": 'root ::= "a"'}, "guided_grammar", "not both"),
    ({"guided_json": "[1]"}, "guided_json", "an object (got list)"),
    ({"guided_regex": "(a"}, "guided_regex", "does not compile"),
    ({"guided_choice": ["ok", "\ud800"]}, "guided_choice", "not valid Unicode"),
    (_json_schema({"enum": ["\udfff"]}), "response_format", "not valid Unicode"),
])  # fmt: skip
@pytest.mark.parametrize("route", ROUTES)
def test_what_cannot_be_enforced_is_a_400_naming_the_field(router_url, scheduler, route, body, param, words):
    fake, _ = scheduler
    num_before = len(fake.requests)
    response = _post(router_url, route, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert words in error["message"], error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert len(fake.requests) == num_before


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^a+$", "maxLength": 3}}},
    {"type": "array", "items": {"pattern": "x", "minLength": 1}},
    {"allOf": [{"type": "integer", "minimum": 5}, {"maximum": 7}]},
])  # fmt: skip
def test_a_schema_xgrammar_would_approximate_is_accepted_when_llguidance_enforces_it(router_url, scheduler, schema):
    fake, _ = scheduler
    num_before = len(fake.requests)
    response = _post(router_url, "chat", _json_schema(schema))
    assert response.status_code == 200, response.text
    assert _sent_structured_outputs(fake, num_before) == [
        StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))]


@pytest.mark.parametrize("depth", [structured.MAX_SCHEMA_DEPTH, 900, 5000])
@pytest.mark.parametrize("field", ["response_format", "structured_outputs"])
def test_a_deeply_nested_schema_is_a_400_not_a_crash(router_url, scheduler, field, depth):
    fake, _ = scheduler
    num_before = len(fake.requests)
    schema = '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth  # too deep for json.dumps
    wrapped = {"response_format": '{"type":"json_schema","json_schema":{"name":"deep","schema":%s}}',
               "structured_outputs": '{"json":%s}'}[field] % schema
    body = '{"model":"%s","messages":[{"role":"user","content":"hi"}],"%s":%s}' % (MODEL, field, wrapped)
    response = httpx.post(f"{router_url}/v1/chat/completions", content=body.encode(),
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text
    if depth < 1000:  # deeper, Python's JSON parser gives up on the body first (also a 400)
        assert "deeper than 128 levels" in response.json()["error"]["message"]
    assert len(fake.requests) == num_before


@pytest.fixture
def fresh_verdicts(monkeypatch):
    """An empty verdict cache, and a count of the compiles each spec got."""
    monkeypatch.setattr(structured, "_verdicts", OrderedDict())
    compiled: list[str] = []
    real = structured._compile_error

    def counting(kind, spec):
        compiled.append(spec)
        return real(kind, spec)

    monkeypatch.setattr(structured, "_compile_error", counting)
    return compiled


async def test_a_repeated_spec_compiles_once(fresh_verdicts):
    schema = StructuredOutput(StructuredKind.JSON_SCHEMA, COMPACT_SCHEMA)
    bad = StructuredOutput(StructuredKind.REGEX, "(unclosed")
    for _ in range(3):
        await structured.check_compiles(schema, "response_format")
        with pytest.raises(APIError) as refused:
            await structured.check_compiles(bad, "structured_outputs")
        assert refused.value.status == 400 and refused.value.param == "structured_outputs"
    assert fresh_verdicts == [COMPACT_SCHEMA, "(unclosed"]


async def test_the_cache_keeps_the_latest_verdicts(fresh_verdicts, monkeypatch):
    monkeypatch.setattr(structured, "MAX_CACHED_VERDICTS", 2)
    specs = [StructuredOutput(StructuredKind.REGEX, regex) for regex in ("a", "b", "c", "a")]
    for spec in specs:
        await structured.check_compiles(spec, "structured_outputs")
    assert fresh_verdicts == ["a", "b", "c", "a"]  # "a" was evicted by "c"
    assert len(structured._verdicts) == 2


async def test_a_compile_past_the_bound_is_refused_and_not_retried(monkeypatch):
    monkeypatch.setattr(structured, "_verdicts", OrderedDict())
    release = threading.Event()
    calls = []

    def stuck(kind, spec):  # a conversion that does not return in time (it cannot be interrupted)
        calls.append(spec)
        release.wait(10)
        return None

    monkeypatch.setattr(structured, "_compile_error", stuck)
    hostile = StructuredOutput(StructuredKind.GRAMMAR, 'root ::= "slow"')
    try:
        for _ in range(2):
            start_s = time.monotonic()
            with pytest.raises(APIError) as refused:
                await structured.check_compiles(hostile, "guided_grammar", timeout_s=0.3)
            assert refused.value.status == 400 and refused.value.param == "guided_grammar"
            assert "took longer than 0.3 s to compile" in refused.value.message
            assert time.monotonic() - start_s < 2
        assert calls == ['root ::= "slow"']  # the second request waits for the same compile, it starts none
    finally:
        release.set()


async def test_a_spec_that_could_not_start_is_a_503_to_retry(monkeypatch):
    monkeypatch.setattr(structured, "_verdicts", OrderedDict())
    monkeypatch.setattr(structured, "_executor", concurrent.futures.ThreadPoolExecutor(max_workers=1))
    release = threading.Event()
    real = structured._compile_error

    def slow_then_real(kind, spec):
        if spec == "slow":
            release.wait(10)
        return real(kind, spec)

    monkeypatch.setattr(structured, "_compile_error", slow_then_real)
    blocker, queued = (StructuredOutput(StructuredKind.REGEX, regex) for regex in ("slow", "queued"))
    try:
        with pytest.raises(APIError) as refused:
            await structured.check_compiles(blocker, "structured_outputs", timeout_s=0.2)
        assert refused.value.status == 400
        with pytest.raises(APIError) as busy:  # the only thread is still on the first spec
            await structured.check_compiles(queued, "structured_outputs", timeout_s=0.2)
        assert busy.value.status == 503 and busy.value.headers == {"Retry-After": "1"}
    finally:
        release.set()
    await structured.check_compiles(queued, "structured_outputs", timeout_s=5)  # a retry compiles it
