"""Fuzz every entrance of a real stack with hostile values while good requests run beside them.

A real tiny-model stack (worker, drafter, scheduler, router) serves greedy
"witness" streams in a loop while hypothesis throws bodies at /v1/completions,
/v1/chat/completions and /v2 generate[_stream], and GenerateRequests straight at
the scheduler's gRPC port. Values are drawn from what breaks naive checks:
Infinity, -Infinity and NaN (Python's json reads those tokens), 1e39 (finite as a
double, infinite as a float32), huge integers, wrong types and empty strings.

Must hold: no HTTP answer is a 5xx and no gRPC call ends INTERNAL or UNKNOWN
(bad input is a 4xx or INVALID_ARGUMENT naming the field); every stream ends,
bounded in time; every witness, co-batched with whatever the fuzz got admitted,
is token-identical to plain greedy decoding; and the scheduler is idle at the end.
"""

from __future__ import annotations

import json
import math
import threading

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.segserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.support.e2e_helpers import GreedyReference, served_model_name, tiny_stack, wait_until_idle

pytestmark = pytest.mark.e2e

CALL_TIMEOUT_S = 60
MAX_EXAMPLES = 60
WITNESS_PROMPTS = ["def add(a, b):", "The quick brown fox", '{"name": "Ada", "age"']
WITNESS_TOKENS = 24

HOSTILE_NUMBERS = [math.inf, -math.inf, math.nan, 1e39, -1e39, 10**30, -(10**30), 2**64, 2**32, -1, 0, 0.0,
                   1e-300]
HOSTILE_VALUES = HOSTILE_NUMBERS + ["", "1", [], {}, None, True, False, [1.5], {"a": math.nan}]
# Small valid values, so that some fuzzed requests are admitted and share batches with the witnesses.
VALID_VALUES = {
    "temperature": [0, 0.5, 1.0], "top_p": [0.5, 1.0], "top_k": [0, 5], "typical_p": [0.9],
    "repetition_penalty": [1.0, 1.3], "frequency_penalty": [0.5], "presence_penalty": [-0.5], "seed": [7],
    "max_tokens": [1, 4], "max_new_tokens": [1, 4], "max_completion_tokens": [3], "logprobs": [2],
    "top_logprobs": [2], "n": [1, 2], "stop": ["\n"], "logit_bias": [{"5": 10}], "echo": [True, False],
}
V1_FIELDS = ["temperature", "top_p", "top_k", "typical_p", "repetition_penalty", "frequency_penalty",
             "presence_penalty", "seed", "max_tokens", "logprobs", "n", "stop", "logit_bias", "echo"]
CHAT_FIELDS = [f for f in V1_FIELDS if f not in ("logprobs", "echo")] + ["max_completion_tokens", "top_logprobs"]
V2_FIELDS = ["temperature", "top_p", "top_k", "typical_p", "repetition_penalty", "seed", "max_new_tokens",
             "do_sample", "details", "watermark", "batch_size"]


def values_for(field: str) -> st.SearchStrategy:
    return st.sampled_from(HOSTILE_VALUES + VALID_VALUES.get(field, []))


def body_strategy(fields: list[str]) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({}, optional={field: values_for(field) for field in fields})


@st.composite
def http_requests(draw, model: str) -> tuple[str, dict]:
    kind = draw(st.sampled_from(["completion", "chat", "v2"]))
    stream = draw(st.booleans())
    prompt = draw(st.sampled_from(["Hello", "", "x" * 3, None, 5, ["a"], [1, 2, 3], [[]]]))
    if kind == "completion":
        return "/v1/completions", {"model": model, "prompt": prompt, "stream": stream,
                                   **draw(body_strategy(V1_FIELDS))}
    if kind == "chat":
        content = prompt if isinstance(prompt, str) or prompt is None else str(prompt)
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": content}],
                                        "stream": stream, **draw(body_strategy(CHAT_FIELDS))}
    suffix = "generate_stream" if stream else "generate"
    body = {"text_input": prompt, "parameters": draw(body_strategy(V2_FIELDS))}
    if draw(st.booleans()):
        body["id"] = draw(st.sampled_from(["", "a1", 7]))
    return f"/v2/models/{model}/{suffix}", body


grpc_doubles = st.sampled_from([math.inf, -math.inf, math.nan, 1e39, -1.0, 0.0, 0.5, 1.0, 2.5])
grpc_requests = st.builds(
    lambda request_id, prompt, temperature, top_p, typical_p, repetition_penalty, penalty, top_k, logprobs, bias,
    max_tokens, stop_ids: scheduler_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(
            do_sample=True, temperature=temperature, top_p=top_p, typical_p=typical_p,
            repetition_penalty=repetition_penalty, frequency_penalty=penalty, presence_penalty=penalty,
            top_k=top_k, num_top_logprobs=logprobs, logit_bias=bias),
        stopping=common_pb2.StoppingCriteria(max_tokens=max_tokens, stop_token_ids=stop_ids)),
    st.sampled_from(["", "fuzz"]).flatmap(lambda p: st.uuids().map(lambda u: p and f"{p}-{u.hex}")),
    st.lists(st.integers(0, 2**32 - 1), max_size=4), grpc_doubles, grpc_doubles, grpc_doubles, grpc_doubles,
    grpc_doubles, st.sampled_from([0, 3, 2**31, 2**32 - 1]), st.sampled_from([0, 2, 21, 2**32 - 1]),
    st.dictionaries(st.sampled_from([1, 5, 2**32 - 1]), grpc_doubles, max_size=2),
    st.sampled_from([0, 1, 3, 2**32 - 1]), st.lists(st.sampled_from([1, 2**31]), max_size=2))


