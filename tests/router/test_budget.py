"""The output budget (max_tokens) at each API edge: OpenAI /v1, /v2 and the public gRPC API.

What the scheduler is sent: the request's own max tokens, else the API's default cut to the context the prompt
leaves. A requested budget the context cannot hold is a 400 `context_length_exceeded` naming the field in the
API's words, but only once the contract admits every value (its ranges come first). Through real HTTP and gRPC
against the fake scheduler, whose model has a context of CONTEXT tokens.
"""

from __future__ import annotations

import grpc
import httpx
import pytest
from transformers import AutoTokenizer

from common.ports import free_port
from protos.segserve.v1 import generation_pb2 as pb
from protos.segserve.v1 import generation_pb2_grpc
from router.config import RouterConfig
from tests.support.fake_scheduler import start_fake_scheduler
from tests.support.router_server import serve_router_and_grpc

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-test"
CONTEXT = 64
DEFAULT_MAX_TOKENS = 200
"""The router's default_max_tokens, more than any prompt leaves of CONTEXT."""
V2_DEFAULT = 20
PROMPT = "a " * 50
"""Long enough that /v2's default of 20 does not fit either."""


@pytest.fixture(scope="module")
def tokenizer(tiny_gemma3_dir):
    return AutoTokenizer.from_pretrained(str(tiny_gemma3_dir))


@pytest.fixture(scope="module")
def scheduler(tokenizer):
    server, fake, port = start_fake_scheduler(tokenizer, model_name=MODEL, max_model_len=CONTEXT)
    fake.port = port
    yield fake
    server.stop(grace=None)


@pytest.fixture(scope="module")
def router(scheduler, tiny_gemma3_dir):
    """(HTTP base URL, gRPC stub)."""
    config = RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{scheduler.port}",
                          port=free_port(), grpc_port=0, scheduler_wait_s=10, default_max_tokens=DEFAULT_MAX_TOKENS)
    with serve_router_and_grpc(config) as (url, target), grpc.insecure_channel(target) as channel:
        yield url, generation_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def room(tokenizer) -> int:
    """What PROMPT leaves of the context (as /v1 completions and /v2 tokenize it)."""
    num_prompt_tokens = len(tokenizer(PROMPT).input_ids)
    assert CONTEXT - num_prompt_tokens < V2_DEFAULT
    return CONTEXT - num_prompt_tokens


def _completion(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body}, timeout=30)


def _v2(url: str, **parameters) -> httpx.Response:
    return httpx.post(f"{url}/v2/models/{MODEL}/generate", json={"text_input": PROMPT, "parameters": parameters},
                      timeout=30)


def _grpc(stub, **parameters):
    return stub.Generate(pb.GenerationRequest(prompt=PROMPT, parameters=pb.GenerationParameters(**parameters)),
                         timeout=30)


def _grpc_error(stub, **parameters) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        _grpc(stub, **parameters)
    return caught.value


def _context_message(room: int, param: str, requested: int) -> str:
    return (f"This model's maximum context length is {CONTEXT} tokens; the prompt has {CONTEXT - room} tokens, "
            f"so {param} can be at most {room} (got {requested}).")


def test_without_max_tokens_the_default_is_cut_to_the_room_left(router, scheduler, room):
    url, stub = router
    assert _completion(url).status_code == 200
    assert scheduler.requests[-1].stopping.max_tokens == room
    assert _v2(url).status_code == 200
    assert scheduler.requests[-1].stopping.max_tokens == room
    _grpc(stub)
    assert scheduler.requests[-1].stopping.max_tokens == room


def test_a_requested_budget_that_fits_is_sent_as_is(router, scheduler, room):
    url, stub = router
    for response in (_completion(url, max_tokens=room), _completion(url, max_completion_tokens=room, n=2),
                     _v2(url, max_new_tokens=room)):
        assert response.status_code == 200, response.text
        assert scheduler.requests[-1].stopping.max_tokens == room
    _grpc(stub, max_tokens=3)
    assert scheduler.requests[-1].stopping.max_tokens == 3


@pytest.mark.parametrize(("field", "param"), [("max_tokens", "max_tokens"),
                                              ("max_completion_tokens", "max_completion_tokens")])
def test_openai_a_budget_over_the_room_is_context_length_exceeded(router, scheduler, room, field, param):
    num_requests = len(scheduler.requests)
    response = _completion(router[0], **{field: room + 1})
    assert response.status_code == 400
    assert response.json()["error"] == {"message": _context_message(room, param, room + 1),
                                        "type": "invalid_request_error", "param": param,
                                        "code": "context_length_exceeded"}
    assert len(scheduler.requests) == num_requests  # refused before the scheduler saw anything


def test_v2_a_budget_over_the_room_is_context_length_exceeded(router, room):
    response = _v2(router[0], max_new_tokens=room + 1)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("parameters.max_new_tokens", "context_length_exceeded")
    assert error["message"] == _context_message(room, "parameters.max_new_tokens", room + 1)


def test_grpc_a_budget_over_the_room_is_invalid_argument_naming_the_field(router, tokenizer):
    room = CONTEXT - len(tokenizer(PROMPT).input_ids)  # the gRPC API tokenizes a prompt as /v1 does
    error = _grpc_error(router[1], max_tokens=room + 1)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == _context_message(room, "parameters.max_tokens", room + 1)
    assert ("invalid-field", "parameters.max_tokens") in tuple(error.trailing_metadata())


def test_the_contract_ranges_come_before_the_room(router, room):
    url, stub = router
    too_large = 2 ** 40  # beyond the contract's uint32: its range error, not the context's
    for response, param in [(_completion(url, max_tokens=too_large), "max_tokens"),
                            (_completion(url, max_tokens=room + 1, top_p=1.5), "top_p"),
                            (_v2(url, max_new_tokens=too_large), "parameters.max_new_tokens")]:
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == param and error["code"] != "context_length_exceeded", error
        assert error["message"].startswith(f"Invalid request: `{param}`")
    error = _grpc_error(stub, max_tokens=room + 1, top_p=1.5)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("Invalid request: `parameters.top_p`")


def test_a_prompt_that_fills_the_context_is_refused_by_the_contract(router):
    url, stub = router
    long_prompt = "a " * CONTEXT
    response = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": long_prompt}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    assert "must be shorter than the model's context of 64" in response.json()["error"]["message"]
    response = httpx.post(f"{url}/v2/models/{MODEL}/generate", json={"text_input": long_prompt}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "text_input"
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(pb.GenerationRequest(prompt=long_prompt), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("invalid-field", "prompt") in tuple(caught.value.trailing_metadata())
