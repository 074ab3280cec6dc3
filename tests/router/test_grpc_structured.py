"""Structured outputs on the public gRPC API: `parameters.structured_output` reaches the scheduler as the
contract's `structured_output` (every choice, Generate and GenerateStream), and what cannot be enforced is
INVALID_ARGUMENT naming the field, before the scheduler sees anything.

The conversion is unit-tested on grpc_convert.structured_output; the rest goes through real gRPC to a router
in this process, in front of the fake scheduler (which does not constrain its output: the worker does).
"""

from __future__ import annotations

import json

import grpc
import pytest
from transformers import AutoTokenizer

from common.ports import free_port
from protos.segserve.v1 import generation_pb2 as pb
from protos.segserve.v1 import generation_pb2_grpc
from protos.segserve.v1.sampling import MAX_STRUCTURED_SPEC_CHARS, StructuredKind, StructuredOutput
from router import grpc_api
from router.config import RouterConfig
from router.errors import APIError
from router.grpc_convert import structured_output
from router.structured import MAX_SCHEMA_DEPTH
from tests.support.fake_scheduler import start_fake_scheduler
from tests.support.router_server import serve_router_and_grpc

pytestmark = pytest.mark.timeout(120)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
          "required": ["city"]}
COMPACT_SCHEMA = json.dumps(SCHEMA, separators=(",", ":"))
Choices = pb.GenerationStructuredOutput.Choices


def _structured(**kind) -> pb.GenerationParameters:
    return pb.GenerationParameters(structured_output=pb.GenerationStructuredOutput(**kind))


# --- the conversion -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, expected", [
    ({"json_schema": json.dumps(SCHEMA, indent=2)},
     ("parameters.structured_output.json_schema", StructuredOutput(StructuredKind.JSON_SCHEMA, COMPACT_SCHEMA))),
    ({"json_object": True}, ("parameters.structured_output.json_object", StructuredOutput(StructuredKind.JSON_OBJECT))),
    ({"regex": r"[0-9]{3}-[a-z]+"},
     ("parameters.structured_output.regex", StructuredOutput(StructuredKind.REGEX, r"[0-9]{3}-[a-z]+"))),
    ({"choice": Choices(choices=["東京", "Paris"])},
     ("parameters.structured_output.choice", StructuredOutput(StructuredKind.CHOICE, '["東京","Paris"]'))),
    ({"grammar": 'root ::= "a" | "b"'},
     ("parameters.structured_output.grammar", StructuredOutput(StructuredKind.GRAMMAR, 'root ::= "a" | "b"'))),
    ({"structural_tag": json.dumps({"structures": [{"begin": "<c>", "schema": SCHEMA, "end": "</c>"}],
                                    "triggers": ["<c>"]})},
     ("parameters.structured_output.structural_tag", StructuredOutput(StructuredKind.STRUCTURAL_TAG, json.dumps(
         {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<c>"], "tags": [
             {"type": "tag", "begin": "<c>", "end": "</c>", "content": {"type": "json_schema", "json_schema": SCHEMA}}
         ]}}, separators=(",", ":"))))),
])  # fmt: skip
def test_each_kind_becomes_the_contracts_structured_output(kind, expected):
    assert structured_output(_structured(**kind)) == expected


def test_no_structured_output_is_free_text():
    assert structured_output(pb.GenerationParameters(max_tokens=4)) is None


@pytest.mark.parametrize("kind, param, words", [
    ({}, "parameters.structured_output", "must set one of json_schema, json_object, regex, choice, grammar"),
    ({"json_object": False}, "parameters.structured_output.json_object", "must be true"),
    ({"json_schema": "{"}, "parameters.structured_output.json_schema", "is not valid JSON"),
    ({"json_schema": "[1]"}, "parameters.structured_output.json_schema", "an object (got list)"),
    ({"structural_tag": '{"triggers": []}'}, "parameters.structured_output.structural_tag", "needs `format`"),
])  # fmt: skip
def test_a_malformed_structured_output_is_refused_at_conversion(kind, param, words):
    with pytest.raises(APIError) as refused:
        structured_output(_structured(**kind))
    assert refused.value.status == 400 and refused.value.param == param
    assert words in refused.value.message and f"`{param}`" in refused.value.message


# --- through gRPC ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scheduler(tiny_gemma3_dir):
    server, fake, port = start_fake_scheduler(AutoTokenizer.from_pretrained(str(tiny_gemma3_dir)))
    yield fake, port
    server.stop(grace=None)


@pytest.fixture(scope="module")
def router(scheduler, tiny_gemma3_dir):
    _, port = scheduler
    config = RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{port}", port=free_port(),
                          grpc_port=0, scheduler_wait_s=10)
    with serve_router_and_grpc(config) as (_, grpc_target):
        yield grpc_target


@pytest.fixture
def stub(router):
    with grpc.insecure_channel(router) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def _call(stub, rpc: str, parameters: pb.GenerationParameters):
    request = pb.GenerationRequest(prompt="hello", parameters=parameters)
    if rpc == "Generate":
        return stub.Generate(request, timeout=30)
    return list(stub.GenerateStream(request, timeout=30))


