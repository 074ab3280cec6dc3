"""segserve.client: the Python client of the public gRPC API, blocking and asyncio.

Two tiers. First, against an in-process scripted Generation server (no model): the retry policy (UNAVAILABLE
and RESOURCE_EXHAUSTED retried with backoff, the server's retry-after-ms honoured, a stream retried only before
its first event, a deadline bounding the retries), how failures become SegserveError, the API key's metadata,
and TLS (server-verified and mutual) through grpc's credentials. Then, against a real tiny stack (worker,
drafter, scheduler and router processes) served with an API key: generate and stream give the greedy text
/v1/completions gives, with typed token ids, finish reasons, usage, logprobs and details; tokenize,
detokenize and list_models; a missing or wrong key, an invalid parameter (its field named), an unknown model
and a deadline each raise SegserveError with their status, and leave the scheduler idle.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
import time
from concurrent import futures

import grpc
import httpx
import pytest

from protos.segserve.v1 import generation_pb2 as pb
from protos.segserve.v1 import generation_pb2_grpc
from segserve.client import (
    AsyncClient,
    Client,
    GenerationResult,
    RetryPolicy,
    SegserveError,
    StreamEvent,
    TokenLogprob,
    Usage,
)
from segserve.client.base import generation_parameters
from segserve.client.results import finish_reason_of
from common.tls import TlsFiles, add_port
from tests.support.certs import CertificateAuthority
from tests.support.e2e_helpers import GreedyReference, tiny_stack, wait_until_idle
from tests.e2e.test_http import stop_string_in

pytestmark = pytest.mark.timeout(180)

UNAVAILABLE, EXHAUSTED = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED
FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05, jitter=0.0)


# --- pure parts ---------------------------------------------------------------------------------------------


def test_backoff_grows_exponentially_up_to_its_cap_with_jitter_below_it():
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=0.5, multiplier=2.0, jitter=0.5)
    assert [policy.delay_s(k, None, 0.0) for k in (1, 2, 3, 4, 5)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert policy.delay_s(2, None, 0.999) == pytest.approx(0.2 * (1 - 0.5 * 0.999))
    draws = [policy.delay_s(3, None, random.random()) for _ in range(200)]
    assert all(0.2 <= delay <= 0.4 for delay in draws) and max(draws) - min(draws) > 0.05


def test_the_servers_retry_delay_is_honoured_never_shortened():
    policy = RetryPolicy(jitter=0.5, max_backoff_s=1.0)
    assert policy.delay_s(1, 2.0, 0.0) == 2.0  # past max_backoff_s: the server's word wins
    assert policy.delay_s(3, 2.0, 0.999) == pytest.approx(2.0 * (1 + 0.5 * 0.999))


def test_which_failures_are_retried_and_when_to_give_up():
    policy = RetryPolicy(max_attempts=3, jitter=0.0, initial_backoff_s=0.1)
    rng = random.Random(0)
    assert policy.next_delay_s(SegserveError("UNAVAILABLE", "down"), 1, None, rng) == pytest.approx(0.1)
    assert policy.next_delay_s(SegserveError("RESOURCE_EXHAUSTED", "full", retry_after_s=1.5), 2, None,
                               rng) == pytest.approx(1.5)
    assert policy.next_delay_s(SegserveError("UNAVAILABLE", "down"), 3, None, rng) is None  # no attempt left
    for code in ("INVALID_ARGUMENT", "UNAUTHENTICATED", "NOT_FOUND", "DEADLINE_EXCEEDED", "INTERNAL"):
        assert policy.next_delay_s(SegserveError(code, "x"), 1, None, rng) is None
    full = SegserveError("RESOURCE_EXHAUSTED", "full", retry_after_s=1.0)
    assert policy.next_delay_s(full, 1, 0.5, rng) is None  # the wait would end past the deadline
    assert policy.next_delay_s(full, 1, 1.5, rng) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError):
        RetryPolicy(jitter=1.5)


def test_parameters_are_the_protos_fields_and_bad_values_name_theirs():
    message = generation_parameters({"max_tokens": 8, "temperature": 0, "stop": ["\n"], "logit_bias": {5: -100},
                                     "logprobs": 0, "top_p": None})
    assert message.max_tokens == 8 and message.HasField("temperature") and message.temperature == 0
    assert list(message.stop) == ["\n"] and dict(message.logit_bias) == {5: -100.0}
    assert message.HasField("logprobs") and not message.HasField("top_p")  # None = absent: the server's default
    with pytest.raises(SegserveError) as caught:
        generation_parameters({"max_tokens": -1})
    assert caught.value.code == "INVALID_ARGUMENT" and caught.value.field == "parameters.max_tokens"
    with pytest.raises(SegserveError, match="parameters.temperature"):
        generation_parameters({"temperature": "hot"})
    with pytest.raises(TypeError, match="max_new_tokens"):
        generation_parameters({"max_new_tokens": 8})


def test_a_structured_output_is_one_keyword_and_bad_ones_name_their_field():
    class Answer:  # a pydantic model class, as the client sees one: it has model_json_schema()
        @classmethod
        def model_json_schema(cls) -> dict:
            return {"type": "object", "properties": {"ok": {"type": "boolean"}}}

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    for value in (schema, json.dumps(schema), Answer):
        sent = generation_parameters({"json_schema": value, "max_tokens": 8}).structured_output.json_schema
        assert json.loads(sent) == schema
    assert list(generation_parameters({"choice": ("yes", "no")}).structured_output.choice.choices) == ["yes", "no"]
    assert generation_parameters({"regex": "a+", "grammar": None, "json_object": False}).structured_output.regex \
        == "a+"  # None and False are "not this one"
    assert generation_parameters({"json_object": True}).structured_output.WhichOneof("kind") == "json_object"
    assert not generation_parameters({"max_tokens": 8}).HasField("structured_output")
    for parameters, field in [
        ({"regex": "a", "choice": ["a"]}, "parameters.structured_output"),
        ({"regex": "a", "structured_output": {"grammar": 'root ::= "a"'}}, "parameters.structured_output"),
        ({"choice": "yes"}, "parameters.structured_output.choice"),
        ({"choice": [1, 2]}, "parameters.structured_output.choice"),
        ({"json_schema": 42}, "parameters.structured_output.json_schema"),
        ({"json_schema": {"default": object()}}, "parameters.structured_output.json_schema"),
        ({"grammar": 3}, "parameters.structured_output.grammar"),
    ]:
        with pytest.raises(SegserveError) as caught:
            generation_parameters(parameters)
        assert (caught.value.code, caught.value.field, caught.value.num_attempts) == ("INVALID_ARGUMENT", field, 0)


def test_finish_reasons_are_short_names():
    assert finish_reason_of(pb.GENERATION_FINISH_REASON_UNSPECIFIED) is None
    assert [finish_reason_of(value) for value in (1, 2, 3, 4)] == ["eos_token", "length", "stop", "error"]
    assert finish_reason_of(99) == "99"


# --- a scripted server ---------------------------------------------------------------------------------------


class ScriptedGeneration(generation_pb2_grpc.GenerationServicer):
    """Answers every call after failing as `failures` says, one failure per call: (status, retry-after-ms or
    None). Streams send three events ("a", "b", "c"); with `fail_after_first_event` the first stream fails
    after its first event instead. Records each call's arrival time and metadata."""

    def __init__(self) -> None:
        self.failures: list[tuple[grpc.StatusCode, int | None]] = []
        self.fail_after_first_event = False
        self.calls: list[tuple[str, float, dict]] = []
        self._lock = threading.Lock()

    def _arrive(self, method: str, context) -> tuple[grpc.StatusCode, int | None] | None:
        with self._lock:
            self.calls.append((method, time.monotonic(), dict(context.invocation_metadata())))
            return self.failures.pop(0) if self.failures else None

    @staticmethod
    def _abort(context, failure) -> None:
        code, retry_after_ms = failure
        if retry_after_ms is not None:
            context.set_trailing_metadata((("retry-after-ms", str(retry_after_ms)),))
        context.abort(code, f"scripted {code.name}")

    def Generate(self, request, context):
        failure = self._arrive("Generate", context)
        if failure:
            self._abort(context, failure)
        return pb.GenerationResponse(id="r1", model="scripted", choices=[pb.GenerationChoice(
            text=request.prompt.upper(), token_ids=[1, 2], finish_reason=pb.GENERATION_FINISH_REASON_LENGTH)],
            usage=pb.GenerationUsage(prompt_tokens=3, completion_tokens=2))

    def GenerateStream(self, request, context):
        failure = self._arrive("GenerateStream", context)
        if failure and not self.fail_after_first_event:
            self._abort(context, failure)
        for index, text in enumerate("abc"):
            yield pb.GenerationStreamResponse(id="s1", text=text, token_ids=[index])
            if failure:
                self._abort(context, failure)
        yield pb.GenerationStreamResponse(id="s1", finish_reason=pb.GENERATION_FINISH_REASON_STOP,
                                          usage=pb.GenerationUsage(prompt_tokens=3, completion_tokens=3))

    def ListModels(self, request, context):
        failure = self._arrive("ListModels", context)
        if failure:
            self._abort(context, failure)
        return pb.ListModelsResponse(models=[pb.ModelCard(id="scripted", max_model_len=64, vocab_size=100)])


