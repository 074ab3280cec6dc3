"""The HTTP surface end to end: the official openai client (sync and async) and raw httpx against a real stack.

One speculative stack on the tiny random Gemma3 serves every test. Greedy outputs
are compared with `model.generate(do_sample=False)`; stop strings, n, logprobs and
usage are checked in the shapes the openai client parses, and the /v2 routes in
their SSE event format, error bodies and measured details. /ready and /metrics last.
"""

from __future__ import annotations

import json
import math
import re

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.support.e2e_helpers import GreedyReference, start_stack

pytestmark = pytest.mark.e2e

COMPLETION_PROMPT = "The quick brown fox"
CHAT_PROMPT = "User: what is the capital of France? Assistant:"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def stack(tiny_gemma3_dir, tmp_path_factory):
    stack = start_stack(tiny_gemma3_dir, tmp_path_factory.mktemp("logs"), num_kv_blocks=128, block_size=16)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def reference(tiny_gemma3_dir) -> dict[str, str]:
    """Greedy texts of MAX_TOKENS tokens: the completion prompt and the chat prompt (as one user message)."""
    greedy = GreedyReference(tiny_gemma3_dir)
    return {"completion": greedy.completion(COMPLETION_PROMPT, MAX_TOKENS),
            "chat": greedy.chat(CHAT_PROMPT, MAX_TOKENS)}


@pytest.fixture(scope="module")
def client(stack) -> OpenAI:
    return OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
async def async_client(stack):
    client = AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield client
    await client.close()


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def messages(content: str = CHAT_PROMPT) -> list[dict]:
    return [{"role": "user", "content": content}]


def stop_string_in(text: str) -> str:
    """A 3-character printable ASCII string found in `text` past its first few characters."""
    for start in range(4, len(text) - 3):
        candidate = text[start:start + 3]
        if candidate.isascii() and candidate.isprintable() and " " not in candidate and text.index(candidate) >= 4:
            return candidate
    raise AssertionError(f"no usable stop string in {text!r}")


# --- stop strings ---------------------------------------------------------------------------------------------


def test_completion_stop_string_cuts_before_it(client, model, reference):
    stop = stop_string_in(reference["completion"])
    expected = reference["completion"][:reference["completion"].index(stop)]
    response = client.completions.create(model=model, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                         temperature=0, stop=[stop])
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "stop"
    events = list(client.completions.create(model=model, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                            temperature=0, stop=stop, stream=True))
    assert "".join(e.choices[0].text for e in events if e.choices) == expected
    finishes = [e.choices[0].finish_reason for e in events if e.choices]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])


async def test_chat_stop_string_cuts_before_it(client, async_client, model, reference):
    stop = stop_string_in(reference["chat"])
    expected = reference["chat"][:reference["chat"].index(stop)]
    response = client.chat.completions.create(model=model, messages=messages(), max_tokens=MAX_TOKENS,
                                              temperature=0, stop=[stop])
    assert response.choices[0].message.content == expected
    assert response.choices[0].finish_reason == "stop"
    stream = await async_client.chat.completions.create(model=model, messages=messages(), max_tokens=MAX_TOKENS,
                                                        temperature=0, stop=[stop], stream=True)
    events = [event async for event in stream]
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == expected
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "stop"


# --- n choices ------------------------------------------------------------------------------------------------


def test_n_greedy_completions_are_three_identical_references(client, model, reference):
    response = client.completions.create(model=model, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                         temperature=0, n=3)
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert [c.text for c in response.choices] == [reference["completion"]] * 3
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 3 * MAX_TOKENS


async def test_n_greedy_chat_streamed_with_usage(async_client, model, reference):
    stream = await async_client.chat.completions.create(
        model=model, messages=messages(), max_tokens=MAX_TOKENS, temperature=0, n=3, stream=True,
        stream_options={"include_usage": True},
    )
    events = [event async for event in stream]
    texts = {0: "", 1: "", 2: ""}
    finishes = {}
    for event in events[:-1]:
        assert event.usage is None
        for choice in event.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                assert choice.index not in finishes
                finishes[choice.index] = choice.finish_reason
    assert texts == {index: reference["chat"] for index in range(3)}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert events[-1].choices == []
    assert events[-1].usage.completion_tokens == 3 * MAX_TOKENS