@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
@pytest.mark.parametrize("kind, expected", [
    ({"json_schema": COMPACT_SCHEMA}, StructuredOutput(StructuredKind.JSON_SCHEMA, COMPACT_SCHEMA)),
    ({"json_object": True}, StructuredOutput(StructuredKind.JSON_OBJECT)),
    ({"regex": "a|b"}, StructuredOutput(StructuredKind.REGEX, "a|b")),
    ({"choice": Choices(choices=["yes", "no"])}, StructuredOutput(StructuredKind.CHOICE, '["yes","no"]')),
    ({"grammar": 'root ::= "x"+'}, StructuredOutput(StructuredKind.GRAMMAR, 'root ::= "x"+')),
])  # fmt: skip
def test_every_choice_reaches_the_scheduler_with_it(stub, scheduler, rpc, kind, expected):
    fake, _ = scheduler
    num_before = len(fake.requests)
    parameters = _structured(**kind)
    parameters.MergeFrom(pb.GenerationParameters(max_tokens=4, n=2))
    _call(stub, rpc, parameters)
    assert [request.sampling.structured_output for request in fake.requests[num_before:]] == [expected] * 2


def test_without_it_the_scheduler_gets_free_text(stub, scheduler):
    fake, _ = scheduler
    num_before = len(fake.requests)
    _call(stub, "Generate", pb.GenerationParameters(max_tokens=4))
    assert fake.requests[num_before].sampling.structured_output is None


def _deep_schema(depth: int) -> str:
    return '{"type":"array","items":' * depth + '{"type":"integer"}' + "}" * depth


@pytest.mark.parametrize("kind, param, words", [
    ({}, "parameters.structured_output", "must set one of"),
    ({"json_object": False}, "parameters.structured_output.json_object", "must be true"),
    ({"json_schema": '{"type": "object",'}, "parameters.structured_output.json_schema", "is not valid JSON"),
    ({"json_schema": '"object"'}, "parameters.structured_output.json_schema", "an object (got str)"),
    ({"json_schema": '{"type": "frob"}'}, "parameters.structured_output.json_schema", "does not compile"),
    ({"json_schema": _deep_schema(MAX_SCHEMA_DEPTH)}, "parameters.structured_output.json_schema",
     "deeper than 128 levels"),
    ({"json_schema": ""}, "parameters.structured_output.json_schema", "is not valid JSON"),
    ({"regex": "(a"}, "parameters.structured_output.regex", "does not compile"),
    ({"regex": ""}, "parameters.structured_output.regex", "needs a spec"),
    ({"regex": "a" * (MAX_STRUCTURED_SPEC_CHARS + 1)}, "parameters.structured_output.regex", "longer than"),
    ({"choice": Choices()}, "parameters.structured_output.choice", "non-empty list of non-empty strings"),
    ({"choice": Choices(choices=["ok", ""])}, "parameters.structured_output.choice", "non-empty strings"),
    ({"grammar": 'start ::= "a"'}, "parameters.structured_output.grammar", "does not compile"),
    ({"grammar": "root ::= ("}, "parameters.structured_output.grammar", "does not compile"),
    ({"structural_tag": '{"type": "structural_tag", "format": {"type": "bogus"}}'},
     "parameters.structured_output.structural_tag", "does not compile"),
])  # fmt: skip
@pytest.mark.parametrize("rpc", ["Generate", "GenerateStream"])
def test_what_cannot_be_enforced_is_invalid_argument_naming_the_field(stub, scheduler, rpc, kind, param, words):
    fake, _ = scheduler
    num_before = len(fake.requests)
    with pytest.raises(grpc.RpcError) as caught:
        _call(stub, rpc, _structured(**kind))
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert f"`{param}`" in error.details() and words in error.details(), error.details()
    assert dict(error.trailing_metadata())["invalid-field"] == param
    assert len(fake.requests) == num_before  # refused before the scheduler saw it


def test_the_contracts_checks_answer_before_the_compile_check(stub, scheduler, monkeypatch):
    compiled = []

    async def recording(structured, param):
        compiled.append(param)

    monkeypatch.setattr(grpc_api, "check_compiles", recording)
    with pytest.raises(grpc.RpcError) as caught:
        _call(stub, "Generate", pb.GenerationParameters(
            top_p=1.5, structured_output=pb.GenerationStructuredOutput(regex="a|b")))
    assert dict(caught.value.trailing_metadata())["invalid-field"] == "parameters.top_p"
    assert compiled == []
    _call(stub, "Generate", _structured(regex="a|b"))
    assert compiled == ["parameters.structured_output.regex"]


def test_a_busy_compile_check_is_unavailable_to_retry(stub, scheduler, monkeypatch):
    fake, _ = scheduler
    num_before = len(fake.requests)

    async def busy(structured, param):
        raise APIError(503, "the structured output's compile check is busy; retry", param=param)

    monkeypatch.setattr(grpc_api, "check_compiles", busy)
    with pytest.raises(grpc.RpcError) as caught:
        _call(stub, "GenerateStream", _structured(regex="a|b"))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "busy" in caught.value.details()
    assert len(fake.requests) == num_before
