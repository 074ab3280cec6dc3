"""OpenAI semantics of the router: stop strings, n choices, logprobs shapes, usage, the values clients send.

Through real HTTP with the official openai client (sync and async) against the
fake scheduler of test_router.py, whose output is OUTPUT_TEXT, two tokens per chunk.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from protos.segserve.v1.generate import GenerateError
from protos.segserve.v1.usage import Usage
from router.choices import merge_choices
from router.generation import KEEPALIVE, Delta
from tests.support.fake_scheduler import OUTPUT_TEXT, TOP_LOGPROB
from tests.router.test_server import MODEL, router_url, scheduler, tokenizer  # noqa: F401

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def client(router_url):
    return openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def async_client(router_url):
    return openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0)


def _chunk_boundaries(fake) -> list[int]:
    """Character offsets in OUTPUT_TEXT where one of the fake's two-token chunks ends and the next begins."""
    ids = fake.output_ids
    ends = [len(fake.tokenizer.decode(ids[:end])) for end in range(2, len(ids), 2)]
    return [end for end in ends if 2 <= end <= len(OUTPUT_TEXT) - 2 and OUTPUT_TEXT[end - 2:end].isascii()]


def _stops_across_chunks(fake) -> list[str]:
    """Stop strings that start in one chunk and end in the next (each found first where it spans)."""
    stops = []
    for end in _chunk_boundaries(fake):
        stop = OUTPUT_TEXT[end - 2:end + 2]
        if OUTPUT_TEXT.find(stop) == end - 2:
            stops.append(stop)
    return stops


STOPS = ["🙂", "東京 Ü", "(a, b)", "\n", "Hello", "b\n", ["xyz", " + b"], ["return", "def"]]


def _expected(stop: str | list[str]) -> str:
    stops = [stop] if isinstance(stop, str) else stop
    return OUTPUT_TEXT[:min(OUTPUT_TEXT.find(s) for s in stops if s in OUTPUT_TEXT)]


