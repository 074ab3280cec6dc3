"""The public gRPC API (segserve.v1.Generation) end to end on a real tiny stack.

One speculative stack (worker, drafter, scheduler and router processes, as
`segserve serve` starts them) on the tiny random Gemma3. A client built from
server reflection alone streams the greedy text /v1/completions gives; 64
concurrent streams, a third of them cancelled or past their deadline, leave
the scheduler with nothing running, waiting or holding KV blocks; Generate,
Tokenize, Detokenize and ListModels agree with the HTTP API; the metrics count
gRPC requests under protocol="grpc". Last, the fuzz of the HTTP APIs
(test_fuzz_contract.py) at every RPC: hypothesis draws requests with
non-finite and huge numbers, empty, oversized (past the context, past the
message limit) and conflicting inputs, unknown models, bad n, stop strings and
logprobs, while greedy witness streams run beside them; no call may end
UNKNOWN, INTERNAL or hang, INVALID_ARGUMENT names the field, the witnesses
stay token-identical to plain greedy decoding and the scheduler ends idle.
"""

from __future__ import annotations

import asyncio
import collections
import math
import re

import grpc
import httpx
import pytest
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.e2e_helpers import GreedyReference, served_model_name, tiny_stack, wait_until_idle
from tests.protos.test_fuzz_contract import WITNESS_PROMPTS, WITNESS_TOKENS, Witnesses

pytestmark = pytest.mark.e2e

PROMPT = "The quick brown fox"
PROMPTS = ["def add(a, b):", "The quick brown fox", '{"name": "Ada", "age"']
MAX_TOKENS = 24
CALL_TIMEOUT_S = 60
SERVICE = "segserve.v1.Generation"


@pytest.fixture(scope="module")
def stack(tiny_gemma3_dir, tmp_path_factory):
    with tiny_stack(tiny_gemma3_dir, tmp_path_factory.mktemp("logs"), max_num_seqs=16) as stack:
        yield stack


@pytest.fixture(scope="module")
def model(stack) -> str:
    return served_model_name(stack)


