"""The router's spans (router/traces.py), against a router in this process in front of the fake scheduler.

With tracing on, a generation request over HTTP (/v1 and /v2) or the public gRPC API runs in one router.request
span, a child of the client's `traceparent` (a header, gRPC metadata) when it sends one, carrying the API, the
request id and the tenant; the GenerateRequest the scheduler receives carries that span's W3C context. Other
routes make no span. With tracing off (the default) no request carries any context.
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
from router.traces import api_of
from tests.support.fake_scheduler import start_fake_scheduler
from tests.support.router_server import serve_router_and_grpc
from tests.support.traces import PARENT_ID, TRACE_ID, TRACEPARENT, traced

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-test"


@pytest.fixture(scope="module")
def scheduler(tiny_gemma3_dir):
    server, fake, port = start_fake_scheduler(AutoTokenizer.from_pretrained(str(tiny_gemma3_dir)), model_name=MODEL)
    yield fake, port
    server.stop(grace=None)


def _config(tiny_gemma3_dir, port: int) -> RouterConfig:
    return RouterConfig(model=str(tiny_gemma3_dir), scheduler_address=f"127.0.0.1:{port}", port=free_port(),
                        grpc_port=0, scheduler_wait_s=10, tenant_header="X-Tenant")


def _send_every_kind(urls: tuple[str, str], headers: dict[str, str], metadata: tuple = ()) -> None:
    """A chat completion, a completion, a /v2 generate, a gRPC Generate, and two requests that generate nothing."""
    base, target = urls
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
                       (f"/v2/models/{MODEL}/generate", {"text_input": "hi", "parameters": {"max_new_tokens": 4}})):
        response = httpx.post(base + path, json=body, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
    assert httpx.get(base + "/v1/models", headers=headers, timeout=30).status_code == 200
    assert httpx.post(base + "/v1/completions", json={"prompt": "hi", "model": "other"}, headers=headers,
                      timeout=30).status_code == 404
    with grpc.insecure_channel(target) as channel:
        request = pb.GenerationRequest(prompt="hi", parameters=pb.GenerationParameters(max_tokens=4))
        assert generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=30, metadata=metadata).choices


def test_each_generation_is_one_span_under_the_clients_and_the_parent_of_its_scheduler_request(
        scheduler, tiny_gemma3_dir):
    fake, port = scheduler
    num_before = len(fake.requests)
    with traced("router") as spans:
        with serve_router_and_grpc(_config(tiny_gemma3_dir, port)) as urls:
            _send_every_kind(urls, {"traceparent": TRACEPARENT, "X-Tenant": "acme"}, (("traceparent", TRACEPARENT),))
        received = spans()  # the router's shutdown exported them
    assert {span.name for span in received} == {"router.request"}
    assert all(span.service == "segserve-router" and span.trace_id == TRACE_ID and span.parent_span_id == PARENT_ID
               for span in received)
    assert len(received) == 5  # the completion for an unknown model too: refused, still traced
    (refused,) = [span for span in received if span.attributes.get("http.response.status_code") == 404]
    assert refused.attributes["segserve.api"] == "openai.completions" and not refused.is_error
    assert "segserve.request_id" not in refused.attributes  # it reached no scheduler
    by_api = {span.attributes["segserve.api"]: span for span in received if span is not refused}
    assert sorted(by_api) == ["grpc", "openai.chat", "openai.completions", "v2"]
    sent = fake.requests[num_before:]
    assert len(sent) == 4
    for request, api in zip(sent, ("openai.chat", "openai.completions", "v2", "grpc")):
        span = by_api[api]
        assert dict(request.trace_context) == {"traceparent": f"00-{TRACE_ID}-{span.span_id}-01"}
        assert span.attributes["segserve.request_id"] == request.request_id
        assert span.attributes["segserve.tenant"] == ("acme" if api != "grpc" else "")
    assert by_api["openai.chat"].attributes["http.response.status_code"] == 200
    assert by_api["openai.chat"].attributes["url.path"] == "/v1/chat/completions"


def test_without_a_traceparent_each_request_starts_its_own_trace(scheduler, tiny_gemma3_dir):
    fake, port = scheduler
    num_before = len(fake.requests)
    with traced("router") as spans:
        with serve_router_and_grpc(_config(tiny_gemma3_dir, port)) as urls:
            _send_every_kind(urls, {})
        received = spans()
    assert len({span.trace_id for span in received}) == len(received) == 5
    assert all(span.parent_span_id == "" for span in received)
    traces = {span.trace_id for span in received}
    assert {dict(r.trace_context)["traceparent"].split("-")[1] for r in fake.requests[num_before:]} < traces


def test_while_tracing_is_off_no_request_carries_a_trace_context(scheduler, tiny_gemma3_dir):
    fake, port = scheduler
    num_before = len(fake.requests)
    with serve_router_and_grpc(_config(tiny_gemma3_dir, port)) as urls:
        _send_every_kind(urls, {"traceparent": TRACEPARENT}, (("traceparent", TRACEPARENT),))
    sent = fake.requests[num_before:]
    assert len(sent) == 4 and all(request.trace_context == () for request in sent)


@pytest.mark.parametrize("path, api", [
    ("/v1/chat/completions", "openai.chat"), ("/v1/completions", "openai.completions"),
    ("/v2/models/m/generate", "v2"),
    ("/v2/models/org/m/versions/3/generate_stream", "v2"), ("/v1/models", None), ("/tokenize", None),
    ("/v2/models/m", None), ("/health", None),
])
def test_the_api_of_a_path(path, api):
    assert api_of(path) == api
