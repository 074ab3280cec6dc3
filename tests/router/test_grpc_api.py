"""The public gRPC API's conventions, against a router in front of the fake scheduler.

The router runs in this process (uvicorn and the gRPC API on one event loop, as
the router process runs them) with API keys and a small message limit, in front
of tests/support/fake_scheduler.py, whose prompt words pick a behaviour (OVERLOAD, SLOW,
WORKER_ERROR, FAIL_MID). Checked: the API key, each status and its trailing
metadata, cancellation and deadlines reaching the scheduler, events (tokens per
step, logprobs, prompt logprobs, details, usage), health and reflection on the
same port, and data reflow merging gRPC and HTTP turns into one session.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from common.ports import free_port
from protos.segserve.v1 import generation_pb2 as pb
from protos.segserve.v1 import generation_pb2_grpc
from router.config import RouterConfig
from router.grpc_api import server_options, start_grpc_server
from router.metrics import RouterMetrics
from segserve.reflow.config import ConsumerConfig
from segserve.reflow.consumer import consume
from segserve.reflow.export import export
from tests.support.fake_scheduler import OUTPUT_TEXT, WORKER_ERROR_MESSAGE, start_fake_scheduler
from tests.support.reflow_helpers import read_logs
from tests.support.router_server import serve_router_and_grpc

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-test"
KEY = "sk-grpc"
AUTH = (("authorization", f"Bearer {KEY}"),)
MAX_MESSAGE = 64 * 1024


@pytest.fixture(scope="module")
def tokenizer(tiny_gemma3_dir):
    return AutoTokenizer.from_pretrained(str(tiny_gemma3_dir))


@pytest.fixture(scope="module")
def scheduler(tokenizer):
    server, fake, port = start_fake_scheduler(tokenizer, model_name=MODEL)
    yield fake, port
    server.stop(grace=None)


@pytest.fixture(scope="module")
def router(scheduler, tiny_gemma3_dir):
    """(HTTP base URL, gRPC target) of a router with API keys and a 64 KiB gRPC message limit."""
    _, port = scheduler
    config = RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{port}", port=free_port(),
                          grpc_port=0, scheduler_wait_s=10, api_keys=[KEY], grpc_max_message_bytes=MAX_MESSAGE)
    with serve_router_and_grpc(config) as urls:
        yield urls


@pytest.fixture
def stub(router):
    with grpc.insecure_channel(router[1]) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def _request(prompt: str = "hello", **parameters) -> pb.GenerationRequest:
    return pb.GenerationRequest(prompt=prompt, parameters=pb.GenerationParameters(**parameters))


def _error(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        result = call(*args, **kwargs)
        if not hasattr(result, "SerializeToString"):  # a stream: read it to its end
            list(result)
    return caught.value


def _expected_text(fake, max_tokens: int) -> str:
    ids, _ = fake.expected_ids(max_tokens)
    return fake.tokenizer.decode(ids, skip_special_tokens=True)


# --- authentication -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", KEY),)],
                         ids=["none", "wrong", "no-scheme"])
def test_every_rpc_needs_the_api_key(stub, metadata):
    for call, request in [(stub.Generate, _request()), (stub.GenerateStream, _request()),
                          (stub.Tokenize, pb.TokenizeRequest(text="hi")),
                          (stub.Detokenize, pb.DetokenizeRequest(token_ids=[5])),
                          (stub.ListModels, pb.ListModelsRequest())]:
        error = _error(call, request, metadata=metadata, timeout=10)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, call
        assert "authorization: Bearer" in error.details()
    assert stub.ListModels(pb.ListModelsRequest(), metadata=AUTH, timeout=10).models[0].id == MODEL


def test_health_and_reflection_are_served_without_a_key(router):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(router[1]) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "segserve.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "segserve.v1.Generation" in services and "grpc.health.v1.Health" in services


# --- statuses -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("request_fields", "field"), [
    ({"parameters": {"top_p": 1.5}}, "parameters.top_p"),
    ({"parameters": {"temperature": float("inf")}}, "parameters.temperature"),
    ({"parameters": {"repetition_penalty": float("nan")}}, "parameters.repetition_penalty"),
    ({"parameters": {"frequency_penalty": 1e39}}, "parameters.frequency_penalty"),
    ({"parameters": {"top_k": 2**32 - 1}}, "parameters.top_k"),
    ({"parameters": {"max_tokens": 0}}, "parameters.max_tokens"),
    ({"parameters": {"max_tokens": 10**6}}, "parameters.max_tokens"),
    ({"parameters": {"n": 17}}, "parameters.n"),
    ({"parameters": {"logprobs": 21}}, "parameters.logprobs"),
    ({"parameters": {"prompt_logprobs": 21}}, "parameters.prompt_logprobs"),
    ({"parameters": {"stop": ["a", "b", "c", "d", "e"]}}, "parameters.stop"),
    ({"parameters": {"stop": [""]}}, "parameters.stop"),
    ({"parameters": {"stop_token_ids": [2**32 - 1]}}, "parameters.stop_token_ids"),
    ({"parameters": {"logit_bias": {5: 1000.0}}}, "parameters.logit_bias"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "word " * 600}, "prompt"),
    ({"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
    ({"prompt": "", "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
])
@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
def test_bad_input_is_invalid_argument_naming_the_field(stub, scheduler, request_fields, field, rpc):
    fake, _ = scheduler
    num_requests = len(fake.requests)
    fields = {"prompt": "hello", **request_fields}
    request = pb.GenerationRequest(prompt=fields["prompt"], messages=[pb.ChatMessage(**m) for m in
                                                                      fields.get("messages", [])],
                                   parameters=pb.GenerationParameters(**fields.get("parameters", {})))
    error = _error(getattr(stub, rpc), request, metadata=AUTH, timeout=10)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"`{field}`" in error.details() or field in error.details()
    assert dict(error.trailing_metadata())["invalid-field"] == field
    assert len(fake.requests) == num_requests  # refused before the scheduler saw it


def test_unknown_model_is_not_found(stub):
    for call, request in [(stub.Generate, pb.GenerationRequest(model="nope", prompt="hi")),
                          (stub.Tokenize, pb.TokenizeRequest(model="nope", text="hi")),
                          (stub.Detokenize, pb.DetokenizeRequest(model="nope", token_ids=[1]))]:
        error = _error(call, request, metadata=AUTH, timeout=10)
        assert error.code() == grpc.StatusCode.NOT_FOUND and "nope" in error.details()


def test_a_full_queue_is_resource_exhausted_with_the_retry_delay(stub):
    for call in (stub.Generate, stub.GenerateStream):
        error = _error(call, _request("OVERLOAD"), metadata=AUTH, timeout=10)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(error.trailing_metadata())["retry-after-ms"] == "1000"


def test_a_message_over_the_limit_is_resource_exhausted(stub):
    error = _error(stub.Generate, _request("x" * MAX_MESSAGE), metadata=AUTH, timeout=10)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_scheduler_failure_mid_stream_ends_the_stream_with_its_status(stub):
    events = []
    with pytest.raises(grpc.RpcError) as caught:
        for event in stub.GenerateStream(_request("FAIL_MID", max_tokens=64), metadata=AUTH, timeout=10):
            events.append(event)
    assert events and caught.value.code() == grpc.StatusCode.INTERNAL  # what the scheduler said: "internal"
    assert "worker crashed" in caught.value.details()


def test_no_live_scheduler_is_unavailable(tokenizer, tiny_gemma3_dir):
    server, _, port = start_fake_scheduler(tokenizer, model_name=MODEL)
    config = RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{port}", port=free_port(),
                          grpc_port=0, scheduler_wait_s=10, scheduler_retry_s=1)  # retried 1 s, then refused
    with serve_router_and_grpc(config) as (_, target), grpc.insecure_channel(target) as channel:
        server.stop(grace=None)
        error = _error(generation_pb2_grpc.GenerationStub(channel).Generate, _request(), timeout=10)
    assert error.code() == grpc.StatusCode.UNAVAILABLE


# --- cancellation ---------------------------------------------------------------------------------------------


def test_cancelling_or_a_deadline_cancels_the_scheduler_call(stub, scheduler):
    fake, _ = scheduler
    before = set(fake.cancelled)
    call = stub.GenerateStream(_request("SLOW", max_tokens=200), metadata=AUTH, timeout=30)
    next(call)
    call.cancel()
    assert _error(stub.GenerateStream, _request("SLOW", max_tokens=200), metadata=AUTH,
                  timeout=0.5).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _error(stub.Generate, _request("SLOW", max_tokens=200), metadata=AUTH,
                  timeout=0.5).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 5
    while len(set(fake.cancelled) - before) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(set(fake.cancelled) - before) == 3
    assert fake.num_streaming == 0


# --- what comes back ------------------------------------------------------------------------------------------


def test_stream_events_carry_tokens_steps_logprobs_details_and_usage(stub, scheduler, tokenizer):
    fake, _ = scheduler
    events = list(stub.GenerateStream(_request("hello", max_tokens=7, logprobs=2, prompt_logprobs=1, details=True),
                                      metadata=AUTH, timeout=10))
    assert "".join(e.text for e in events) == _expected_text(fake, 7)
    assert [t for e in events for t in e.token_ids] == fake.output_ids[:7]
    # The fake sends two tokens per chunk, one chunk per step: 1 token + 1 accepted draft.
    assert [n for e in events for n in e.step_num_tokens] == [2, 2, 2, 1]
    assert sum(e.num_accepted_draft_tokens for e in events) == 3
    logprobs = [lp for e in events for lp in e.logprobs]
    assert [lp.token_id for lp in logprobs] == fake.output_ids[:7]
    assert all(len(lp.top) == 2 and lp.top[0].token_id == lp.token_id and lp.token for lp in logprobs)
    prompt_ids = tokenizer("hello").input_ids
    positions = [p.position for e in events for p in e.prompt_logprobs]
    assert positions == list(range(1, len(prompt_ids)))
    assert all(e.details.first_token_cost_ms >= 0 and e.details.batch_size == 1 for e in events if e.token_ids)
    assert events[-1].details.generated_tokens == 7
    assert events[-1].finish_reason == pb.GENERATION_FINISH_REASON_LENGTH
    assert events[-1].usage.completion_tokens == 7 and events[-1].usage.prompt_tokens == len(prompt_ids)
    assert {e.id for e in events} == {events[0].id} and events[0].id.startswith("grpc-")


def test_generate_answers_every_choice_with_its_finish_reason(stub, scheduler):
    fake, _ = scheduler
    answer = stub.Generate(pb.GenerationRequest(prompt="hello", request_id="mine", parameters=pb.GenerationParameters(
        max_tokens=200, n=2)), metadata=AUTH, timeout=10)
    assert answer.id == "mine" and [c.index for c in answer.choices] == [0, 1]
    for choice in answer.choices:
        assert choice.text == OUTPUT_TEXT
        assert choice.finish_reason == pb.GENERATION_FINISH_REASON_EOS_TOKEN
        assert list(choice.token_ids) == fake.output_ids + [fake.eos_token_id]
    assert answer.usage.completion_tokens == 2 * (len(fake.output_ids) + 1)
    failed = stub.Generate(_request("WORKER_ERROR", max_tokens=50), metadata=AUTH, timeout=10)
    assert failed.choices[0].finish_reason == pb.GENERATION_FINISH_REASON_ERROR
    assert failed.choices[0].error_message == WORKER_ERROR_MESSAGE


def test_chat_and_tokenize_use_the_chat_template(stub, scheduler, tokenizer):
    fake, _ = scheduler
    messages = [pb.ChatMessage(role="user", content="Hi there")]
    stub.Generate(pb.GenerationRequest(messages=messages, parameters=pb.GenerationParameters(max_tokens=2)),
                  metadata=AUTH, timeout=10)
    tokens = stub.Tokenize(pb.TokenizeRequest(messages=messages), metadata=AUTH, timeout=10)
    template = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], add_generation_prompt=True,
                                             tokenize=False)
    assert list(tokens.token_ids) == tokenizer(template, add_special_tokens=False).input_ids
    assert fake.requests[-1].prompt_token_ids == tuple(tokens.token_ids)
    for call, request, field in [(stub.Detokenize, pb.DetokenizeRequest(token_ids=[len(tokenizer)]), "token_ids"),
                                 (stub.Tokenize, pb.TokenizeRequest(text=""), "text"),
                                 (stub.Tokenize, pb.TokenizeRequest(text="hi", messages=messages), "text")]:
        error = _error(call, request, metadata=AUTH, timeout=10)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert dict(error.trailing_metadata())["invalid-field"] == field


def test_metrics_label_grpc_requests(router, stub):
    url, _ = router

    def count() -> float:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "vllm:request_success_total" and s.labels.get("protocol") == "grpc"
                     and s.labels.get("finished_reason") == "length"), 0.0)

    before = count()
    stub.Generate(_request(max_tokens=3), metadata=AUTH, timeout=10)
    assert count() == before + 1


def test_keepalive_and_message_limits_are_the_configs():
    options = dict(server_options(RouterConfig(grpc_max_message_bytes=1000, grpc_keepalive_time_s=20,
                                               grpc_keepalive_timeout_s=5)))
    assert options["grpc.max_receive_message_length"] == options["grpc.max_send_message_length"] == 1000
    assert (options["grpc.keepalive_time_ms"], options["grpc.keepalive_timeout_ms"]) == (20_000, 5_000)
    assert options["grpc.keepalive_permit_without_calls"] == 1 and options["grpc.http2.max_pings_without_data"] == 0
    with pytest.raises(ValueError, match="grpc_port"):
        RouterConfig(grpc_port=70000)


def test_a_taken_grpc_port_stops_a_second_router(router):
    """Not shared with SO_REUSEPORT: a second router would take half the first one's connections."""
    taken = int(router[1].rsplit(":", 1)[1])
    config = RouterConfig(host="127.0.0.1", grpc_port=taken)
    state = SimpleNamespace(config=config, scheduler=None, metrics=RouterMetrics("tiny"))
    with pytest.raises(OSError, match=f"cannot bind the gRPC API to 127.0.0.1:{taken}"):
        asyncio.run(start_grpc_server(state, config))


