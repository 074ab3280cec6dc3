"""Structured outputs end to end: the official openai client against a real tiny stack (router, scheduler,
speculative worker and drafter), the worker constraining the tiny random model's output.

The schemas leave the model few choices (enums, booleans), so even a random model finishes them well within
max_tokens; whatever it picks must parse and match the schema.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import pydantic
import pytest
from openai import BadRequestError, OpenAI

from tests.support.e2e_helpers import start_stack
from tests.support.tool_streams import streamed_tool_calls

pytestmark = pytest.mark.e2e

MAX_TOKENS = 96
USER = [{"role": "user", "content": "Name a capital city and say whether it is one."}]
CITY_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "is_capital"],
               "properties": {"city": {"enum": ["Paris", "Rome", "Tokyo"]}, "is_capital": {"type": "boolean"}}}


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    city: Literal["Paris", "Rome", "Tokyo"]
    is_capital: bool


@pytest.fixture(scope="module")
def stack(tiny_gemma3_dir, tmp_path_factory):
    stack = start_stack(tiny_gemma3_dir, tmp_path_factory.mktemp("logs"), num_kv_blocks=128, block_size=16)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def client(stack) -> OpenAI:
    return OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize("temperature", [0, 1])
def test_parse_returns_an_object_of_the_model(client, model, temperature):
    completion = client.chat.completions.parse(model=model, messages=USER, response_format=City,
                                               max_tokens=MAX_TOKENS, temperature=temperature, seed=7)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, City)
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_a_streamed_json_schema_answer_parses_and_matches(client, model):
    stream = client.chat.completions.create(
        model=model, messages=USER, max_tokens=MAX_TOKENS, stream=True, n=2, temperature=1, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}})
    texts, finish_reasons = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish_reasons[choice.index] = choice.finish_reason or finish_reasons[choice.index]
    assert finish_reasons == ["stop", "stop"], texts
    for text in texts:
        City.model_validate_json(text, strict=True)  # CITY_SCHEMA's shape; additional properties are refused


@pytest.mark.parametrize("extra_body, check", [
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, re.compile("[0-9]{3}-[a-z]{2}").fullmatch),
    ({"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}}, {"alpha", "beta", "gamma"}.__contains__),
    ({"guided_grammar": 'root ::= ("yes" | "no") "!"'}, {"yes!", "no!"}.__contains__),
])  # fmt: skip
def test_vllm_forms_constrain_completions(client, model, extra_body, check):
    completion = client.completions.create(model=model, prompt="Answer:", max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body=extra_body)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and check(choice.text), choice


def test_json_object_is_an_object(client, model):
    completion = client.chat.completions.create(model=model, messages=USER, max_tokens=MAX_TOKENS, temperature=0,
                                                response_format={"type": "json_object"})
    choice = completion.choices[0]
    if choice.finish_reason == "stop":  # a free-form object may run past max_tokens; a finished one must parse
        assert isinstance(json.loads(choice.message.content), dict), choice
    else:
        assert choice.message.content.lstrip().startswith("{"), choice


def test_an_uncompilable_schema_is_a_400_naming_the_field(client, model):
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=USER, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}})
    assert refused.value.body["param"] == "response_format"
    assert "does not compile" in refused.value.body["message"]


# Tool calls: forced by tool_choice, so the random model's calls always parse and match the tool's schema.

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": CITY_SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
SCHEMAS = {"get_weather": CITY_SCHEMA, "get_time": TIME["function"]["parameters"]}
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_time"}}}


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_parse_and_match_their_tools_schema(client, model, choice, stream):
    params = dict(model=model, messages=USER, max_tokens=MAX_TOKENS, temperature=1, seed=11, tools=[WEATHER, TIME],
                  tool_choice=CHOICES[choice], parallel_tool_calls=False)
    if stream:
        content, calls, finish_reason = streamed_tool_calls(client.chat.completions.create(stream=True, **params))
    else:
        completion = client.chat.completions.create(**params)
        message, finish_reason, content = completion.choices[0].message, completion.choices[0].finish_reason, ""
        assert message.content is None
        calls = [{"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
                 for call in message.tool_calls]
    assert finish_reason == "tool_calls" and content == "", (calls, content)
    assert len(calls) == 1 and calls[0]["id"].startswith("call_")
    if choice == "named":
        assert calls[0]["name"] == "get_time"
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[calls[0]["name"]])


def test_a_second_turn_takes_the_tools_answer(client, model):
    first = client.chat.completions.create(model=model, messages=USER, max_tokens=MAX_TOKENS, temperature=0,
                                           tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = [*USER, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})}]
    second = client.chat.completions.create(
        model=model, messages=history, max_tokens=MAX_TOKENS, temperature=0, tools=[WEATHER], tool_choice="none",
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}})
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.tool_calls is None
    City.model_validate_json(second.choices[0].message.content, strict=True)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its answer are in the prompt


def test_auto_without_a_parser_is_a_400_naming_tool_choice(client, model):
    with pytest.raises(BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=USER, max_tokens=8, tools=[WEATHER])
    assert refused.value.body["param"] == "tool_choice" and "--tool-call-parser" in refused.value.body["message"]


def test_a_structural_tag_constrains_its_part(client, model):
    # a regex part: a JSON schema's part would allow free whitespace, which a random model can spin in
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<city>", "end": "</city>", "content": {
        "type": "regex", "pattern": "(Paris|Rome|Tokyo), (yes|no)"}}}
    completion = client.chat.completions.create(model=model, messages=USER, max_tokens=MAX_TOKENS, temperature=1,
                                                seed=5, response_format=tag, n=2)
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice
        assert re.fullmatch("<city>(Paris|Rome|Tokyo), (yes|no)</city>", choice.message.content), choice