# --- logprobs -------------------------------------------------------------------------------------------------


def test_completion_logprobs_two_alternatives_and_the_greedy_choice_is_the_max(client, model, reference):
    response = client.completions.create(model=model, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                         temperature=0, logprobs=2)
    choice = response.choices[0]
    assert choice.text == reference["completion"]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == MAX_TOKENS
    assert len(logprobs.text_offset) == MAX_TOKENS
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2
        assert logprob <= 0.0
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)
        assert top[token] == pytest.approx(logprob, abs=1e-5)


async def test_chat_logprobs_streamed_and_not(client, async_client, model, reference):
    response = client.chat.completions.create(model=model, messages=messages(), max_tokens=MAX_TOKENS,
                                              temperature=0, logprobs=True, top_logprobs=2)
    assert response.choices[0].message.content == reference["chat"]
    content = response.choices[0].logprobs.content
    assert len(content) == MAX_TOKENS == response.usage.completion_tokens
    stream = await async_client.chat.completions.create(model=model, messages=messages(), max_tokens=MAX_TOKENS,
                                                        temperature=0, logprobs=True, top_logprobs=2, stream=True)
    streamed = [lp async for event in stream if event.choices and event.choices[0].logprobs
                for lp in event.choices[0].logprobs.content]
    # The same tokens and, to float32 rounding, the same logprobs: the second request drafts from what the first
    # taught the drafter, so its logits come from other verification trees than the first one's.
    assert [lp.token for lp in streamed] == [lp.token for lp in content]
    assert [lp.logprob for lp in streamed] == pytest.approx([lp.logprob for lp in content], abs=1e-5)
    for lp in content:
        assert len(lp.top_logprobs) == 2
        assert lp.logprob == pytest.approx(max(t.logprob for t in lp.top_logprobs), abs=1e-5)
        assert lp.token in [t.token for t in lp.top_logprobs]
        assert lp.bytes is not None


# --- usage ----------------------------------------------------------------------------------------------------


