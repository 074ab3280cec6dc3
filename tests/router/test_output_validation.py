"""The last line of structured outputs (router/output_validation.py): a finished JSON output that breaks its schema
ends its choice with finish_reason "error" (an error event in a stream), logged with the schema's digest.

Pure: output_problem and the event adapter over synthetic Deltas. Through real HTTP: the fake scheduler of
test_server.py, which does not constrain its output (its text is not JSON), stands for an engine that let a
broken output through.
"""

from __future__ import annotations

import hashlib
import json
import logging

import httpx
import pytest

from protos.segserve.v1.generate import FinishReason, GenerateComplete, GenerateError, GenerateRequest
from protos.segserve.v1.sampling import SamplingParams, StructuredKind, StructuredOutput
from protos.segserve.v1.usage import Usage
from router.generation import Delta, GenerationJob
from router.output_validation import output_problem, validated_outputs
from tests.router.test_server import MODEL, router_url, scheduler, tokenizer  # noqa: F401

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer", "maximum": 9}},
          "required": ["city"], "additionalProperties": False}
SPEC = json.dumps(SCHEMA, separators=(",", ":"))
STRUCTURED = StructuredOutput(StructuredKind.JSON_SCHEMA, SPEC)
DIGEST = hashlib.sha256(f"JSON_SCHEMA\0{SPEC}".encode()).hexdigest()


@pytest.mark.parametrize("text, words", [
    ('{"city": "Paris", "n": 3}', None),
    ('{"city": "Paris", "n": 30}', "30 is greater than the maximum of 9 (at $.n)"),
    ('{"n": 3}', "'city' is a required property (at $)"),
    ('{"city": "Paris", "x": 1}', "Additional properties are not allowed"),
    ('{"city": "Paris"', "it is not JSON"),
    ('{"city": NaN}', "NaN is not JSON"),
    ('{"city": "a\tb"}', "it is not JSON: Invalid control character"),  # RFC 8259: no raw control characters
])  # fmt: skip
def test_output_problem_of_a_json_schema(text, words):
    problem = output_problem(STRUCTURED, text)
    assert (problem is None) if words is None else (words in problem), problem


def test_output_problem_follows_the_schemas_draft():
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"a": {"type": "integer"}},
              "$ref": "#/definitions/a", "minimum": 5}  # draft 7: the $ref's sibling is ignored
    assert output_problem(StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(draft7)), "1") is None
    assert output_problem(StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps({**draft7, "$schema": (
        "https://json-schema.org/draft/2020-12/schema")})), "1") == "1 is less than the minimum of 5 (at $)"


def test_output_problem_of_a_json_object():
    json_object = StructuredOutput(StructuredKind.JSON_OBJECT)
    assert output_problem(json_object, '{"a": [1]}') is None
    assert output_problem(json_object, "[1]") == "it is a JSON list, not an object"


def _job(structured: StructuredOutput | None) -> GenerationJob:
    return GenerationJob(GenerateRequest("req-1", (1, 2), SamplingParams(structured_output=structured)),
                         eos_token_ids=frozenset({1}))


async def _events(*events):
    for event in events:
        yield event


def _finished(text: str, reason: FinishReason = FinishReason.EOS_TOKEN, finish_reason: str = "stop") -> Delta:
    return Delta(text=text, finish_reason=finish_reason, usage=Usage(2, 5),
                 complete=GenerateComplete(reason, num_prompt_tokens=2, num_generated_tokens=5))


async def _collect(events) -> list:
    return [event async for event in events]


async def test_a_finished_output_that_breaks_its_schema_ends_failed_and_is_logged(caplog):
    caplog.set_level(logging.WARNING, logger="router.output_validation")
    events = await _collect(validated_outputs(_events(Delta('{"n": '), _finished("3}")), _job(STRUCTURED)))
    assert [event.text for event in events] == ['{"n": ', "3}"]
    last = events[-1]
    assert last.finish_reason == "error" and last.complete.finish_reason is FinishReason.ERROR
    assert last.complete.num_generated_tokens == 5 and last.usage == Usage(2, 5)
    assert last.complete.error_message == (f"the output does not match its JSON schema (sha256 {DIGEST[:16]}): "
                                           "'city' is a required property (at $)")
    assert DIGEST in caplog.text and "req-1" in caplog.text


async def test_a_valid_or_unfinished_output_passes_unchanged():
    valid = [Delta('{"city": '), _finished('"Rome"}')]
    assert await _collect(validated_outputs(_events(*valid), _job(STRUCTURED))) == valid
    cut = [Delta('{"ci'), _finished("ty", FinishReason.LENGTH, "length")]  # ran out of tokens: not finished
    assert await _collect(validated_outputs(_events(*cut), _job(STRUCTURED))) == cut
    failed = [Delta('{"ci'), GenerateError("internal", "worker crashed")]
    assert await _collect(validated_outputs(_events(*failed), _job(STRUCTURED))) == failed


async def test_an_output_cut_by_a_stop_string_is_checked_too():
    cut = Delta('{"city": "Ro', finish_reason="stop", usage=Usage(2, 4))  # stop_at_strings' end: no complete
    last = (await _collect(validated_outputs(_events(cut), _job(STRUCTURED))))[-1]
    assert last.finish_reason == "error" and last.complete == GenerateComplete(
        FinishReason.ERROR, 2, 4, error_message=last.complete.error_message)
    assert "it is not JSON" in last.complete.error_message


def test_other_outputs_are_not_wrapped():
    events = _events(_finished("anything"))
    assert validated_outputs(events, _job(None)) is events
    assert validated_outputs(events, _job(StructuredOutput(StructuredKind.REGEX, "a+"))) is events


def _chat(router_url: str, **body) -> httpx.Response:
    return httpx.post(f"{router_url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64,
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}, **body})


def test_through_http_a_broken_finished_output_is_an_error_the_client_sees(router_url, scheduler):
    whole = _chat(router_url)
    assert whole.status_code == 200
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "error" and choice["message"]["content"]  # the text it wrote, as it was
    events = _chat(router_url, stream=True).text.split("\n\n")
    assert events[-2] == "data: [DONE]"
    error = json.loads(events[-3].removeprefix("data: "))["error"]
    assert error["code"] == "generation_error"
    assert error["message"].startswith("the output does not match its JSON schema (sha256 ")
    assert json.loads(events[-4].removeprefix("data: "))["choices"][0]["finish_reason"] == "error"
    unfinished = _chat(router_url, max_tokens=3).json()["choices"][0]
    assert unfinished["finish_reason"] == "length"