def _start_scripted(tls: TlsFiles | None = None) -> tuple[grpc.Server, ScriptedGeneration, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    servicer = ScriptedGeneration()
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    port = add_port(server, "127.0.0.1:0" if tls is None else "localhost:0", tls)
    server.start()
    return server, servicer, port


@pytest.fixture
def scripted():
    server, servicer, port = _start_scripted()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(grace=None)


def _gaps(calls) -> list[float]:
    return [later[1] - earlier[1] for earlier, later in zip(calls, calls[1:])]


def test_unary_retries_honour_the_servers_retry_after(scripted):
    servicer, target = scripted
    servicer.failures = [(EXHAUSTED, 120), (UNAVAILABLE, None), (EXHAUSTED, 80)]
    with Client(target, retry=FAST_RETRY, api_key="sk-1", metadata=[("x-client-id", "billing")]) as client:
        result = client.generate("abc", max_tokens=2)
    assert isinstance(result, GenerationResult) and result.text == "ABC" and result.token_ids == (1, 2)
    assert result.finish_reason == "length" and result.usage == Usage(3, 2, 0)
    assert len(servicer.calls) == 4
    gaps = _gaps(servicer.calls)
    assert gaps[0] >= 0.12 and gaps[1] >= 0.01 and gaps[2] >= 0.08  # never sooner than the server asked
    for _, _, metadata in servicer.calls:
        assert metadata["authorization"] == "Bearer sk-1" and metadata["x-client-id"] == "billing"


def test_retries_give_up_after_max_attempts_with_the_last_error(scripted):
    servicer, target = scripted
    servicer.failures = [(UNAVAILABLE, None)] * 3 + [(EXHAUSTED, 10)]
    with Client(target, retry=FAST_RETRY) as client, pytest.raises(SegserveError) as caught:
        client.list_models()
    error = caught.value
    assert error.code == "RESOURCE_EXHAUSTED" and error.status is EXHAUSTED and error.message == \
        "scripted RESOURCE_EXHAUSTED"
    assert error.retry_after_s == pytest.approx(0.01) and error.num_attempts == 4 and len(servicer.calls) == 4


def test_other_failures_are_not_retried(scripted):
    servicer, target = scripted
    servicer.failures = [(grpc.StatusCode.INVALID_ARGUMENT, None)]
    with Client(target, retry=FAST_RETRY) as client, pytest.raises(SegserveError) as caught:
        client.generate("abc")
    assert caught.value.code == "INVALID_ARGUMENT" and caught.value.num_attempts == 1 and len(servicer.calls) == 1


def test_a_deadline_bounds_the_retries(scripted):
    servicer, target = scripted
    servicer.failures = [(EXHAUSTED, 30_000)]  # asks for 30 s, the call has 2
    started = time.monotonic()
    with Client(target, retry=FAST_RETRY, timeout_s=2.0) as client, pytest.raises(SegserveError) as caught:
        client.generate("abc")
    assert caught.value.code == "RESOURCE_EXHAUSTED" and caught.value.retry_after_s == 30.0
    assert len(servicer.calls) == 1 and time.monotonic() - started < 2.0  # gave up at once, did not sleep


def test_a_stream_is_retried_only_before_its_first_event(scripted):
    servicer, target = scripted
    servicer.failures = [(UNAVAILABLE, None), (EXHAUSTED, 50)]
    with Client(target, retry=FAST_RETRY) as client:
        events = list(client.stream("abc"))
        assert all(isinstance(event, StreamEvent) for event in events)
        assert "".join(event.text for event in events) == "abc" and len(servicer.calls) == 3
        assert events[-1].finish_reason == "stop" and events[-1].usage == Usage(3, 3, 0)
        assert events[0].usage is None and events[0].finish_reason is None
        assert _gaps(servicer.calls)[1] >= 0.05

        servicer.calls.clear()
        servicer.failures, servicer.fail_after_first_event = [(UNAVAILABLE, None)], True
        received = []
        with pytest.raises(SegserveError) as caught:
            for event in client.stream("abc"):
                received.append(event.text)
    assert received == ["a"] and caught.value.code == "UNAVAILABLE" and len(servicer.calls) == 1


async def test_the_asyncio_client_retries_alike(scripted):
    servicer, target = scripted
    async with AsyncClient(target, retry=FAST_RETRY) as client:
        servicer.failures = [(EXHAUSTED, 60), (UNAVAILABLE, None)]
        result = await client.generate("xyz")
        servicer.failures = [(EXHAUSTED, 60), (UNAVAILABLE, None)]
        events = [event async for event in client.stream("abc")]
        servicer.failures = [(UNAVAILABLE, None)]
        (card,) = await client.list_models()
        servicer.failures, servicer.fail_after_first_event = [(UNAVAILABLE, None)], True
        received = []
        with pytest.raises(SegserveError) as caught:
            async for event in client.stream("abc"):
                received.append(event.text)
    assert result.text == "XYZ" and "".join(event.text for event in events) == "abc" and card.id == "scripted"
    methods = ["Generate"] * 3 + ["GenerateStream"] * 3 + ["ListModels"] * 2 + ["GenerateStream"]
    assert [call[0] for call in servicer.calls] == methods
    assert _gaps(servicer.calls[:3])[0] >= 0.06 and _gaps(servicer.calls[3:6])[0] >= 0.06
    assert received == ["a"] and caught.value.code == "UNAVAILABLE" and len(servicer.calls) == 9


def test_an_unreachable_server_is_unavailable_after_the_retries():
    with Client("127.0.0.1:1", retry=FAST_RETRY, timeout_s=10) as client, pytest.raises(SegserveError) as caught:
        client.list_models()
    assert caught.value.code == "UNAVAILABLE" and caught.value.num_attempts == 4


def test_tls_verifies_the_server_and_presents_a_client_certificate(tmp_path):
    ca, other = CertificateAuthority(tmp_path), CertificateAuthority(tmp_path, "other-ca")
    server_cert, client_cert = ca.issue("server"), ca.issue("client", is_server=False)
    no_retry = RetryPolicy(max_attempts=1)
    server, servicer, port = _start_scripted(TlsFiles(server_cert.cert_file, server_cert.key_file))
    try:
        with Client(f"localhost:{port}", ca_file=ca.ca_file) as client:
            assert client.is_tls and client.list_models()[0].id == "scripted"
        with Client(f"localhost:{port}", ca_file=other.ca_file, retry=no_retry, timeout_s=10) as client, \
                pytest.raises(SegserveError) as caught:
            client.list_models()  # a server another CA signed is refused
        assert caught.value.code == "UNAVAILABLE"
        with Client(f"localhost:{port}", retry=no_retry, timeout_s=10) as client, pytest.raises(SegserveError):
            client.list_models()  # plaintext to a TLS port
    finally:
        server.stop(grace=None)
    mutual = TlsFiles(server_cert.cert_file, server_cert.key_file, ca.ca_file)
    server, servicer, port = _start_scripted(mutual)
    try:
        with Client(f"localhost:{port}", ca_file=ca.ca_file, cert_file=client_cert.cert_file,
                    key_file=client_cert.key_file) as client:
            assert client.list_models()[0].id == "scripted"
        with Client(f"localhost:{port}", ca_file=ca.ca_file, retry=no_retry, timeout_s=10) as client, \
                pytest.raises(SegserveError) as caught:
            client.list_models()  # no client certificate
        assert caught.value.code == "UNAVAILABLE"
    finally:
        server.stop(grace=None)
    with pytest.raises(ValueError, match="missing.pem"):
        Client("localhost:1", ca_file=str(tmp_path / "missing.pem"))


# --- a real tiny stack ---------------------------------------------------------------------------------------

KEY = "sk-client-test"
PROMPT = "The quick brown fox"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def stack(tiny_gemma3_dir, tmp_path_factory):
    stack = tiny_stack(tiny_gemma3_dir, tmp_path_factory.mktemp("logs"), max_num_seqs=8)
    stack.config.router = dataclasses.replace(stack.config.router, api_keys=[KEY])
    with stack:
        yield stack


@pytest.fixture(scope="module")
def reference(tiny_gemma3_dir):
    return GreedyReference(tiny_gemma3_dir)


@pytest.fixture
def client(stack):
    with Client(stack.grpc_address, api_key=KEY, timeout_s=60) as client:
        yield client


def _http_completion(stack, **body) -> dict:
    response = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.e2e
def test_generate_and_stream_give_the_greedy_text(stack, client, reference):
    expected = reference.completion(PROMPT, MAX_TOKENS)
    result = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert result.text == expected
    result = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    assert len(result.token_ids) == MAX_TOKENS and result.finish_reason == "length"
    assert result.usage.completion_tokens == MAX_TOKENS and result.usage.prompt_tokens == len(
        client.tokenize(PROMPT).token_ids)
    assert sum(result.choices[0].step_num_tokens) == MAX_TOKENS and result.model == client.list_models()[0].id
    assert result.logprobs == () and result.details is None  # not asked for

    assert "".join(event.text for event in client.stream(PROMPT, max_tokens=MAX_TOKENS, temperature=0)) == expected
    events = list(client.stream(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    assert tuple(t for event in events for t in event.token_ids) == result.token_ids
    assert [event.finish_reason for event in events][-1] == "length" and not any(e.finish_reason for e in events[:-1])
    assert events[-1].usage == result.usage and all(event.usage is None for event in events[:-1])
    for event in events:
        assert event.num_accepted_draft_tokens == sum(event.step_num_tokens) - len(event.step_num_tokens)


@pytest.mark.e2e
def test_logprobs_details_n_and_stop_strings(stack, client):
    result = client.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, details=True)
    assert len(result.logprobs) == 6 and all(isinstance(lp, TokenLogprob) for lp in result.logprobs)
    assert [lp.token_id for lp in result.logprobs] == list(result.token_ids)
    assert all(len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob for lp in result.logprobs)
    assert result.details.generated_tokens == 6 and result.details.batch_size >= 1
    assert result.details.first_token_cost_ms > 0

    sampled = client.generate(PROMPT, max_tokens=4, n=3, temperature=1.0, seed=7, ignore_eos=True)
    assert [choice.index for choice in sampled.choices] == [0, 1, 2] and sampled.usage.completion_tokens == 12
    greedy = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True).text
    stop = stop_string_in(greedy)
    stopped = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stop=[stop])
    assert stopped.finish_reason == "stop" and stopped.text == greedy[:greedy.index(stop)]