async def test_stream_usage_is_the_last_chunk_with_no_choices(async_client, model, reference):
    stream = await async_client.completions.create(model=model, prompt=COMPLETION_PROMPT, max_tokens=MAX_TOKENS,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True})
    events = [event async for event in stream]
    assert "".join(e.choices[0].text for e in events if e.choices) == reference["completion"]
    assert all(e.usage is None for e in events[:-1])
    last = events[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == MAX_TOKENS
    assert last.usage.prompt_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


# --- /v2 ------------------------------------------------------------------------------------------------------


def v2_url(stack, model: str, stream: bool) -> str:
    return f"{stack.base_url}/v2/models/{model}/{'generate_stream' if stream else 'generate'}"


def sse_events(response: httpx.Response) -> list[dict]:
    """Every event of an SSE body; each non-empty line must be a `data:` line."""
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        events.append(json.loads(line.removeprefix("data: ")))
    return events


def test_v2_generate_with_details(stack, model, reference):
    body = {"id": "req-7", "text_input": COMPLETION_PROMPT,
            "parameters": {"max_new_tokens": MAX_TOKENS, "details": True}}
    response = httpx.post(v2_url(stack, model, stream=False), json=body, timeout=60)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["id"] == "req-7" and out["model_name"] == model and out["model_version"] is None
    assert out["text_output"] == reference["completion"]
    details = out["details"]
    assert details["finish_reason"] == "length"
    assert details["generated_tokens"] == MAX_TOKENS
    assert details["first_token_cost"] > 0 and details["decode_cost"] > 0
    assert details["batch_size"] >= 1 and details["queue_wait_time"] > 0


def _v2_stream(stack, model, parameters: dict) -> list[dict]:
    body = {"text_input": COMPLETION_PROMPT, "parameters": {"max_new_tokens": MAX_TOKENS, **parameters}}
    with httpx.stream("POST", v2_url(stack, model, stream=True), json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response)


def test_v2_generate_stream_event_format(stack, model, reference):
    events = _v2_stream(stack, model, {})
    assert len(events) >= 2
    assert "".join(e["text_output"] for e in events) == reference["completion"]
    assert len({e["id"] for e in events}) == 1 and events[0]["id"].startswith("gen-")
    # Without `details: true` the events carry none; finish_reason is top-level on the last one only.
    for event in events[:-1]:
        assert set(event) == {"id", "model_name", "model_version", "text_output"} and event["model_name"] == model
    assert set(events[-1]) == {"id", "model_name", "model_version", "text_output", "finish_reason"}
    assert events[-1]["finish_reason"] == "length"


def test_v2_generate_stream_details_when_asked(stack, model, reference):
    events = _v2_stream(stack, model, {"details": True})
    assert "".join(e["text_output"] for e in events) == reference["completion"]
    for event in events:
        assert {"id", "model_name", "text_output", "details"} <= event.keys()
        assert event["details"]["first_token_cost"] > 0 and event["details"]["decode_cost"] >= 0
    assert all("finish_reason" not in e and "finish_reason" not in e["details"] for e in events[:-1])
    counts = [e["details"]["generated_tokens"] for e in events]
    assert counts == sorted(counts)
    last = events[-1]["details"]
    assert events[-1]["finish_reason"] == last["finish_reason"] == "length"
    assert last["generated_tokens"] == MAX_TOKENS
    assert last["decode_cost"] > 0 and last["batch_size"] >= 1 and last["queue_wait_time"] > 0


@pytest.mark.parametrize("stream", [False, True], ids=["generate", "generate_stream"])
@pytest.mark.parametrize(("name", "value"), [
    ("top_p", 1.5), ("temperature", 0.0), ("max_new_tokens", 0), ("top_k", -1), ("top_k", 10**6),
    ("repetition_penalty", 0.0), ("seed", 0), ("typical_p", 2.0), ("max_new_tokens", 10**6),
])
def test_v2_out_of_range_parameter_is_a_400_naming_it(stack, model, name, value, stream):
    body = {"text_input": COMPLETION_PROMPT, "parameters": {name: value}}
    response = httpx.post(v2_url(stack, model, stream), json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == f"parameters.{name}"
    assert error["message"]


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_v2_watermark_is_accepted(stack, model, do_sample):
    body = {"text_input": COMPLETION_PROMPT,
            "parameters": {"max_new_tokens": 12, "watermark": True, "do_sample": do_sample, "seed": 7,
                           "details": True}}
    response = httpx.post(v2_url(stack, model, stream=False), json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["details"]["generated_tokens"] == 12
    with httpx.stream("POST", v2_url(stack, model, stream=True), json=body, timeout=60) as streamed:
        assert streamed.status_code == 200
        events = sse_events(streamed)
    assert events[-1]["details"]["generated_tokens"] == 12


# --- operations -----------------------------------------------------------------------------------------------


def test_ready_and_metrics_after_traffic(stack, client, model):
    assert httpx.get(stack.base_url + "/ready", timeout=10).status_code == 200
    client.completions.create(model=model, prompt=COMPLETION_PROMPT, max_tokens=4, temperature=0)
    metrics = httpx.get(stack.base_url + "/metrics", timeout=10)
    assert metrics.status_code == 200
    text = metrics.text
    running = re.search(r"^vllm:num_requests_running(\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    assert running is not None and float(running.group(2)) >= 0
    ttft = re.search(r"^vllm:time_to_first_token_seconds_count(\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    assert ttft is not None and float(ttft.group(2)) >= 1
    ttft_sum = re.search(r"^vllm:time_to_first_token_seconds_sum(\{[^}]*\})? (\S+)$", text, re.MULTILINE)
    assert ttft_sum is not None and 0 < float(ttft_sum.group(2)) < math.inf
