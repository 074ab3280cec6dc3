"""Every API checked by the one contract validator, and the OpenAI/MindIE features the contract carries.

Through real HTTP against the fake scheduler of test_router.py: non-finite and
out-of-range numbers are a 400 naming the field in the API's own words and
never reach the scheduler (the bug: `"temperature": Infinity` used to kill the
worker's batch); logit_bias and echo with logprobs reach the scheduler as the
contract's fields; a request that failed alone in the worker ends with
finish_reason "error"; the OpenAPI document's bounds are the contract's RANGES.
"""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from protos.segserve.v1.sampling import FLOAT32_MAX, RANGES
from tests.support.fake_scheduler import OUTPUT_TEXT, WORKER_ERROR_MESSAGE, prompt_logprob
from tests.router.test_server import MODEL, router_url, scheduler, tokenizer  # noqa: F401

USER = [{"role": "user", "content": "hi"}]
BAD_FLOATS = [math.inf, -math.inf, math.nan, 1e39]
HUGE_INT = 10**30
OPENAI_FLOATS = ["temperature", "top_p", "typical_p", "repetition_penalty", "frequency_penalty", "presence_penalty"]
V2_FLOATS = ["temperature", "top_p", "typical_p", "repetition_penalty"]


@pytest.fixture
def client(router_url):
    return openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0)


def _post_raw(router_url: str, path: str, body: dict) -> httpx.Response:
    """POST `body` written by Python's json, which writes Infinity and NaN (as clients can)."""
    return httpx.post(f"{router_url}{path}", content=json.dumps(body).encode(),
                      headers={"Content-Type": "application/json"}, timeout=10)


def _assert_refused(response: httpx.Response, param: str, fake, num_sent_before: int) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param.removeprefix("parameters.") in error["message"]
    assert len(fake.requests) == num_sent_before, "nothing may reach the scheduler"


def _completion_cases() -> list[tuple[dict, str]]:
    cases = [({name: value}, name) for name in OPENAI_FLOATS for value in BAD_FLOATS]
    cases += [({"logit_bias": {"5": value}}, "logit_bias") for value in BAD_FLOATS]
    ints = ["max_tokens", "max_completion_tokens", "top_k", "seed", "n", "logprobs", "best_of"]
    cases += [({name: HUGE_INT}, name) for name in ints]
    cases += [({"logprobs": 1, "echo": True, "top_k": -HUGE_INT}, "top_k"), ({"seed": -HUGE_INT}, "seed")]
    return cases


@pytest.mark.parametrize(("extra", "param"), _completion_cases())
def test_completions_refuse_non_finite_and_huge_values(router_url, scheduler, extra, param):
    fake, _ = scheduler
    num_sent = len(fake.requests)
    body = {"model": MODEL, "prompt": "x", **extra}
    _assert_refused(_post_raw(router_url, "/v1/completions", body), param, fake, num_sent)
    _assert_refused(_post_raw(router_url, "/v1/completions", {**body, "stream": True}), param, fake, num_sent)


def _chat_cases() -> list[tuple[dict, str]]:
    cases = [({name: value}, name) for name in OPENAI_FLOATS for value in BAD_FLOATS]
    cases += [({"logit_bias": {"5": value}}, "logit_bias") for value in BAD_FLOATS]
    ints = ["max_tokens", "max_completion_tokens", "top_k", "seed", "n"]
    cases += [({name: HUGE_INT}, name) for name in ints]
    cases += [({"logprobs": True, "top_logprobs": HUGE_INT}, "top_logprobs"),
              ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
              ({"max_completion_tokens": 0}, "max_completion_tokens")]
    return cases


@pytest.mark.parametrize(("extra", "param"), _chat_cases())
def test_chat_refuses_non_finite_and_huge_values(router_url, scheduler, extra, param):
    fake, _ = scheduler
    num_sent = len(fake.requests)
    body = {"model": MODEL, "messages": USER, **extra}
    _assert_refused(_post_raw(router_url, "/v1/chat/completions", body), param, fake, num_sent)