@pytest.mark.e2e
def test_chat_tokenize_detokenize_and_list_models(stack, client, tiny_gemma3_dir):
    (card,) = client.list_models()
    assert card.owned_by == "segserve" and card.max_model_len > 0 and card.vocab_size > 0
    tokens = client.tokenize(PROMPT)
    assert len(tokens.token_ids) == len(tokens.tokens) and tokens.max_model_len == card.max_model_len
    assert client.detokenize(tokens.token_ids, skip_special_tokens=True) == PROMPT
    chat = [{"role": "user", "content": PROMPT}]
    chat_tokens = client.tokenize(messages=chat)
    assert len(chat_tokens.token_ids) > len(tokens.token_ids)
    reply = client.generate(messages=chat, max_tokens=4, temperature=0, ignore_eos=True)
    assert reply.usage.prompt_tokens == len(chat_tokens.token_ids) and len(reply.token_ids) == 4


@pytest.mark.e2e
def test_the_api_key_is_required(stack):
    for settings in ({}, {"api_key": "sk-wrong"}):
        with Client(stack.grpc_address, timeout_s=30, **settings) as client:
            for call in (client.list_models, lambda: client.generate(PROMPT), lambda: list(client.stream(PROMPT))):
                with pytest.raises(SegserveError) as caught:
                    call()
                assert caught.value.code == "UNAUTHENTICATED" and caught.value.num_attempts == 1


