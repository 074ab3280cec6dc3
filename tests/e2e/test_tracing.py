"""Distributed traces end to end: a speculative tiny stack (router, scheduler, worker, drafter processes) with
tracing on exports to an OTLP receiver in this process (segserve/bench/otlp_receiver.py, the collector's
TraceService). One request over HTTP and one over the public gRPC API, each with a client's `traceparent`, must
each give one tree in the client's trace: the router's span under the client's span, the scheduler's admission,
queue and step spans under it, and the worker's forward and sample spans and the drafter's Draft spans under the
steps; spans from all four services, none failed. The services export only when they stop (the batch delay is
set past the test), so the spans arriving at all is the flush on shutdown.
"""

from __future__ import annotations

import collections

import grpc
import httpx
import pytest

from protos.segserve.v1 import generation_pb2, generation_pb2_grpc
from segserve.bench.otlp_receiver import ReceivedSpan, start_receiver
from tests.support.e2e_helpers import tiny_stack

pytestmark = pytest.mark.e2e

HTTP_TRACE, HTTP_PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
GRPC_TRACE, GRPC_PARENT = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
SERVICES = {"segserve-router", "segserve-scheduler", "segserve-worker", "segserve-drafter"}


def traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"


@pytest.fixture(scope="module")
def received(tiny_gemma3_dir, tmp_path_factory) -> list[ReceivedSpan]:
    """Every span the stack exported for the two requests (it is stopped, so all of them)."""
    server, port, collector = start_receiver()
    patch = pytest.MonkeyPatch()
    patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # the services' processes inherit it: export at shutdown only
    try:
        # is_spec_adaptive off: the drafter is asked at every decode step, whatever the step times. A deadline far
        # past the 20 ms default: on a loaded machine a first Draft call can miss it, and the scheduler then decodes
        # on without the drafter for a second, which is most of a 16-token request.
        with tiny_stack(tiny_gemma3_dir, tmp_path_factory.mktemp("logs"),
                        scheduler={"is_spec_adaptive": False, "draft_timeout_ms": 10_000.0},
                        shared={"otlp_traces_endpoint": f"http://127.0.0.1:{port}"}) as stack:
            body = {"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 16,
                    "temperature": 0, "stream": True}
            with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body, timeout=120,
                              headers={"traceparent": traceparent(HTTP_TRACE, HTTP_PARENT)}) as response:
                assert response.status_code == 200
                assert "data: [DONE]" in response.read().decode()
            with grpc.insecure_channel(stack.grpc_address) as channel:
                request = generation_pb2.GenerationRequest(prompt="The quick brown fox",
                                                           parameters=generation_pb2.GenerationParameters(
                                                               max_tokens=16, temperature=0))
                reply = generation_pb2_grpc.GenerationStub(channel).Generate(
                    request, timeout=120, metadata=(("traceparent", traceparent(GRPC_TRACE, GRPC_PARENT)),))
                assert reply.choices[0].text
        return collector.spans()
    finally:
        patch.undo()
        server.stop(None)


def check_tree(spans: list[ReceivedSpan], root_parent: str, api: str) -> dict[str, list[ReceivedSpan]]:
    """The trace's spans by name, once every span's parent is the client's span or another span of the trace."""
    by_id = {span.span_id: span for span in spans}
    assert len(by_id) == len(spans)
    for span in spans:
        assert span.parent_span_id == root_parent or span.parent_span_id in by_id, span
        assert not span.is_error, span
    by_name = collections.defaultdict(list)
    for span in spans:
        by_name[span.name].append(span)
    (router,) = by_name["router.request"]
    assert router.service == "segserve-router" and router.parent_span_id == root_parent
    assert router.attributes["segserve.api"] == api and router.attributes["segserve.request_id"]
    assert router.attributes["segserve.tenant"] == ""
    for name in ("scheduler.admission", "scheduler.queue", "scheduler.step"):
        assert by_name[name], f"no {name} span"
        assert all(s.service == "segserve-scheduler" and s.parent_span_id == router.span_id for s in by_name[name])
    steps = {s.span_id for s in by_name["scheduler.step"]}
    for name, service in (("worker.forward", "segserve-worker"), ("worker.sample", "segserve-worker"),
                          ("drafter.draft", "segserve-drafter")):
        assert by_name[name], f"no {name} span"
        assert all(s.service == service and s.parent_span_id in steps for s in by_name[name])
    # a request alone: every step its own, one forward and one sample each (a decode step at a time here)
    assert len(by_name["worker.forward"]) == len(by_name["worker.sample"]) >= len(steps)
    return by_name


def test_a_request_over_http_is_one_tree_across_the_four_services_under_the_clients_span(received):
    trace = [span for span in received if span.trace_id == HTTP_TRACE]
    assert {span.service for span in trace} == SERVICES
    by_name = check_tree(trace, HTTP_PARENT, "openai.chat")
    assert by_name["router.request"][0].attributes["segserve.request_id"].startswith("chatcmpl-")


def test_a_request_over_grpc_honours_the_traceparent_metadata(received):
    trace = [span for span in received if span.trace_id == GRPC_TRACE]
    assert {span.service for span in trace} == SERVICES
    check_tree(trace, GRPC_PARENT, "grpc")


def test_every_span_belongs_to_a_clients_trace(received):
    """The services start no trace of their own: no span of warm-ups, health checks or background calls."""
    assert {span.trace_id for span in received} == {HTTP_TRACE, GRPC_TRACE}