def http_completion(stack, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=CALL_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


class ReflectedService:
    """A client of one service made from what the server's reflection says, with no generated code."""

    def __init__(self, channel: grpc.Channel, service_name: str) -> None:
        self.pool = DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        self.service = self.pool.FindServiceByName(service_name)
        self.channel = channel

    def message(self, method: str, fields: dict):
        """The method's request message, filled from `fields` (the proto's JSON mapping)."""
        request_class = message_factory.GetMessageClass(self.service.methods_by_name[method].input_type)
        return json_format.ParseDict(fields, request_class())

    def stream(self, method: str, request, timeout: float):
        descriptor = self.service.methods_by_name[method]
        assert descriptor.server_streaming and not descriptor.client_streaming
        response_class = message_factory.GetMessageClass(descriptor.output_type)
        call = self.channel.unary_stream(f"/{self.service.full_name}/{method}",
                                         request_serializer=type(request).SerializeToString,
                                         response_deserializer=response_class.FromString)
        return call(request, timeout=timeout)

    def enum_value(self, enum: str, name: str) -> int:
        return self.pool.FindEnumTypeByName(enum).values_by_name[name].number


def test_a_client_built_from_reflection_streams_the_greedy_text_of_v1_completions(stack):
    expected = http_completion(stack, PROMPT)
    with grpc.insecure_channel(stack.grpc_address) as channel:
        generation = ReflectedService(channel, SERVICE)
        request = generation.message("GenerateStream", {
            "prompt": PROMPT, "parameters": {"max_tokens": MAX_TOKENS, "temperature": 0}})
        assert request.DESCRIPTOR.file.pool is generation.pool  # not a generated class
        events = list(generation.stream("GenerateStream", request, timeout=CALL_TIMEOUT_S))
    assert "".join(event.text for event in events) == expected["choices"][0]["text"]
    assert len(events) >= 2
    token_ids = [t for event in events for t in event.token_ids]
    assert len(token_ids) == MAX_TOKENS
    # Every token came from one scheduler step: 1 + the draft tokens accepted in it.
    assert sum(n for event in events for n in event.step_num_tokens) == MAX_TOKENS
    for event in events:
        assert event.num_accepted_draft_tokens == sum(event.step_num_tokens) - len(event.step_num_tokens)
    length = generation.enum_value("segserve.v1.GenerationFinishReason", "GENERATION_FINISH_REASON_LENGTH")
    assert [e.finish_reason for e in events][-1] == length and not any(e.finish_reason for e in events[:-1])
    assert events[-1].usage.completion_tokens == MAX_TOKENS
    assert events[-1].usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert not any(e.HasField("usage") for e in events[:-1])


async def _one_stream(stub, pb, index: int) -> str:
    """Stream i: every third one is cancelled after its first event or runs past a short deadline; the
    others run to their end. Returns what happened."""
    prompt = PROMPTS[index // 3 % len(PROMPTS)]
    if index % 3:
        request = pb.GenerationRequest(prompt=prompt, parameters=pb.GenerationParameters(
            max_tokens=MAX_TOKENS, temperature=0))
        events = [event async for event in stub.GenerateStream(request, timeout=CALL_TIMEOUT_S)]
        assert events[-1].finish_reason == pb.GENERATION_FINISH_REASON_LENGTH
        return "".join(event.text for event in events)
    # sampled: a greedy loop of the tiny model is drafted right, and 400 tokens of it can beat the deadline
    long_request = pb.GenerationRequest(prompt=prompt, parameters=pb.GenerationParameters(
        max_tokens=400, temperature=1.0, seed=index, ignore_eos=True))
    if index % 6 == 0:
        call = stub.GenerateStream(long_request, timeout=CALL_TIMEOUT_S)
        await call.read()
        call.cancel()
        return "cancelled"
    try:
        async for _ in stub.GenerateStream(long_request, timeout=1.0):
            pass
    except grpc.aio.AioRpcError as exc:
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return "deadline"
    return "finished before its deadline"


def test_64_streams_a_third_cancelled_or_past_their_deadline_leave_nothing_behind(stack):
    from protos.segserve.v1 import generation_pb2 as pb
    from protos.segserve.v1 import generation_pb2_grpc

    async def run() -> list[str]:
        async with grpc.aio.insecure_channel(stack.grpc_address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            return await asyncio.gather(*(_one_stream(stub, pb, index) for index in range(64)))

    outcomes = asyncio.run(run())
    cut = [outcome for index, outcome in enumerate(outcomes) if index % 3 == 0]
    assert cut.count("cancelled") == 11 and cut.count("deadline") + cut.count("finished before its deadline") == 11
    assert cut.count("deadline") >= 1
    # Greedy streams of one prompt, batched with whatever ran beside them, all got the same text.
    texts: dict[str, set[str]] = {prompt: set() for prompt in PROMPTS}
    for index, outcome in enumerate(outcomes):
        if index % 3:
            texts[PROMPTS[index // 3 % len(PROMPTS)]].add(outcome)
    assert all(len(found) == 1 for found in texts.values()), texts
    stats = wait_until_idle(stack, timeout_s=10.0)
    assert (stats.num_running, stats.num_waiting, stats.num_used_kv_blocks) == (0, 0, 0)


def test_generate_n_choices_and_stop_strings_match_the_http_api(stack, model):
    from protos.segserve.v1 import generation_pb2 as pb
    from protos.segserve.v1 import generation_pb2_grpc

    reference = http_completion(stack, PROMPT)["choices"][0]["text"]
    stop = next(reference[i:i + 2] for i in range(3, len(reference) - 2) if reference[i:i + 2].strip())
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        answer = stub.Generate(pb.GenerationRequest(model=model, prompt=PROMPT, request_id="req-1",
                                                    parameters=pb.GenerationParameters(
                                                        max_tokens=MAX_TOKENS, temperature=0, n=2, logprobs=2,
                                                        details=True)), timeout=CALL_TIMEOUT_S)
        cut = stub.Generate(pb.GenerationRequest(prompt=PROMPT, parameters=pb.GenerationParameters(
            max_tokens=MAX_TOKENS, temperature=0, stop=[stop])), timeout=CALL_TIMEOUT_S)
    assert answer.id == "req-1" and answer.model == model
    assert [c.text for c in answer.choices] == [reference, reference]
    assert answer.usage.completion_tokens == 2 * MAX_TOKENS
    for choice in answer.choices:
        assert choice.finish_reason == pb.GENERATION_FINISH_REASON_LENGTH
        assert len(choice.logprobs) == MAX_TOKENS == sum(choice.step_num_tokens) == len(choice.token_ids)
        for logprob in choice.logprobs:
            assert len(logprob.top) == 2 and logprob.logprob == pytest.approx(logprob.top[0].logprob, abs=1e-5)
        assert choice.details.generated_tokens == MAX_TOKENS and choice.details.first_token_cost_ms > 0
        assert choice.details.batch_size >= 1 and choice.details.queue_wait_us > 0
    assert cut.choices[0].text == reference[:reference.index(stop)]
    assert cut.choices[0].finish_reason == pb.GENERATION_FINISH_REASON_STOP


def test_tokenize_detokenize_and_list_models(stack, model, tiny_gemma3_dir):
    from transformers import AutoTokenizer

    from protos.segserve.v1 import generation_pb2 as pb
    from protos.segserve.v1 import generation_pb2_grpc

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_gemma3_dir))
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        tokens = stub.Tokenize(pb.TokenizeRequest(text=PROMPT), timeout=CALL_TIMEOUT_S)
        chat = stub.Tokenize(pb.TokenizeRequest(messages=[pb.ChatMessage(role="user", content="Hi")]),
                             timeout=CALL_TIMEOUT_S)
        text = stub.Detokenize(pb.DetokenizeRequest(token_ids=tokens.token_ids, skip_special_tokens=True),
                               timeout=CALL_TIMEOUT_S)
        models = stub.ListModels(pb.ListModelsRequest(), timeout=CALL_TIMEOUT_S)
    assert list(tokens.token_ids) == tokenizer(PROMPT).input_ids
    assert len(tokens.tokens) == len(tokens.token_ids) and tokens.max_model_len == models.models[0].max_model_len
    template = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                             tokenize=False)
    assert list(chat.token_ids) == tokenizer(template, add_special_tokens=False).input_ids
    assert text.text == PROMPT
    assert [card.id for card in models.models] == [model]
    assert models.models[0].vocab_size == len(tokenizer)


def test_metrics_count_grpc_requests_under_their_protocol(stack):
    from protos.segserve.v1 import generation_pb2 as pb
    from protos.segserve.v1 import generation_pb2_grpc

    http_completion(stack, PROMPT, max_tokens=2)
    with grpc.insecure_channel(stack.grpc_address) as channel:
        generation_pb2_grpc.GenerationStub(channel).Generate(pb.GenerationRequest(
            prompt=PROMPT, parameters=pb.GenerationParameters(max_tokens=2)), timeout=CALL_TIMEOUT_S)
    text = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
    grpc_ttft = re.search(r'^vllm:time_to_first_token_seconds_count\{[^}]*protocol="grpc"[^}]*\} (\S+)$', text,
                          re.MULTILINE)
    http_ttft = re.search(r'^vllm:time_to_first_token_seconds_count\{[^}]*protocol="http"[^}]*\} (\S+)$', text,
                          re.MULTILINE)
    assert grpc_ttft is not None and float(grpc_ttft.group(1)) >= 1
    assert http_ttft is not None and float(http_ttft.group(1)) >= 1


# --- fuzz: hostile values at every RPC while greedy requests run beside them ------------------------------------

HOSTILE_DOUBLES = [math.inf, -math.inf, math.nan, 1e39, -1e39, 1e308, -1.0, 0.0, 1e-300, 0.5, 1.0, 2.5]
HOSTILE_UINT32 = [0, 1, 2, 20, 21, 400, 2**31, 2**32 - 1]
HOSTILE_UINT64 = [0, 1, 7, 2**63, 2**64 - 1]
LONG_PROMPT = "word " * 2000  # past the tiny model's 512-token context
OVERSIZED_PROMPT = "x " * (3 * 2**20)  # past the 4 MiB message limit
FUZZ_EXAMPLES = 60


def _parameters() -> st.SearchStrategy:
    doubles, uint32s = st.sampled_from(HOSTILE_DOUBLES), st.sampled_from(HOSTILE_UINT32)
    fields = {
        "max_tokens": st.sampled_from([1, 4, 0, 10**6, 2**32 - 1]), "do_sample": st.booleans(),
        "temperature": doubles, "top_k": uint32s, "top_p": doubles, "typical_p": doubles,
        "repetition_penalty": doubles, "frequency_penalty": doubles, "presence_penalty": doubles,
        "seed": st.sampled_from(HOSTILE_UINT64),
        "stop": st.lists(st.sampled_from(["", "\n", "e", "🙂", "x" * 10_000]), max_size=6),
        "stop_token_ids": st.lists(st.sampled_from([0, 1, 2**32 - 1]), max_size=3) | st.just([1] * 65),
        "ignore_eos": st.booleans(), "n": st.sampled_from([0, 1, 2, 16, 17, 2**32 - 1]),
        "logprobs": uint32s, "prompt_logprobs": uint32s,
        "logit_bias": st.dictionaries(st.sampled_from([0, 5, 399, 400, 2**32 - 1]), doubles, max_size=2),
        "watermark": st.booleans(), "details": st.booleans(),
    }
    return st.fixed_dictionaries({}, optional=fields)


def _messages() -> st.SearchStrategy:
    return st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "assistant", "system", "tool", "robot", ""]),
        "content": st.sampled_from(["Hi", "", "x" * 2000, "🙂"])}), max_size=3)


