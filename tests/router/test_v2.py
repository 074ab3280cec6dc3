"""The /v2 (MindIE/Triton-style) routes end to end: real HTTP (uvicorn), httpx, a fake scheduler over gRPC."""

from __future__ import annotations

import json

import httpx
import pytest

# The router fixtures of test_router.py: a fake scheduler and a router serving MODEL in front of it.
from tests.router.test_server import MODEL, router_url, scheduler, tokenizer  # noqa: F401

DETAIL_KEYS = {"generated_tokens", "first_token_cost", "decode_cost", "batch_size", "queue_wait_time"}


def _post(router_url: str, body: dict, suffix: str = "generate", model: str = MODEL) -> httpx.Response:
    return httpx.post(f"{router_url}/v2/models/{model}/{suffix}", json=body, timeout=10)


def _events(response: httpx.Response) -> list[dict]:
    """The stream's events as JSON; every one must be a `data:` event (the stream has no end marker)."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    blocks = [b for b in response.text.split("\n\n") if b and not b.startswith(":")]
    assert response.text.endswith("\n\n") and all(b.startswith("data: ") for b in blocks)
    return [json.loads(b.removeprefix("data: ")) for b in blocks]


def _expected_text(fake, max_new_tokens: int) -> str:
    ids, _ = fake.expected_ids(max_new_tokens)
    return fake.tokenizer.decode(ids, skip_special_tokens=True)


def test_generate_with_details(router_url, scheduler):
    fake, _ = scheduler
    body = {"id": "a123", "text_input": "The answer:", "parameters": {"details": True, "max_new_tokens": 8}}
    out = _post(router_url, body).json()
    assert out["id"] == "a123" and out["model_name"] == MODEL and out["model_version"] is None
    assert out["text_output"] == _expected_text(fake, 8)
    details = out["details"]
    assert set(details) == DETAIL_KEYS | {"finish_reason"}
    assert details["finish_reason"] == "length" and details["generated_tokens"] == 8
    assert details["first_token_cost"] > 0 and details["decode_cost"] > 0
    assert details["batch_size"] == 1 and details["queue_wait_time"] > 0
    sent = fake.requests[-1]
    assert list(sent.prompt_token_ids) == fake.tokenizer("The answer:").input_ids
    assert sent.stopping.max_tokens == 8 and not sent.sampling.do_sample


def test_defaults_and_eos(router_url, scheduler):
    fake, _ = scheduler
    out = _post(router_url, {"text_input": "Hi"}).json()
    assert set(out) == {"id", "model_name", "model_version", "text_output", "finish_reason"}, "details on request"
    assert out["finish_reason"] == "length"
    assert out["id"] and out["text_output"] == _expected_text(fake, 20)
    sent = fake.requests[-1]
    assert sent.stopping.max_tokens == 20
    s = sent.sampling
    assert (s.do_sample, s.temperature, s.top_k, s.top_p, s.typical_p, s.repetition_penalty) == (
        False, 1.0, 0, 1.0, 1.0, 1.0)
    assert s.seed is None and not s.watermark
    eos = _post(router_url, {"text_input": "Hi", "parameters": {"max_new_tokens": 200, "details": True}}).json()
    assert eos["finish_reason"] == eos["details"]["finish_reason"] == "eos_token"
    assert eos["details"]["generated_tokens"] == len(fake.output_ids) + 1


def test_parameters_reach_the_scheduler(router_url, scheduler):
    fake, _ = scheduler
    params = {"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "typical_p": 0.5,
              "repetition_penalty": 1.2, "seed": 2**64 - 1, "batch_size": 4, "max_new_tokens": 3}
    assert _post(router_url, {"text_input": "x", "parameters": params}).status_code == 200
    s = fake.requests[-1].sampling
    assert s.do_sample and s.top_k == 5 and s.seed == 2**64 - 1
    assert (s.temperature, s.top_p, s.typical_p, s.repetition_penalty) == pytest.approx((0.7, 0.9, 0.5, 1.2))


def test_versions_path(router_url):
    out = httpx.post(f"{router_url}/v2/models/{MODEL}/versions/3/generate", json={"text_input": "x"}).json()
    assert out["model_name"] == MODEL and out["model_version"] == "3"
    events = _events(httpx.post(f"{router_url}/v2/models/{MODEL}/versions/v1.2/generate_stream",
                                json={"text_input": "x", "parameters": {"max_new_tokens": 4}}))
    assert {e["model_version"] for e in events} == {"v1.2"}


def test_stream_events_without_details(router_url, scheduler):
    """SPEC section 4: finish_reason is a top-level field of the last event; details only when asked for."""
    fake, _ = scheduler
    body = {"id": "a123", "text_input": "hello", "parameters": {"max_new_tokens": 8}}
    events = _events(_post(router_url, body, "generate_stream"))
    assert len(events) > 2
    *middle, last = events
    assert all(set(e) == {"id", "model_name", "model_version", "text_output"} for e in middle)
    assert set(last) == {"id", "model_name", "model_version", "text_output", "finish_reason"}
    assert last["finish_reason"] == "length"
    assert "".join(e["text_output"] for e in events) == _expected_text(fake, 8)


def test_stream_events(router_url, scheduler):
    fake, _ = scheduler
    body = {"id": "a123", "text_input": "hello", "parameters": {"max_new_tokens": 8, "details": True}}
    events = _events(_post(router_url, body, "generate_stream"))
    assert len(events) > 2
    assert all(set(e) == {"id", "model_name", "model_version", "text_output", "details"} for e in events[:-1])
    assert set(events[-1]) == {"id", "model_name", "model_version", "text_output", "details", "finish_reason"}
    assert events[-1]["finish_reason"] == "length"
    assert all(e["id"] == "a123" and e["model_name"] == MODEL and e["model_version"] is None for e in events)
    assert "".join(e["text_output"] for e in events) == _expected_text(fake, 8)
    *middle, last = [e["details"] for e in events]
    assert all("finish_reason" not in d for d in middle), "finish_reason is on the last event only"
    assert last["finish_reason"] == "length" and set(last) == DETAIL_KEYS | {"finish_reason"}
    counts = [d["generated_tokens"] for d in middle] + [last["generated_tokens"]]
    assert counts == sorted(counts) and counts[0] > 0 and counts[-1] == 8
    assert all(d["first_token_cost"] > 0 and d["decode_cost"] >= 0 for d in middle)
    assert all(set(d) == DETAIL_KEYS and d["batch_size"] == 1 and d["queue_wait_time"] > 0 for d in middle)
    assert last["decode_cost"] > 0 and last["batch_size"] == 1 and last["queue_wait_time"] > 0


def test_details_are_measured(router_url):
    """WAIT queues the request 1 s in the fake scheduler, SLOW spaces chunks of 2 tokens by 50 ms."""
    body = {"text_input": "WAIT SLOW", "parameters": {"max_new_tokens": 6, "perf_stat": True, "details": True}}
    response = _post(router_url, body, "generate_stream")
    assert response.text.startswith(": keep-alive\n\n"), "keep-alive comments while queued"
    events = _events(response)
    last = events[-1]["details"]
    assert last["queue_wait_time"] >= 1_000_000  # us, the scheduler's
    assert last["first_token_cost"] >= 1000  # ms, the router's: queueing included
    # Two 50 ms gaps between three chunks, as the router saw them: the first chunk's own delivery delay
    # (a loaded machine) may shave a few ms off, never add 0.9 s.
    assert 90 <= last["decode_cost"] < 1000
    latencies = [ms for e in events for ms in e["perf_stat"]["token_latencies_ms"]]
    assert len(latencies) == 6 and all(ms > 0 for ms in latencies)
    assert sum(latencies) == pytest.approx(last["first_token_cost"] + last["decode_cost"], abs=0.1)
    assert events[-1]["perf_stat"]["scheduler_first_token_ms"] >= 1000
    out = _post(router_url, body).json()
    assert out["details"]["decode_cost"] >= 100 and len(out["perf_stat"]["token_latencies_ms"]) == 6


def _too_long_input() -> str:
    return "x" * (512 * 1024 + 1)


@pytest.mark.parametrize(("body", "param"), [
    ({"text_input": "x", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
    ({"text_input": "x", "parameters": {"max_new_tokens": 1.5}}, "parameters.max_new_tokens"),
    ({"text_input": "x", "parameters": {"max_new_tokens": "5"}}, "parameters.max_new_tokens"),
    ({"text_input": "x", "parameters": {"max_new_tokens": 100000}}, "parameters.max_new_tokens"),
    ({"text_input": "x", "parameters": {"repetition_penalty": 0}}, "parameters.repetition_penalty"),
    ({"text_input": "x", "parameters": {"seed": 0}}, "parameters.seed"),
    ({"text_input": "x", "parameters": {"seed": 2**64}}, "parameters.seed"),
    ({"text_input": "x", "parameters": {"temperature": 0}}, "parameters.temperature"),
    ({"text_input": "x", "parameters": {"temperature": "hot"}}, "parameters.temperature"),
    ({"text_input": "x", "parameters": {"top_k": -1}}, "parameters.top_k"),
    ({"text_input": "x", "parameters": {"top_k": 10**9}}, "parameters.top_k"),
    ({"text_input": "x", "parameters": {"top_p": 0}}, "parameters.top_p"),
    ({"text_input": "x", "parameters": {"top_p": 1.01}}, "parameters.top_p"),
    ({"text_input": "x", "parameters": {"batch_size": 0}}, "parameters.batch_size"),
    ({"text_input": "x", "parameters": {"typical_p": -1}}, "parameters.typical_p"),
    ({"text_input": "x", "parameters": {"typical_p": 1.5}}, "parameters.typical_p"),
    ({"text_input": "x", "parameters": {"details": "yes"}}, "parameters.details"),
    ({"text_input": "x", "parameters": {"do_sample": 1}}, "parameters.do_sample"),
    ({"text_input": "x", "parameters": {"perf_stat": "true"}}, "parameters.perf_stat"),
    ({"text_input": "x", "parameters": {"watermark": 1}}, "parameters.watermark"),
    ({"text_input": "x", "parameters": {"stop": ["\n"]}}, "parameters.stop"),
    ({"text_input": "x", "parameters": 5}, "parameters"),
    ({"text_input": "x", "id": ""}, "id"),
    ({"text_input": "x", "id": 5}, "id"),
    ({"text_input": ""}, "text_input"),
    ({"text_input": ["x"]}, "text_input"),
    ({"parameters": {}}, "text_input"),
    ({"text_input": _too_long_input()}, "text_input"),
    ({"text_input": "word " * 300}, "text_input"),  # more tokens than the context holds
])
@pytest.mark.parametrize("suffix", ["generate", "generate_stream"])
def test_bad_input_gets_400_naming_the_field(router_url, body, param, suffix):
    response = _post(router_url, body, suffix)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param.removeprefix("parameters.") in error["message"]


def test_watermark_reaches_the_scheduler(router_url, scheduler):
    fake, _ = scheduler
    assert _post(router_url, {"text_input": "x", "parameters": {"watermark": True}}).status_code == 200
    assert fake.requests[-1].sampling.watermark


@pytest.mark.parametrize("path", ["no-such-model/generate", "no-such-model/generate_stream",
                                  "no-such-model/versions/1/generate"])
def test_unknown_model_is_404(router_url, path):
    response = httpx.post(f"{router_url}/v2/models/{path}", json={"text_input": "x"})
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]", b'"text"', b"null"])
def test_garbage_bodies_get_400(router_url, content):
    response = httpx.post(f"{router_url}/v2/models/{MODEL}/generate", content=content,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_openapi_describes_bodies_and_errors(router_url):
    """Found by tests/router/test_fuzz_http.py: the hand-parsed /v2 bodies and the 400s were undocumented."""
    doc = httpx.get(f"{router_url}/openapi.json").json()
    for path in ("/v2/models/{model}/generate", "/v2/models/{model}/versions/{version}/generate_stream"):
        operation = doc["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body["required"] == ["text_input"] and "top_k" in body["properties"]["parameters"]["properties"]
        assert {p["name"] for p in operation["parameters"]} <= {"model", "version"}
        assert set(operation["responses"]) == {"200", "4XX", "5XX"}
    stream = doc["paths"]["/v2/models/{model}/generate_stream"]["post"]["responses"]["200"]["content"]
    assert "text/event-stream" in stream
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert set(doc["paths"][path]["post"]["responses"]) == {"200", "4XX", "5XX"}, "400, not FastAPI's 422"


def test_scheduler_failures(router_url):
    events = _post(router_url, {"text_input": "FAIL_MID"}, "generate_stream").text.split("\n\n")
    assert events[-1] == "" and json.loads(events[-2].removeprefix("data: "))["error"]["message"] == "worker crashed"
    assert json.loads(events[0].removeprefix("data: "))["text_output"]
    for suffix in ("generate", "generate_stream"):
        overloaded = _post(router_url, {"text_input": "OVERLOAD"}, suffix)
        assert overloaded.status_code == 429 and overloaded.headers["retry-after"] == "1"