def _v2_cases() -> list[tuple[dict, str]]:
    cases = [({name: value}, f"parameters.{name}") for name in V2_FLOATS for value in BAD_FLOATS]
    ints = ["max_new_tokens", "top_k", "seed", "batch_size"]
    return cases + [({name: HUGE_INT}, f"parameters.{name}") for name in ints]


@pytest.mark.parametrize(("parameters", "param"), _v2_cases())
@pytest.mark.parametrize("suffix", ["generate", "generate_stream"])
def test_v2_refuses_non_finite_and_huge_values(router_url, scheduler, parameters, param, suffix):
    fake, _ = scheduler
    num_sent = len(fake.requests)
    body = {"text_input": "x", "parameters": parameters}
    _assert_refused(_post_raw(router_url, f"/v2/models/{MODEL}/{suffix}", body), param, fake, num_sent)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}),
    ("/v1/chat/completions", {"messages": USER, "repetition_penalty": 0}),
    (f"/v2/models/{MODEL}/generate", {"text_input": "x", "parameters": {"repetition_penalty": 0}}),
])
def test_every_api_gives_the_contracts_message(router_url, path, body):
    """One validator: the same value gets the same explanation whichever API it came through."""
    message = _post_raw(router_url, path, body).json()["error"]["message"]
    assert f"must be in {RANGES['repetition_penalty'].describe()} (got 0.0)" in message


def test_openai_edge_mapping_still_applies(client, scheduler):
    fake, _ = scheduler
    client.completions.create(model=MODEL, prompt="a", max_tokens=2, temperature=0.0, seed=-2,
                              extra_body={"top_k": -1})
    s = fake.requests[-1].sampling
    assert not s.do_sample and s.temperature == 1.0 and s.top_k == 0 and s.seed == 2**64 - 2


def test_logit_bias_reaches_the_scheduler(client, scheduler):
    fake, _ = scheduler
    client.completions.create(model=MODEL, prompt="a", max_tokens=2, logit_bias={"5": 10, "7": -100})
    assert fake.requests[-1].sampling.logit_bias == {5: 10.0, 7: -100.0}
    client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, logit_bias={"11": 2.5})
    assert fake.requests[-1].sampling.logit_bias == {11: 2.5}
    client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, logit_bias={})
    assert fake.requests[-1].sampling.logit_bias == {}


