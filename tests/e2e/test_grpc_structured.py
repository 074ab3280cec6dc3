"""Structured outputs over the public gRPC API end to end: segserve.client (blocking and asyncio) against a real
tiny stack (router, scheduler, speculative worker and drafter), the worker constraining the tiny random model's
output.

The schemas leave the model few choices (enums, booleans) and the regex a fixed length, so even a random model
finishes them well within max_tokens; whatever it picks must validate (jsonschema), fullmatch, or be one of the
choices, streamed or not. What cannot compile is a SegserveError INVALID_ARGUMENT naming the field, and no
request reaches the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import jsonschema
import pydantic
import pytest

from segserve.client import AsyncClient, Client, SegserveError
from tests.support.e2e_helpers import scheduler_stats, tiny_stack, wait_until_idle

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MAX_TOKENS = 96
PROMPT = "Name a capital city and say whether it is one:"
CITY_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "is_capital"],
               "properties": {"city": {"enum": ["Paris", "Rome", "Tokyo"]}, "is_capital": {"type": "boolean"}}}
CODE = re.compile("[0-9]{3}-[a-z]{2}")
CHOICES = ("alpha", "beta", "gamma")


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    city: Literal["Paris", "Rome", "Tokyo"]
    is_capital: bool


@pytest.fixture(scope="module")
def stack(tiny_gemma3_dir, tmp_path_factory):
    with tiny_stack(tiny_gemma3_dir, tmp_path_factory.mktemp("logs"), max_num_seqs=8) as stack:
        yield stack


@pytest.fixture
def client(stack):
    with Client(stack.grpc_address, timeout_s=120) as client:
        yield client


def _streamed(client: Client, num_choices: int = 1, **parameters) -> tuple[list[str], list[str | None]]:
    """(text, finish reason) of each choice of a streamed call."""
    texts, finish_reasons = [""] * num_choices, [None] * num_choices
    for event in client.stream(PROMPT, max_tokens=MAX_TOKENS, n=num_choices, **parameters):
        texts[event.index] += event.text
        finish_reasons[event.index] = event.finish_reason or finish_reasons[event.index]
    return texts, finish_reasons


@pytest.mark.parametrize("schema", [CITY_SCHEMA, json.dumps(CITY_SCHEMA), City], ids=["dict", "text", "pydantic"])
@pytest.mark.parametrize("temperature", [0, 1])
def test_a_json_schema_answer_validates(client, schema, temperature):
    result = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=temperature, seed=7, json_schema=schema)
    assert result.finish_reason == "eos_token", result
    jsonschema.validate(json.loads(result.text), CITY_SCHEMA)


def test_a_streamed_json_schema_answer_validates_on_every_choice(client):
    texts, finish_reasons = _streamed(client, num_choices=2, temperature=1, seed=3, json_schema=CITY_SCHEMA)
    assert finish_reasons == ["eos_token", "eos_token"], texts
    for text in texts:
        jsonschema.validate(json.loads(text), CITY_SCHEMA)


@pytest.mark.parametrize("is_streamed", [False, True], ids=["generate", "stream"])
@pytest.mark.parametrize("parameters, check", [
    ({"regex": CODE.pattern}, CODE.fullmatch),
    ({"choice": list(CHOICES)}, CHOICES.__contains__),
    ({"grammar": 'root ::= ("yes" | "no") "!"'}, {"yes!", "no!"}.__contains__),
], ids=["regex", "choice", "grammar"])  # fmt: skip
def test_regex_choice_and_grammar_constrain_the_text(client, is_streamed, parameters, check):
    if is_streamed:
        (text,), (finish_reason,) = _streamed(client, temperature=1, seed=5, **parameters)
    else:
        result = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, **parameters)
        text, finish_reason = result.text, result.finish_reason
    assert finish_reason == "eos_token" and check(text), (text, finish_reason)


def test_json_object_is_an_object(client):
    result = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, json_object=True)
    if result.finish_reason == "eos_token":  # a free-form object may run past max_tokens; a finished one parses
        assert isinstance(json.loads(result.text), dict), result
    else:
        assert result.text.startswith("{"), result


def test_the_asyncio_client_constrains_alike(stack):
    async def run():
        async with AsyncClient(stack.grpc_address, timeout_s=120) as client:
            result = await client.generate(PROMPT, max_tokens=MAX_TOKENS, json_schema=City)
            streamed = [event async for event in client.stream(PROMPT, max_tokens=MAX_TOKENS, choice=list(CHOICES))]
            return result, streamed

    result, streamed = asyncio.run(run())
    assert result.finish_reason == "eos_token" and City.model_validate_json(result.text, strict=True)
    assert "".join(event.text for event in streamed) in CHOICES and streamed[-1].finish_reason == "eos_token"


@pytest.mark.parametrize("parameters, field", [
    ({"json_schema": {"type": "frob"}}, "parameters.structured_output.json_schema"),
    ({"json_schema": "{not json"}, "parameters.structured_output.json_schema"),
    ({"regex": "(unclosed"}, "parameters.structured_output.regex"),
    ({"choice": []}, "parameters.structured_output.choice"),
    ({"grammar": 'start ::= "a"'}, "parameters.structured_output.grammar"),
], ids=["uncompilable-schema", "schema-not-json", "bad-regex", "no-choices", "grammar-without-root"])  # fmt: skip
def test_a_bad_spec_is_invalid_argument_naming_the_field(stack, client, parameters, field):
    num_steps = wait_until_idle(stack, timeout_s=10).num_steps
    for call in (lambda: client.generate(PROMPT, max_tokens=8, **parameters),
                 lambda: list(client.stream(PROMPT, max_tokens=8, **parameters))):
        with pytest.raises(SegserveError) as caught:
            call()
        assert caught.value.code == "INVALID_ARGUMENT" and caught.value.field == field, caught.value
        assert f"`{field}`" in caught.value.message and caught.value.num_attempts == 1
    stats = scheduler_stats(stack)
    assert stats.num_steps == num_steps and (stats.num_running, stats.num_waiting) == (0, 0)  # nothing reached it
