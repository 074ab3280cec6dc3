"""Tool calling at the router: what `tools` and `tool_choice` make of the prompt and the grammar sent to the
scheduler, and how a choice's text comes back as `tool_calls`, whole and streamed, through the official openai
client. The fake scheduler of test_server.py answers with whatever text a test sets (`fake.output_ids`); the
grammar itself is the worker's (tests/e2e/test_structured_outputs.py runs it on a real model).
"""

from __future__ import annotations

import contextlib
import json

import httpx
import openai
import pytest

from common.ports import free_port
from protos.segserve.v1.sampling import StructuredKind
from router.config import RouterConfig
from router.prompts import chat_prompt_ids
from router.protocol import ChatCompletionRequest
from router.tools import template_tools
from tests.router.test_server import MODEL, router_url, scheduler, tokenizer  # noqa: F401
from tests.support.router_server import serve_router
from tests.support.tool_streams import streamed_tool_calls

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Now.", "parameters": {"type": "object"}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def hermes_url(scheduler, tiny_gemma3_dir):  # noqa: F811
    """A router reading auto tool calls with the hermes parser, on the same fake scheduler."""
    _, grpc_port = scheduler
    config = RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{grpc_port}", port=free_port(),
                          scheduler_wait_s=10, tool_call_parser="hermes")
    with serve_router(config) as url:
        yield url


@contextlib.contextmanager
def answering(fake, text: str):
    """The fake scheduler answers `text` (then EOS) to every request while inside."""
    before = fake.output_ids
    fake.output_ids = fake.tokenizer(text, add_special_tokens=False).input_ids
    try:
        yield
    finally:
        fake.output_ids = before


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _streamed(client: openai.OpenAI, **params) -> tuple[str, list[dict], str | None]:
    return streamed_tool_calls(client.chat.completions.create(model=MODEL, messages=USER, stream=True, **params))


