"""The router end to end: real HTTP (uvicorn), the official openai client, a fake scheduler over gRPC."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from router.config import RouterConfig
from protos.segserve.v1.generate import GenerateError, GenerateRequest, TokenChunk
from protos.segserve.v1.sampling import StoppingCriteria
from router.scheduler_client import SchedulerClient
from router.server import build_app
from tests.support.fake_scheduler import GREEDY_LOGIT, OUTPUT_TEXT, TOP_LOGPROB, start_fake_scheduler
from common.ports import free_port as _free_port
from tests.support.router_server import serve_router

MODEL = "tiny-test"


@pytest.fixture(scope="module")
def tokenizer(tiny_gemma3_dir):
    return AutoTokenizer.from_pretrained(str(tiny_gemma3_dir))


@pytest.fixture(scope="module")
def scheduler(tokenizer):
    server, fake, port = start_fake_scheduler(tokenizer, model_name=MODEL)
    yield fake, port
    server.stop(grace=None)


@pytest.fixture(scope="module")
def router_url(scheduler, tiny_gemma3_dir):
    _, grpc_port = scheduler
    config = RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{grpc_port}",
                          port=_free_port(), keepalive_interval_s=0.25, scheduler_wait_s=10)
    with serve_router(config) as url:
        yield url


@pytest.fixture
def client(router_url):
    return openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def async_client(router_url):
    return openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0)


def _expected_text(fake, max_tokens: int) -> str:
    ids, _ = fake.expected_ids(max_tokens)
    return fake.tokenizer.decode(ids, skip_special_tokens=True)


def test_completion_whole_output_stops_at_eos(client, scheduler):
    fake, _ = scheduler
    out = client.completions.create(model=MODEL, prompt="The answer:", temperature=0)
    assert out.choices[0].text == OUTPUT_TEXT
    assert out.choices[0].finish_reason == "stop"
    assert out.model == MODEL
    prompt_ids = fake.tokenizer("The answer:").input_ids
    assert list(fake.requests[-1].prompt_token_ids) == prompt_ids
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == len(fake.output_ids) + 1  # the EOS token counts, its text does not
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.id == fake.requests[-1].request_id
    time.sleep(0.1)  # the fake records the end of a call from gRPC's own thread
    assert out.id in fake.completed and out.id not in fake.cancelled, "a finished call must not be cancelled"


def test_completion_length_limit_and_token_prompt(client, scheduler):
    fake, _ = scheduler
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5)
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text == _expected_text(fake, 5)
    assert list(fake.requests[-1].prompt_token_ids) == [5, 6, 7]
    assert fake.requests[-1].stopping.max_tokens == 5


def test_completion_stream_with_usage(client, scheduler):
    fake, _ = scheduler
    stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=12, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == _expected_text(fake, 12)
    assert all("\ufffd" not in t for t in texts)
    assert len([t for t in texts if t]) > 1, "the text must arrive in several deltas"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_default_max_tokens_is_bounded_by_context(client, scheduler):
    fake, _ = scheduler
    client.completions.create(model=MODEL, prompt="x " * 100)
    prompt_len = len(fake.requests[-1].prompt_token_ids)
    assert fake.requests[-1].stopping.max_tokens == min(256, fake.max_model_len - prompt_len)


async def test_chat_uses_template_with_a_single_bos(async_client, scheduler):
    fake, _ = scheduler
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}]
    out = await async_client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=9)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == _expected_text(fake, 9)
    assert out.choices[0].finish_reason == "length"
    templated = fake.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}],
        add_generation_prompt=True, tokenize=False)
    sent = list(fake.requests[-1].prompt_token_ids)
    assert sent == fake.tokenizer(templated, add_special_tokens=False).input_ids
    assert sent.count(fake.tokenizer.bos_token_id) == 1 and sent[0] == fake.tokenizer.bos_token_id


async def test_chat_stream(async_client, scheduler):
    fake, _ = scheduler
    stream = await async_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], stream=True,
        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == OUTPUT_TEXT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(fake.output_ids) + 1
    assert chunks[-1].usage.prompt_tokens == len(fake.requests[-1].prompt_token_ids)


def test_sampling_fields_reach_the_scheduler(client, scheduler):
    fake, _ = scheduler
    client.completions.create(model=MODEL, prompt="a", max_tokens=2, temperature=0.7, top_p=0.9, seed=42,
                              frequency_penalty=0.5, presence_penalty=-0.5,
                              extra_body={"top_k": 5, "repetition_penalty": 1.2, "unknown_field": 1})
    s = fake.requests[-1].sampling
    assert s.do_sample and s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)
    assert (s.top_k, s.seed) == (5, 42)
    assert s.repetition_penalty == pytest.approx(1.2)
    assert (s.frequency_penalty, s.presence_penalty) == (0.5, -0.5)
    client.completions.create(model=MODEL, prompt="a", max_tokens=2)  # OpenAI's default temperature samples
    s = fake.requests[-1].sampling
    assert s.do_sample and s.temperature == 1.0 and s.seed is None
    client.completions.create(model=MODEL, prompt="a", max_tokens=2, temperature=0)
    s = fake.requests[-1].sampling
    assert not s.do_sample and s.temperature == 1.0 and s.num_top_logprobs == 0


def test_chat_logprobs(client, scheduler):
    fake, _ = scheduler
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                         max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert fake.requests[-1].sampling.num_top_logprobs == 2
    assert len(content) == 6
    # greedy scores are logits: the chosen token's logprob must come from the top list
    assert all(e.logprob == pytest.approx(TOP_LOGPROB) != GREEDY_LOGIT for e in content)
    assert all(len(e.top_logprobs) == 2 for e in content)
    text = b"".join(bytes(e.bytes) for e in content).decode(errors="replace")  # 6 tokens end inside 🙂
    assert text == out.choices[0].message.content == _expected_text(fake, 6)


def test_completion_logprobs(client, scheduler):
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 4
    assert lp.token_logprobs == [pytest.approx(TOP_LOGPROB)] * 4
    assert all(len(top) >= 1 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_models_and_unknown_model(client, router_url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="no-such-model", prompt="x")
    assert exc.value.body["code"] == "model_not_found" and exc.value.body["param"] == "model"
    assert httpx.get(f"{router_url}/health").json() == {"status": "ok"}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("completions", {"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": 12}, "prompt"),
    ("completions", {"model": MODEL, "prompt": "x", "n": 17}, "n"),
    ("completions", {"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completions", {"model": MODEL, "prompt": "x", "stop": ["a", ""]}, "stop"),
    ("completions", {"model": MODEL, "prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 6}, "logprobs"),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, "top_p"),
    ("completions", {"model": MODEL, "prompt": "x", "top_k": 100000}, "top_k"),
    ("completions", {"model": MODEL, "prompt": [1, 99999]}, "prompt"),
    ("completions", {"model": MODEL, "prompt": "word " * 300}, "prompt"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 100000}, "max_tokens"),
    # Strict types, found by tests/router/test_fuzz_http.py: these were quietly read as 0, 1 and 5.
    ("completions", {"model": MODEL, "prompt": [[False]]}, "prompt"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": True}, "logprobs"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 5.0}, "max_tokens"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                          "top_logprobs": True}, "top_logprobs"),
    ("chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
    ("chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
])
def test_bad_parameters_get_400_naming_the_field(router_url, path, body, param):
    response = httpx.post(f"{router_url}/v1/{path}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param in error["message"]


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]", b'"text"'])
def test_garbage_bodies_get_400(router_url, content):
    response = httpx.post(f"{router_url}/v1/completions", content=content,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=17)
    assert exc.value.body["param"] == "n" and "16" in exc.value.body["message"]


def _sse(router_url: str, prompt: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True, **extra}
    return httpx.post(f"{router_url}/v1/completions", json=body, timeout=10)


def test_sse_wire_format(router_url):
    response = _sse(router_url, "hello")
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    events = response.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events[:-1])
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(p["object"] == "text_completion" for p in payloads)


def test_error_mid_stream_becomes_an_error_event(router_url):
    events = _sse(router_url, "FAIL_MID").text.split("\n\n")
    assert events[-2] == "data: [DONE]"
    error = json.loads(events[-3].removeprefix("data: "))["error"]
    assert error["message"] == "worker crashed" and error["type"] == "server_error"
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"]


def test_scheduler_refusals_map_to_http_statuses(router_url):
    for stream in (False, True):
        overloaded = httpx.post(f"{router_url}/v1/completions", json={"prompt": "OVERLOAD", "stream": stream})
        assert overloaded.status_code == 429 and overloaded.headers["retry-after"] == "1"
        assert overloaded.json()["error"]["type"] == "rate_limit_error"
        rejected = httpx.post(f"{router_url}/v1/completions", json={"prompt": "REJECT", "stream": stream})
        assert rejected.status_code == 400 and "rejected" in rejected.json()["error"]["message"]


def test_keepalive_comments_while_waiting(router_url):
    text = _sse(router_url, "WAIT").text
    assert text.startswith(": keep-alive\n\n") and text.endswith("data: [DONE]\n\n")


def test_stream_disconnect_cancels_the_grpc_call(router_url, scheduler):
    fake, _ = scheduler
    body = {"model": MODEL, "prompt": "SLOW", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{router_url}/v1/completions", json=body, timeout=10) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    request_id = fake.requests[-1].request_id
    assert request_id in fake.wait_cancelled(request_id)


def test_non_streamed_disconnect_cancels_the_grpc_call(router_url, scheduler):
    fake, _ = scheduler
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{router_url}/v1/chat/completions", timeout=0.5,
                   json={"messages": [{"role": "user", "content": "SLOW"}], "max_tokens": 200})
    request_id = fake.requests[-1].request_id
    assert request_id.startswith("chatcmpl-") and request_id in fake.wait_cancelled(request_id)


async def test_client_deadline_ends_with_a_timeout_failure(scheduler, tokenizer):
    _, port = scheduler
    client = SchedulerClient(f"127.0.0.1:{port}")
    request = GenerateRequest("deadline-1", tokenizer("SLOW").input_ids, stopping=StoppingCriteria(max_tokens=200))
    events = [e async for e in client.generate(request, timeout_s=0.3)]
    await client.close()
    assert isinstance(events[0], TokenChunk)
    assert isinstance(events[-1], GenerateError) and events[-1].code == "timeout"


async def test_build_app_gives_up_without_a_scheduler(tokenizer):
    config = RouterConfig(scheduler_address=f"127.0.0.1:{_free_port()}", scheduler_wait_s=0.5)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="GetInfo"):
        await build_app(config, tokenizer=tokenizer)
    assert time.monotonic() - started < 5


def test_the_tool_call_parser_comes_from_the_models_card_unless_configured(tiny_gemma3_dir, tmp_path):
    """A catalog model's converted checkpoint names its parser (segserve-model.json); a configured parser wins; a
    directory without a card leaves tool_choice "auto" without one."""
    import shutil

    from common.checkpoint import MODEL_CARD
    from router.server import with_model_card

    carded = tmp_path / "carded"
    shutil.copytree(tiny_gemma3_dir, carded)
    (carded / MODEL_CARD).write_text(json.dumps({"name": "m", "tool_call_parser": "qwen2_5_coder"}))
    assert with_model_card(RouterConfig(model=str(carded))).tool_call_parser == "qwen2_5_coder"
    assert with_model_card(RouterConfig(model=str(carded), tool_call_parser="hermes")).tool_call_parser == "hermes"
    assert with_model_card(RouterConfig(model=str(tiny_gemma3_dir))).tool_call_parser == ""
