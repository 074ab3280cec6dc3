"""The worker's spans: a step whose StepRequest carries its scheduler span's trace context (over Step and over
StepStream) runs its forward and its sampling in worker.forward and worker.sample spans under that span; a step
without one makes no span."""

from __future__ import annotations

import grpc

from protos.segserve.v1 import worker_pb2, worker_pb2_grpc
from tests.support.traces import PARENT_ID, TRACE_ID, TRACEPARENT, traced
from tests.worker.test_server import GREEDY, runner  # noqa: F401 (fixture)
from worker.server import WorkerServicer, start_server


def _prefill(seq_id: str, **trace) -> worker_pb2.StepRequest:
    prompt = [1, 40, 41, 42]
    return worker_pb2.StepRequest(
        new_sequences=[worker_pb2.NewSequence(seq_id=seq_id, sampling=GREEDY, num_prompt_tokens=len(prompt))],
        sequences=[worker_pb2.ScheduledSequence(seq_id=seq_id, token_ids=prompt, block_table=[3], sample_indices=[3])],
        finished_seq_ids=[], **trace)


async def test_a_traced_step_runs_its_forward_and_sampling_in_spans_under_the_schedulers(runner):
    with traced("worker") as spans:
        servicer = WorkerServicer(runner)
        server, port = await start_server(servicer, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                await stub.Step(_prefill("a", trace_context={"traceparent": TRACEPARENT}))
                await stub.Step(_prefill("b"))  # untraced
                call = stub.StepStream()
                await call.write(_prefill("c", trace_context={"traceparent": TRACEPARENT}))
                assert (await call.read()).ByteSize() > 0
                await call.done_writing()
                await stub.Step(worker_pb2.StepRequest(finished_seq_ids=["a", "b", "c"]))
        finally:
            await server.stop(grace=None)
        received = spans()
    assert sorted(span.name for span in received) == ["worker.forward"] * 2 + ["worker.sample"] * 2
    assert all(span.service == "segserve-worker" and span.trace_id == TRACE_ID and span.parent_span_id == PARENT_ID
               and not span.is_error for span in received)