@pytest.fixture(scope="module")
def stack(tiny_gemma3_dir, tmp_path_factory):
    with tiny_stack(tiny_gemma3_dir, tmp_path_factory.mktemp("logs"), max_num_seqs=16) as stack:
        yield stack


@pytest.fixture(scope="module")
def model_name(stack) -> str:
    return served_model_name(stack)


@pytest.fixture(scope="module")
def witness_texts(tiny_gemma3_dir) -> dict[str, str]:
    reference = GreedyReference(tiny_gemma3_dir)
    return {prompt: reference.completion(prompt, WITNESS_TOKENS) for prompt in WITNESS_PROMPTS}


class Witnesses:
    """Greedy streams in a loop on a thread, each text compared with plain greedy decoding."""

    def __init__(self, base_url: str, model: str, expected: dict[str, str]) -> None:
        self.base_url, self.model, self.expected = base_url, model, expected
        self.num_done = 0
        self.wrong: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Witnesses:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=CALL_TIMEOUT_S)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=CALL_TIMEOUT_S) as client:
            while not self._stop.is_set():
                for prompt, expected in self.expected.items():
                    text = self._stream(client, prompt)
                    if text != expected:
                        self.wrong.append((prompt, text))
                    self.num_done += 1

    def _stream(self, client: httpx.Client, prompt: str) -> str:
        body = {"model": self.model, "prompt": prompt, "max_tokens": WITNESS_TOKENS, "temperature": 0,
                "stream": True}
        text = ""
        with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {response.read()!r}"
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    return text
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return f"error event: {event}"
                    text += "".join(choice["text"] for choice in event["choices"])
        return text + " <stream ended without [DONE]>"


def send(client: httpx.Client, path: str, body: dict) -> tuple[int, str]:
    """(status, whole body); raw JSON text so that Infinity and NaN go out as the tokens Python writes."""
    content = json.dumps(body, allow_nan=True)
    with client.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as response:
        return response.status_code, response.read().decode(errors="replace")


def test_hostile_values_never_fail_the_server_or_a_co_batched_request(stack, model_name, witness_texts):
    failures: list[str] = []
    with Witnesses(stack.base_url, model_name, witness_texts) as witnesses, \
            httpx.Client(base_url=stack.base_url, timeout=CALL_TIMEOUT_S) as client, \
            grpc.insecure_channel(stack.config.router.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)

        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(http_requests(model_name))
        def fuzz_http(request):
            path, body = request
            status, text = send(client, path, body)
            if status >= 500:
                failures.append(f"{path} {json.dumps(body, allow_nan=True)} -> {status} {text[:300]}")
            elif status >= 400:
                assert json.loads(text)["error"]["message"], text

        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(grpc_requests)
        def fuzz_grpc(request):
            try:
                for _ in stub.Generate(request, timeout=CALL_TIMEOUT_S):
                    pass
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    failures.append(f"gRPC {request} -> {exc.code().name}: {exc.details()}")
                elif not exc.details():
                    failures.append(f"gRPC {request} -> INVALID_ARGUMENT without a message")

        fuzz_http()
        fuzz_grpc()
    assert not failures, "\n".join(failures[:10])
    assert witnesses.num_done >= len(WITNESS_PROMPTS), "the witnesses never finished a round"
    assert not witnesses.wrong, witnesses.wrong[:3]
    stats = wait_until_idle(stack, timeout_s=10.0)
    assert (stats.num_running, stats.num_waiting, stats.num_used_kv_blocks) == (0, 0, 0)


def test_an_infinite_temperature_is_a_400_naming_the_field(stack, model_name):
    """The original report: `temperature: Infinity` gave a 500 and failed its whole batch."""
    with httpx.Client(base_url=stack.base_url, timeout=CALL_TIMEOUT_S) as client:
        for path, body, param in [
            ("/v1/completions", {"model": model_name, "prompt": "Hi", "temperature": math.inf}, "temperature"),
            ("/v1/completions", {"model": model_name, "prompt": "Hi", "repetition_penalty": math.inf},
             "repetition_penalty"),
            (f"/v2/models/{model_name}/generate", {"text_input": "Hi", "parameters": {"temperature": math.inf}},
             "parameters.temperature"),
        ]:
            status, text = send(client, path, body)
            assert status == 400, text
            error = json.loads(text)["error"]
            assert error["param"] == param and param.rsplit(".", 1)[-1] in error["message"], error