@pytest.mark.parametrize("stop", STOPS)
def test_completion_stop_cuts_before_the_stop_string(client, stop):
    out = client.completions.create(model=MODEL, prompt="x", temperature=0, stop=stop)
    assert out.choices[0].text == _expected(stop)
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stop", STOPS)
async def test_chat_stream_stop_never_leaks(async_client, stop):
    stream = await async_client.chat.completions.create(model=MODEL, messages=USER, temperature=0, stop=stop,
                                                        stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    # A stream cannot take text back: if the concatenation is exact, no part of the stop string was ever sent.
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == _expected(stop)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_stop_strings_across_chunk_boundaries(client, scheduler):
    fake, _ = scheduler
    stops = _stops_across_chunks(fake)
    assert len(stops) >= 3
    for stop in stops:
        streamed = client.completions.create(model=MODEL, prompt="x", temperature=0, stop=[stop], stream=True)
        texts = [c.choices[0].text for c in streamed if c.choices]
        assert "".join(texts) == _expected(stop), stop
        whole = client.completions.create(model=MODEL, prompt="x", temperature=0, stop=stop)
        assert whole.choices[0].text == _expected(stop), stop


def test_a_stop_cancels_the_scheduler_call(client, scheduler):
    fake, _ = scheduler
    started = time.monotonic()
    out = client.completions.create(model=MODEL, prompt="SLOW", max_tokens=200, stop="東京")
    assert out.choices[0].text == OUTPUT_TEXT[:OUTPUT_TEXT.find("東京")]
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 20  # tokens generated up to the stop, not the budget
    assert time.monotonic() - started < 5
    assert out.id in fake.wait_cancelled(out.id), "the slot must be freed at the stop"


def test_stop_keeps_logprobs_of_the_emitted_text(client):
    out = client.chat.completions.create(model=MODEL, messages=USER, temperature=0, stop=" return",
                                         logprobs=True, top_logprobs=1)
    content = out.choices[0].message.content
    assert content == _expected(" return")
    token_text = b"".join(bytes(e.bytes) for e in out.choices[0].logprobs.content).decode()
    # Logprobs go per scheduler chunk: every emitted token is there, at most the chunk holding the stop beyond.
    assert token_text.startswith(content) and len(token_text) < len(content) + len(" return") + 8


def test_n_choices_non_streamed(client, scheduler):
    fake, _ = scheduler
    out = client.completions.create(model=MODEL, prompt="x", n=3, max_tokens=5, temperature=0, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) == 1, "greedy choices are identical"
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.prompt_tokens == len(fake.tokenizer("x").input_ids)
    assert out.usage.completion_tokens == 15
    assert out.usage.total_tokens == out.usage.prompt_tokens + 15
    sent = fake.requests[-3:]
    assert sorted(r.request_id for r in sent) == [f"{out.id}-{i}" for i in range(3)]
    assert sorted(r.sampling.seed for r in sent) == [7, 8, 9], "one reproducible seed per choice"


def test_several_prompts_non_streamed_with_echo(client, scheduler):
    fake, _ = scheduler
    echoed = ["x", "a longer prompt", "Ü 東京"]
    out = client.completions.create(model=MODEL, prompt=echoed, n=2, max_tokens=3, temperature=0, seed=7,
                                    echo=True)
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.text for c in out.choices] == [echoed[i // 2] + OUTPUT_TEXT[:len(c.text) - len(echoed[i // 2])]
                                             for i, c in enumerate(out.choices)]
    assert all(len(c.text) > len(echoed[i // 2]) for i, c in enumerate(out.choices))
    sent = {r.request_id: r for r in fake.requests[-6:]}
    assert sorted(sent) == [f"{out.id}-{i}" for i in range(6)]
    assert [sent[f"{out.id}-{i}"].sampling.seed for i in range(6)] == [7, 8] * 3, "seeds per choice, per prompt"
    assert list(sent[f"{out.id}-4"].prompt_token_ids) == fake.tokenizer("Ü 東京").input_ids
    assert out.usage.prompt_tokens == sum(len(sent[f"{out.id}-{i}"].prompt_token_ids) for i in (0, 2, 4))
    assert out.usage.completion_tokens == 6 * 3


def test_several_prompts_streamed(client, scheduler):
    fake, _ = scheduler
    ids = [fake.tokenizer("x").input_ids, fake.tokenizer("a longer prompt").input_ids]
    stream = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    texts, finishes = {0: "", 1: ""}, {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert texts[0] == texts[1] and OUTPUT_TEXT.startswith(texts[0]) and texts[0]
    assert finishes == {0: "length", 1: "length"}
    usage = chunks[-1].usage
    assert usage.completion_tokens == 8
    assert sorted(list(r.prompt_token_ids) for r in fake.requests[-2:]) == sorted(ids)
    assert usage.prompt_tokens == len(ids[0]) + len(ids[1])


@pytest.mark.parametrize("body, words", [
    ({"prompt": ["x", ""]}, "prompt 1 is empty"),
    ({"prompt": [[1, 2], [1, 99999999]]}, "outside the vocabulary"),
    ({"prompt": ["x", [1, 2]]}, "invalid type"),
    ({"prompt": ["x"] * 257}, "257 generations"),
    ({"prompt": ["x"] * 17, "n": 16}, "272 generations"),
])
def test_a_bad_prompt_in_a_list_refuses_the_whole_request(router_url, scheduler, body, words):
    fake, _ = scheduler
    num_sent = len(fake.requests)
    response = httpx.post(f"{router_url}/v1/completions", json={"model": MODEL, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and words in error["message"]
    assert len(fake.requests) == num_sent


def test_n_choices_with_a_negative_seed_and_none(client, scheduler):
    fake, _ = scheduler
    client.completions.create(model=MODEL, prompt="x", n=2, max_tokens=2, seed=-1)
    assert sorted(r.sampling.seed for r in fake.requests[-2:]) == [0, 2**64 - 1]
    client.completions.create(model=MODEL, prompt="x", n=2, max_tokens=2)
    assert all(r.sampling.seed is None for r in fake.requests[-2:])


async def test_n_choices_streamed_chat(async_client, scheduler):
    fake, _ = scheduler
    stream = await async_client.chat.completions.create(model=MODEL, messages=USER, n=2, temperature=0,
                                                        stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert {c.choices[0].index for c in chunks[:2]} == {0, 1}
    assert all(c.choices[0].delta.role == "assistant" for c in chunks[:2])
    contents = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        contents[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert contents == {0: OUTPUT_TEXT, 1: OUTPUT_TEXT}
    assert finishes == {0: "stop", 1: "stop"}
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 2 * (len(fake.output_ids) + 1)
    assert usage_chunk.usage.prompt_tokens == len(fake.requests[-1].prompt_token_ids)
    assert sum(1 for c in chunks if c.usage is not None) == 1


def test_n_choices_streamed_with_stop_and_logprobs(client, scheduler):
    fake, _ = scheduler
    stream = client.completions.create(model=MODEL, prompt="x", n=2, temperature=0, stop="(a", logprobs=2,
                                       stream=True, stream_options={"include_usage": True})
    texts, offsets, finishes = {0: "", 1: ""}, {0: [], 1: []}, {}
    chunks = list(stream)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        if choice.logprobs:
            offsets[choice.index] += choice.logprobs.text_offset
            assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert texts == {0: _expected("(a"), 1: _expected("(a")}
    assert finishes == {0: "stop", 1: "stop"}
    for index in (0, 1):
        assert offsets[index][0] == 0 and offsets[index] == sorted(offsets[index]), "offsets are per choice"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(fake.tokenizer("x").input_ids)


def test_completion_logprobs_shape(router_url):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    choice = httpx.post(f"{router_url}/v1/completions", json=body).json()["choices"][0]
    assert set(choice["logprobs"]) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert all(isinstance(top, dict) and len(top) == 2 for top in lp["top_logprobs"])
    zero = httpx.post(f"{router_url}/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]["logprobs"]
    # As OpenAI and vLLM answer `logprobs: 0`: the chosen token alone, with its own logprob.
    assert zero["token_logprobs"] == [TOP_LOGPROB] * 4
    assert zero["top_logprobs"] == [{token: TOP_LOGPROB} for token in zero["tokens"]]
    plain = httpx.post(f"{router_url}/v1/completions", json={**body, "logprobs": None}).json()["choices"][0]
    assert plain["logprobs"] is None


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "x"}),
                                        ("/v1/chat/completions", {"messages": USER})])
def test_usage_says_nothing_was_cached_with_a_0(router_url, path, body):
    """OpenAI's usage always carries prompt_tokens_details; clients read cached_tokens without a null check."""
    body = {"model": MODEL, "max_tokens": 3, **body}
    whole = httpx.post(f"{router_url}{path}", json=body, timeout=10).json()
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    streamed = httpx.post(f"{router_url}{path}", json={**body, "stream": True, "stream_options": {
        "include_usage": True}}, timeout=10).text.split("\n\n")
    usages = [json.loads(e.removeprefix("data: ")).get("usage") for e in streamed if e.startswith("data: {")]
    assert [u["prompt_tokens_details"] for u in usages if u] == [{"cached_tokens": 0}]


async def test_chat_logprobs_shape(async_client):
    out = await async_client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, temperature=0,
                                                     logprobs=True)
    entries = out.choices[0].logprobs.content
    assert len(entries) == 3
    assert all(e.logprob == pytest.approx(TOP_LOGPROB) and e.top_logprobs == [] and e.bytes for e in entries)
    stream = await async_client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3, temperature=0,
                                                        logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for c in [c async for c in stream] if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert len(streamed) == 3 and all(len(e.top_logprobs) == 3 for e in streamed)
    assert [e.token for e in streamed] == [e.token for e in entries]
    plain = await async_client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_the_values_clients_send_by_default_are_accepted(router_url):
    completion = {"model": MODEL, "prompt": "x", "max_tokens": 3, "temperature": 1, "top_p": 1.0, "n": 1,
                  "stream": False, "logprobs": None, "echo": False, "stop": None, "presence_penalty": 0,
                  "frequency_penalty": 0, "best_of": 1, "logit_bias": {}, "user": "", "suffix": None, "seed": None}
    response = httpx.post(f"{router_url}/v1/completions", json=completion)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"
    chat = {"model": MODEL, "messages": USER, "max_tokens": None, "max_completion_tokens": 3, "temperature": 1.0,
            "top_p": 1, "n": None, "stream": None, "stream_options": None, "logprobs": None, "top_logprobs": None,
            "stop": [], "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None, "seed": None,
            "response_format": {"type": "text"}, "parallel_tool_calls": True}
    response = httpx.post(f"{router_url}/v1/chat/completions", json=chat)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(("body", "param"), [
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # beyond the vocabulary
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"suffix": "x"}, "suffix"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_unsupported_or_bad_values_get_400_naming_the_field(router_url, body, param):
    response = httpx.post(f"{router_url}/v1/completions", json={"model": MODEL, "prompt": "x", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "structural_tag"}}, "response_format", "needs `format`"),
    ({"tools": TOOLS}, "tool_choice", 'tool_choice "auto" needs the server started with --tool-call-parser'),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
    ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
])  # fmt: skip
def test_chat_refuses_what_it_would_otherwise_ignore(router_url, scheduler, body, param, words):
    fake, _ = scheduler
    num_sent = len(fake.requests)
    response = httpx.post(f"{router_url}/v1/chat/completions", json={"model": MODEL, "messages": USER, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert len(fake.requests) == num_sent


def test_tools_with_tool_choice_none_leave_the_output_text(router_url):
    body = {"model": MODEL, "messages": USER, "max_tokens": 3, "tools": TOOLS, "tool_choice": "none"}
    response = httpx.post(f"{router_url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


def test_unknown_model_is_404_in_openai_shape(router_url):
    response = httpx.post(f"{router_url}/v1/chat/completions", json={"model": "nope", "messages": USER})
    assert response.status_code == 404
    assert response.json()["error"] == {"message": "The model `nope` does not exist.", "type": "invalid_request_error",
                                        "param": "model", "code": "model_not_found"}


def test_a_failing_choice_ends_the_stream_with_an_error(router_url):
    body = {"model": MODEL, "prompt": "FAIL_MID", "n": 2, "max_tokens": 8, "stream": True}
    events = httpx.post(f"{router_url}/v1/completions", json=body, timeout=10).text.split("\n\n")
    assert events[-2] == "data: [DONE]"
    assert json.loads(events[-3].removeprefix("data: "))["error"]["message"] == "worker crashed"


def test_a_client_leaving_cancels_every_choice(router_url, scheduler):
    fake, _ = scheduler
    body = {"model": MODEL, "prompt": "SLOW", "n": 2, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{router_url}/v1/completions", json=body, timeout=10) as response:
        assert next(response.iter_lines()).startswith("data: ")
    response_id = fake.requests[-1].request_id.rsplit("-", 1)[0]
    deadline = time.monotonic() + 5
    while len(fake.wait_cancelled(response_id)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(fake.wait_cancelled(response_id)) == [f"{response_id}-0", f"{response_id}-1"]


async def _events(*events):
    for event in events:
        yield event


async def test_merge_tags_indices_and_sums_usage_on_the_last_finish():
    first = _events(Delta("a", num_tokens=1), Delta("", finish_reason="stop", usage=Usage(4, 1)))
    second = _events(Delta("b", num_tokens=1), Delta("c", finish_reason="length", usage=Usage(4, 2)))
    out = [event async for event in merge_choices([first, second])]
    assert sorted((d.index, d.text) for d in out) == [(0, ""), (0, "a"), (1, "b"), (1, "c")]
    finished = [d for d in out if d.finish_reason]
    assert [d.usage for d in finished] == [None, Usage(4, 3)] and out[-1] is finished[-1]


async def test_merge_counts_each_prompts_tokens_once():
    streams = [_events(Delta("a", finish_reason="stop", usage=Usage(prompt, 1, cached)))
               for prompt, cached in [(4, 2), (4, 3), (7, 0), (7, 5)]]
    out = [event async for event in merge_choices(streams, prompts=[0, 0, 1, 1])]
    assert out[-1].usage == Usage(4 + 7, 4, 3 + 5)


async def test_merge_ends_at_a_failure_and_sends_keepalives():
    failure = GenerateError("internal", "boom")

    async def slow():
        yield Delta("x", num_tokens=1)
        await asyncio.sleep(3600)

    async def failing():
        await asyncio.sleep(0.05)
        yield failure

    out = [event async for event in merge_choices([slow(), failing()], keepalive_s=0.01)]
    assert KEEPALIVE in out and out[-1] is failure