def _whole(client: openai.OpenAI, **params) -> tuple[str | None, list[dict], str | None]:
    choice = client.chat.completions.create(model=MODEL, messages=USER, **params).choices[0]
    calls = [{"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
             for call in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


def _schema_sent(fake) -> dict:
    structured = fake.requests[-1].sampling.structured_output
    assert structured.kind is StructuredKind.JSON_SCHEMA
    return json.loads(structured.spec)


@pytest.mark.parametrize("read", [_whole, _streamed])
def test_required_calls_are_forced_by_an_array_schema_and_parsed(router_url, scheduler, read):
    fake, _ = scheduler
    text = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"get_time","parameters":{}}]'
    with answering(fake, text):
        content, calls, finish_reason = read(_client(router_url), tools=[WEATHER, TIME], tool_choice="required",
                                             max_tokens=200)
    assert not content and finish_reason == "tool_calls"
    assert [(call["name"], json.loads(call["arguments"])) for call in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(call["id"].startswith("call_") for call in calls) and calls[0]["id"] != calls[1]["id"]
    schema = _schema_sent(fake)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    options = schema["items"]["anyOf"]
    assert [option["properties"]["name"]["enum"] for option in options] == [["get_weather"], ["get_time"]]
    assert options[0]["properties"]["parameters"] == CITY


def test_without_parallel_calls_the_array_holds_one(router_url, scheduler):
    fake, _ = scheduler
    with answering(fake, '[{"name":"get_weather","parameters":{"city":"Rome"}}]'):
        _whole(_client(router_url), tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    schema = _schema_sent(fake)
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"]["enum"] == ["get_weather"]


@pytest.mark.parametrize("read", [_whole, _streamed])
def test_a_named_function_gets_the_whole_output_as_its_arguments(router_url, scheduler, read):
    fake, _ = scheduler
    with answering(fake, '{"city": "Tokyo"}'):
        content, calls, finish_reason = read(_client(router_url), tools=[TIME, WEATHER], tool_choice=NAMED)
    assert not content and finish_reason == "tool_calls"
    assert [(call["name"], call["arguments"]) for call in calls] == [("get_weather", '{"city": "Tokyo"}')]
    assert _schema_sent(fake) == CITY


def test_a_forced_call_cut_by_max_tokens_ends_with_length(router_url, scheduler):
    fake, _ = scheduler
    with answering(fake, '[{"name":"get_weather","parameters":{"city":"Paris"}}]'):
        content, calls, finish_reason = _whole(_client(router_url), tools=[WEATHER], tool_choice="required",
                                               max_tokens=5)
    assert finish_reason == "length" and calls == [] and content  # an unfinished array stays text


@pytest.mark.parametrize("read", [_whole, _streamed])
def test_auto_reads_hermes_calls_after_content(hermes_url, scheduler, read):
    fake, _ = scheduler
    text = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    with answering(fake, text):
        content, calls, finish_reason = read(_client(hermes_url), tools=[WEATHER, TIME], max_tokens=200)
    assert content == "Let me look.\n" and finish_reason == "tool_calls"  # the text between the calls is content
    assert [(call["name"], json.loads(call["arguments"])) for call in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert fake.requests[-1].sampling.structured_output is None  # auto: the model chooses freely


@pytest.mark.parametrize("read", [_whole, _streamed])
def test_auto_without_parallel_calls_keeps_the_first(hermes_url, scheduler, read):
    fake, _ = scheduler
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    with answering(fake, text):
        _, calls, finish_reason = read(_client(hermes_url), tools=[WEATHER, TIME], tool_choice="auto",
                                       parallel_tool_calls=False, max_tokens=200)
    assert [call["name"] for call in calls] == ["get_weather"] and finish_reason == "tool_calls"


@pytest.mark.parametrize("text", ["It is sunny in Paris.", "<tool_call>{not json</tool_call>", "<tool_call>{"])
@pytest.mark.parametrize("read", [_whole, _streamed])
def test_auto_text_that_is_no_call_comes_back_as_content(hermes_url, scheduler, text, read):
    fake, _ = scheduler
    with answering(fake, text):
        content, calls, finish_reason = read(_client(hermes_url), tools=[WEATHER], max_tokens=200)
    assert (content, calls, finish_reason) == (text, [], "stop")


def test_tool_choice_none_is_plain_text(hermes_url, scheduler):
    fake, _ = scheduler
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    with answering(fake, text):
        content, calls, finish_reason = _whole(_client(hermes_url), tools=[WEATHER], tool_choice="none")
    assert (content, calls, finish_reason) == (text, [], "stop")


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [WEATHER]}, "tool_choice", "--tool-call-parser"),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
    ({"tool_choice": "auto"}, "tool_choice", 'tool_choice "auto" needs `tools`'),
    ({"tools": [], "tool_choice": "auto"}, "tool_choice", "needs `tools`"),
    ({"tool_choice": NAMED}, "tool_choice", "needs `tools`"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in `tools`"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tool_choice", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"}, "tools", "letters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}], "tool_choice": "none"}, "tools",
     "JSON schema"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools", ""),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "one structured output"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, "tool_choice", "does not compile"),
])  # fmt: skip
def test_tool_requests_that_cannot_be_met_are_a_400_naming_the_field(router_url, body, param, words):
    response = httpx.post(f"{router_url}/v1/chat/completions", json={"model": MODEL, "messages": USER, **body},
                          timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].split(".")[0] == param and words in error["message"], error


def test_tool_choice_none_needs_no_tools(router_url):
    response = httpx.post(f"{router_url}/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": USER, "tool_choice": "none", "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_a_second_turn_sends_the_call_and_the_tools_answer(router_url, scheduler):
    fake, _ = scheduler
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    response = httpx.post(f"{router_url}/v1/chat/completions",
                          json={"model": MODEL, "messages": history, "tools": [WEATHER], "tool_choice": "none"},
                          timeout=30)
    assert response.status_code == 200, response.text
    assert "21 C" in fake.tokenizer.decode(fake.requests[-1].prompt_token_ids)


TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool.function.name }}:{{ tool.function.parameters | tojson }};"
    "{% endfor %}</tools>{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for call in m.tool_calls or [] %}[{{ call.function.name }} {{ call.function.arguments.city }}]{% endfor %}"
    "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{% endfor %}<|assistant|>"
)


def test_the_template_sees_the_tools_and_the_calls_arguments_as_an_object(tokenizer):  # noqa: F811
    body = ChatCompletionRequest.model_validate({"messages": [
        *USER, {"role": "assistant", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"}], "tools": [WEATHER], "tool_choice": "none"})
    templated = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    templated.chat_template = TOOLS_TEMPLATE
    text = templated.decode(chat_prompt_ids(templated, body.template_messages(), template_tools(body.tools)))
    assert text.startswith('<tools>get_weather:{"type": "object", "properties": {"city": {"type": "string"}}, '
                           '"required": ["city"]};</tools>')
    assert "<|assistant|>[get_weather Oslo]<|tool|>cold(c1)<|assistant|>" in text