@st.composite
def generation_requests(draw, model: str) -> dict:
    """The fields of a GenerationRequest: hostile, absent or valid, in any combination."""
    request = {"model": draw(st.sampled_from([model, "", "nope", "x" * 1000])),
               "parameters": draw(_parameters()),
               "request_id": draw(st.sampled_from(["", "fuzz-1", "x" * 1000])),
               "session_id": draw(st.sampled_from(["", "s-fuzz"]))}
    kind = draw(st.sampled_from(["prompt", "messages", "both", "neither"]))
    if kind in ("prompt", "both"):
        request["prompt"] = draw(st.sampled_from(["Hello", "", "\x00", "🙂" * 5, LONG_PROMPT, OVERSIZED_PROMPT]))
    if kind in ("messages", "both"):
        request["messages"] = draw(_messages())
    return request


def test_hostile_requests_never_end_unknown_or_internal_nor_disturb_co_batched_requests(
        stack, model, tiny_gemma3_dir):
    from protos.segserve.v1 import generation_pb2 as pb
    from protos.segserve.v1 import generation_pb2_grpc

    reference = GreedyReference(tiny_gemma3_dir)
    witness_texts = {prompt: reference.completion(prompt, WITNESS_TOKENS) for prompt in WITNESS_PROMPTS}
    failures: list[str] = []
    outcomes: collections.Counter[str] = collections.Counter()

    def call(rpc, request, is_stream: bool = False) -> None:
        try:
            if is_stream:
                for _ in rpc(request, timeout=CALL_TIMEOUT_S):
                    pass
            else:
                rpc(request, timeout=CALL_TIMEOUT_S)
            outcomes["OK"] += 1
        except grpc.RpcError as exc:
            code, trailers = exc.code(), dict(exc.trailing_metadata() or ())
            outcomes[code.name] += 1
            if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED):
                failures.append(f"{str(request)[:300]} -> {code.name}: {exc.details()}")
            elif code is grpc.StatusCode.INVALID_ARGUMENT and not (exc.details() and trailers.get("invalid-field")):
                failures.append(f"{str(request)[:300]} -> INVALID_ARGUMENT without naming the field")

    with Witnesses(stack.base_url, model, witness_texts) as witnesses, \
            grpc.insecure_channel(stack.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(generation_requests(model), st.booleans())
        def fuzz_generate(fields: dict, is_stream: bool):
            request = pb.GenerationRequest(**{**fields, "parameters": pb.GenerationParameters(**fields["parameters"]),
                                              "messages": [pb.ChatMessage(**m) for m in fields.get("messages", [])]})
            call(stub.GenerateStream if is_stream else stub.Generate, request, is_stream)

        @settings(max_examples=FUZZ_EXAMPLES // 2, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.sampled_from([model, "", "nope"]), st.sampled_from(["", "Hello", OVERSIZED_PROMPT]), _messages(),
               st.lists(st.sampled_from([0, 1, 399, 400, 2**32 - 1]), max_size=4), st.booleans())
        def fuzz_tokens(model_name: str, text: str, messages: list[dict], token_ids: list[int], skip: bool):
            chat = [pb.ChatMessage(**m) for m in messages]
            call(stub.Tokenize, pb.TokenizeRequest(model=model_name, text=text, messages=chat))
            call(stub.Detokenize, pb.DetokenizeRequest(model=model_name, token_ids=token_ids, skip_special_tokens=skip))

        fuzz_generate()
        fuzz_tokens()
    assert not failures, "\n".join(failures[:10])
    # The draw reaches both sides: admitted requests (batched with the witnesses) and every kind of refusal.
    assert outcomes["OK"] >= 10 and outcomes["INVALID_ARGUMENT"] >= 10, outcomes
    assert outcomes["NOT_FOUND"] and outcomes["RESOURCE_EXHAUSTED"], outcomes
    assert witnesses.num_done >= len(WITNESS_PROMPTS), "the witnesses never finished a round"
    assert not witnesses.wrong, witnesses.wrong[:3]
    stats = wait_until_idle(stack, timeout_s=10.0)
    assert (stats.num_running, stats.num_waiting, stats.num_used_kv_blocks) == (0, 0, 0)
