"""The drafter's span: a Draft call whose metadata carries a scheduler step's trace context runs in a
drafter.draft span under it; a call without one makes no span."""

from __future__ import annotations

import grpc

from drafter.config import DrafterConfig
from drafter.segments import parse_segments
from drafter.server import build_servicer, start_server
from protos.segserve.v1 import drafter_pb2, drafter_pb2_grpc
from tests.support.traces import PARENT_ID, TRACE_ID, TRACEPARENT, traced

SEGMENTS = {"default": {"algorithm": "best_first", "max_nodes": 6}}


async def test_a_traced_draft_call_runs_in_a_span_under_the_steps():
    with traced("drafter") as spans:
        server, port = await start_server(build_servicer(DrafterConfig(), parse_segments(SEGMENTS)), "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = drafter_pb2_grpc.DrafterStub(channel)
                request = drafter_pb2.DraftRequest(queries=[drafter_pb2.DraftQuery(
                    request_id="a", new_token_ids=[10, 11, 12, 10], num_tokens=4, num_prompt_tokens=4, max_nodes=4)])
                await stub.Draft(request, metadata=(("traceparent", TRACEPARENT),))
                await stub.Draft(drafter_pb2.DraftRequest(finished_request_ids=["a"]))  # untraced
        finally:
            await server.stop(grace=None)
        (span,) = spans()
    assert (span.service, span.name, span.trace_id, span.parent_span_id) == (
        "segserve-drafter", "drafter.draft", TRACE_ID, PARENT_ID)
    assert span.attributes == {"segserve.num_queries": 1} and not span.is_error