@pytest.mark.e2e
def test_errors_are_typed_and_name_the_field(stack, client):
    with pytest.raises(SegserveError) as caught:
        client.generate(PROMPT, top_p=1.5)
    assert caught.value.code == "INVALID_ARGUMENT" and caught.value.field == "parameters.top_p"
    assert "parameters.top_p" in caught.value.message and caught.value.status is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(SegserveError) as caught:
        list(client.stream(PROMPT, max_tokens=10**6))
    assert caught.value.code == "INVALID_ARGUMENT" and caught.value.field == "parameters.max_tokens"
    with pytest.raises(SegserveError) as caught:
        client.generate(PROMPT, model="no-such-model")
    assert caught.value.code == "NOT_FOUND"
    with pytest.raises(SegserveError) as caught:
        client.detokenize([10**9])
    assert caught.value.code == "INVALID_ARGUMENT" and caught.value.field == "token_ids"


@pytest.mark.e2e
def test_a_deadline_ends_the_call_and_its_request(stack, client):
    # sampled, not greedy: a greedy loop of the tiny model is drafted right. A warm tiny stack can finish 400
    # tokens inside any fixed deadline, so the deadline is a quarter of what the whole request takes here. Each
    # call has a seed of its own: the drafter learns a finished output, and a seeded repeat of it drafts whole.
    params = dict(max_tokens=400, temperature=1.0, seed=3, ignore_eos=True)
    started = time.monotonic()
    assert len(client.generate(PROMPT, **params).token_ids) == 400
    params["timeout_s"] = (time.monotonic() - started) / 4
    started = time.monotonic()
    with pytest.raises(SegserveError) as caught:
        list(client.stream(PROMPT, **{**params, "seed": 4}))
    assert caught.value.code == "DEADLINE_EXCEEDED" and time.monotonic() - started < 30
    with pytest.raises(SegserveError) as caught:
        client.generate(PROMPT, **{**params, "seed": 5})
    assert caught.value.code == "DEADLINE_EXCEEDED"
    stats = wait_until_idle(stack, timeout_s=10)
    assert (stats.num_running, stats.num_waiting, stats.num_used_kv_blocks) == (0, 0, 0)