# --- data reflow ----------------------------------------------------------------------------------------------


def test_grpc_turns_merge_with_http_turns_in_the_reflow_export(scheduler, tiny_gemma3_dir, tmp_path):
    _, port = scheduler
    config = RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{port}", port=free_port(),
                          grpc_port=0, scheduler_wait_s=10, reflow_queue_url=f"sqlite:///{tmp_path}/queue.db",
                          reflow_spill_dir=str(tmp_path / "spill"))
    opening = [{"role": "user", "content": "Tell me about adding numbers."}]
    with serve_router_and_grpc(config) as (url, target), grpc.insecure_channel(target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        first = httpx.post(f"{url}/v1/chat/completions", timeout=10,
                           json={"model": MODEL, "messages": opening, "max_tokens": 64})
        reply = first.json()["choices"][0]["message"]["content"]
        follow_up = [*opening, {"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
        second = stub.Generate(pb.GenerationRequest(messages=[pb.ChatMessage(**m) for m in follow_up],
                                                    request_id="grpc-turn-2",
                                                    parameters=pb.GenerationParameters(max_tokens=64)), timeout=10)
        # An explicit session: the HTTP header and the gRPC field name the same one.
        httpx.post(f"{url}/v1/completions", headers={"X-Session-Id": "s-42", "X-Request-Id": "http-s42"},
                   json={"model": MODEL, "prompt": "One", "max_tokens": 3}, timeout=10)
        stub.Generate(pb.GenerationRequest(prompt="Two", session_id="s-42", request_id="grpc-s42",
                                           parameters=pb.GenerationParameters(max_tokens=3)), timeout=10)
        _error(stub.GenerateStream, _request("SLOW", max_tokens=200), timeout=0.3)  # past its deadline
    # Leaving the block stopped the router, which flushed its recorder.
    consume(ConsumerConfig(queue_url=f"sqlite:///{tmp_path}/queue.db", sink_dir=str(tmp_path / "logs"),
                           is_drain=True))
    sessions = {turns[0]["session_id"]: turns for turns in read_logs(tmp_path / "logs")}
    chat = next(turns for turns in sessions.values() if any(t["request_id"] == "grpc-turn-2" for t in turns))
    assert len(chat) == 2 and chat[1]["request"]["protocol"] == "grpc"
    assert chat[1]["response_text"] == second.choices[0].text and chat[1]["finish"] == "complete"
    assert sorted(t["request_id"] for t in sessions["s-42"]) == ["grpc-s42", "http-s42"]
    assert [t["finish"] for turns in sessions.values() for t in turns].count("deadline") == 1
    out = tmp_path / "train.jsonl"
    export(tmp_path / "logs", out, "openai-chat")
    examples = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    merged = [*follow_up, {"role": "assistant", "content": second.choices[0].text}]
    assert merged in examples
    assert [*opening, {"role": "assistant", "content": reply}] not in examples  # the gRPC turn extends it


@pytest.mark.parametrize(("parameters", "is_sampled", "temperature"), [
    ({}, False, 1.0),
    ({"do_sample": True}, True, 1.0),
    ({"temperature": 0.0}, False, 1.0),
    ({"temperature": 0.0, "do_sample": True}, False, 1.0),  # OpenAI's 0 is greedy whatever else is set
    ({"temperature": 0.7}, True, 0.7),
    ({"top_k": 5}, True, 1.0),
    ({"top_k": 0}, False, 1.0),
    ({"top_p": 0.9}, True, 1.0),
    ({"top_p": 1.0}, False, 1.0),
    ({"typical_p": 0.5}, True, 1.0),
])
def test_sampling_parameters_make_do_sample_true(parameters, is_sampled, temperature):
    from router.grpc_convert import to_sampling

    sampling = to_sampling(pb.GenerationParameters(**parameters), 0)
    assert (sampling.do_sample, sampling.temperature) == (is_sampled, temperature)