def _completion(router_url: str, **body) -> dict:
    response = httpx.post(f"{router_url}/v1/completions", json={"model": MODEL, **body}, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("prompt", ["The capital of France is", [5, 6, 7, 8, 9]])
def test_echo_with_logprobs_has_openais_legacy_shape(router_url, scheduler, prompt):
    """lm-evaluation-harness's local-completions loglikelihood request."""
    fake, _ = scheduler
    out = _completion(router_url, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    sent = fake.requests[-1]
    assert sent.sampling.num_prompt_logprobs == 1 and sent.sampling.num_top_logprobs == 1
    prompt_ids = list(sent.prompt_token_ids)
    prompt_text = prompt if isinstance(prompt, str) else fake.tokenizer.decode(prompt_ids)
    choice = out["choices"][0]
    generated = fake.tokenizer.decode(fake.output_ids[:1])
    assert choice["text"] == prompt_text + generated
    lp = choice["logprobs"]
    num = len(prompt_ids) + 1
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == num
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:-1] == pytest.approx([prompt_logprob(p) for p in range(1, len(prompt_ids))])
    assert all(isinstance(top, dict) and lp["tokens"][i + 1] in top for i, top in enumerate(lp["top_logprobs"][1:]))
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert lp["text_offset"][-1] == len(prompt_text), "generated tokens follow the prompt text"
    ctxlen = len(prompt_ids)  # what the harness sums: the continuation's logprobs
    assert math.isfinite(sum(lp["token_logprobs"][ctxlen:]))


def test_echo_streamed_and_without_logprobs(router_url, scheduler):
    fake, _ = scheduler
    plain = _completion(router_url, prompt="Say:", max_tokens=3, temperature=0, echo=True)
    assert plain["choices"][0]["text"] == "Say:" + fake.tokenizer.decode(fake.output_ids[:3])
    assert plain["choices"][0]["logprobs"] is None and fake.requests[-1].sampling.num_prompt_logprobs is None
    body = {"model": MODEL, "prompt": "Say:", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 0,
            "stream": True}
    events = httpx.post(f"{router_url}/v1/completions", json=body, timeout=10).text.split("\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == "Say:" + fake.tokenizer.decode(fake.output_ids[:3])
    first = chunks[0]["choices"][0]
    assert first["text"].startswith("Say:") and first["logprobs"]["token_logprobs"][0] is None
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == len(fake.requests[-1].prompt_token_ids) + 3


def test_worker_error_ends_the_choice_with_finish_reason_error(router_url):
    whole = _completion(router_url, prompt="WORKER_ERROR", max_tokens=8)
    assert whole["choices"][0]["finish_reason"] == "error" and whole["choices"][0]["text"]
    body = {"model": MODEL, "prompt": "WORKER_ERROR", "max_tokens": 8, "stream": True}
    events = httpx.post(f"{router_url}/v1/completions", json=body, timeout=10).text.split("\n\n")
    assert events[-2] == "data: [DONE]"
    error = json.loads(events[-3].removeprefix("data: "))["error"]
    assert error["message"] == WORKER_ERROR_MESSAGE and error["code"] == "generation_error"
    assert json.loads(events[-4].removeprefix("data: "))["choices"][0]["finish_reason"] == "error"
    chat = httpx.post(f"{router_url}/v1/chat/completions", timeout=10,
                      json={"messages": [{"role": "user", "content": "WORKER_ERROR"}], "max_tokens": 8})
    assert chat.status_code == 200 and chat.json()["choices"][0]["finish_reason"] == "error"


def test_worker_error_in_v2(router_url):
    out = httpx.post(f"{router_url}/v2/models/{MODEL}/generate", timeout=10,
                     json={"text_input": "WORKER_ERROR", "parameters": {"details": True}}).json()
    assert out["finish_reason"] == out["details"]["finish_reason"] == "error"
    stream = httpx.post(f"{router_url}/v2/models/{MODEL}/generate_stream", timeout=10,
                        json={"text_input": "WORKER_ERROR"})
    events = [json.loads(b.removeprefix("data: ")) for b in stream.text.split("\n\n") if b.startswith("data: ")]
    assert events[-1]["finish_reason"] == "error" and "details" not in events[-1]


def test_a_worker_error_leaves_other_requests_alone(router_url):
    out = _completion(router_url, prompt="x", max_tokens=200, temperature=0)
    assert out["choices"][0]["text"] == OUTPUT_TEXT and out["choices"][0]["finish_reason"] == "stop"


def test_openapi_bounds_are_the_contracts(router_url):
    doc = httpx.get(f"{router_url}/openapi.json").json()
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["top_p"]["exclusiveMinimum"] == 0 and completion["top_p"]["maximum"] == 1
    assert completion["temperature"]["minimum"] == 0 and completion["temperature"]["maximum"] == FLOAT32_MAX
    assert completion["frequency_penalty"]["minimum"] == -2 and completion["frequency_penalty"]["maximum"] == 2
    assert completion["logprobs"]["maximum"] == 5
    assert completion["logit_bias"]["additionalProperties"]["maximum"] == 100
    v2 = doc["paths"]["/v2/models/{model}/generate"]["post"]["requestBody"]["content"]["application/json"]
    parameters = v2["schema"]["properties"]["parameters"]["properties"]
    assert parameters["top_p"]["exclusiveMinimum"] == 0 and parameters["top_p"]["maximum"] == 1
    assert parameters["max_new_tokens"]["minimum"] == RANGES["max_tokens"].low