@pytest.mark.e2e
def test_the_asyncio_client_on_the_stack(stack, reference):
    expected = reference.completion(PROMPT, MAX_TOKENS)

    async def run():
        async with AsyncClient(stack.grpc_address, api_key=KEY, timeout_s=60) as client:
            params = dict(max_tokens=MAX_TOKENS, temperature=0)
            results = await asyncio.gather(*(client.generate(PROMPT, **params) for _ in range(4)))
            streamed = [event.text async for event in client.stream(PROMPT, **params)]
            tokens = await client.tokenize(PROMPT)
            text = await client.detokenize(tokens.token_ids, skip_special_tokens=True)
            (card,) = await client.list_models()
            async for event in client.stream(PROMPT, max_tokens=200, temperature=0, ignore_eos=True):
                break  # leaving the loop cancels the request
            with pytest.raises(SegserveError) as caught:
                await client.generate(PROMPT, top_k=-1)
            return results, streamed, text, card, caught.value

    results, streamed, text, card, error = asyncio.run(run())
    assert [result.text for result in results] == [expected] * 4 and "".join(streamed) == expected
    assert text == PROMPT and card.vocab_size > 0
    assert error.code == "INVALID_ARGUMENT" and error.field == "parameters.top_k" and error.num_attempts == 0
    stats = wait_until_idle(stack, timeout_s=10)
    assert (stats.num_running, stats.num_waiting, stats.num_used_kv_blocks) == (0, 0, 0)


@pytest.mark.e2e
def test_the_http_and_grpc_apis_agree(stack, client):
    http = _http_completion(stack, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    result = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    assert result.text == http["choices"][0]["text"] and result.usage.prompt_tokens == http["usage"]["prompt_tokens"]
