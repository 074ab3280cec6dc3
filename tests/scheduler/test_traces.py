"""The scheduler's spans (scheduler/traces.py) and the trace context it sends on: the in-process gRPC tier (the real
Scheduler service, Engine, WorkerClient and DrafterClient in front of the fake worker and drafter over gRPC, with
tracing on in this process), and the step span's parent and links chosen from plain sequences.

A traced request (its GenerateRequest carries a router span's context) gets an admission span, a queue span and
step spans under that router span; each traced step's context goes to the worker in the StepRequest and to the
drafter in the Draft call's metadata. An untraced request, and every request while tracing is off, sends nothing.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from protos.segserve.v1 import drafter_pb2_grpc, scheduler_pb2_grpc, worker_pb2_grpc
from protos.segserve.v1.generate import GenerateComplete, GenerateRequest
from protos.segserve.v1.sampling import SamplingParams, StoppingCriteria
from protos.segserve.v1.step import StepRequest
from router.scheduler_client import SchedulerClient
from common import tracing
from scheduler import traces
from scheduler.config import SchedulerConfig
from scheduler.sequence import Sequence
from scheduler.servicer import start_server, stop_server
from scheduler.step_plan import StepPlan
from tests.scheduler.test_service import collect, wait_until
from tests.scheduler.test_spec import EOS, RULE, VOCAB, reference
from tests.support.fake_drafter import FakeDrafter
from tests.support.fake_services import FakeDrafterServicer, FakeWorkerServicer, serve
from tests.support.fakes import FakeWorker
from tests.support.traces import traced

TRACES = {"a": ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"),
          "b": ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331")}
"""Request id -> the (trace, span) of its router span, as its GenerateRequest.trace_context names them."""
PROMPTS = {"a": [5, 6, 7], "b": [40], "c": [1, 2, 3]}
MAX_TOKENS = 12


def _context(request_id: str) -> tuple[tuple[str, str], ...]:
    trace_id, span_id = TRACES[request_id]
    return (("traceparent", f"00-{trace_id}-{span_id}-01"),)


def _request(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id, tuple(PROMPTS[request_id]), SamplingParams(),
                           StoppingCriteria(max_tokens=MAX_TOKENS),
                           trace_context=_context(request_id) if request_id in TRACES else ())


class RecordingWorker(FakeWorkerServicer):
    """The fake worker, keeping each step's trace context."""

    def __init__(self, worker: FakeWorker) -> None:
        super().__init__(worker)
        self.contexts: list[dict[str, str]] = []

    async def _step(self, request, context):
        self.contexts.append(dict(request.trace_context))
        return await super()._step(request, context)


class RecordingDrafter(FakeDrafterServicer):
    """The fake drafter, keeping each call's traceparent metadata (None: none) and whether it only ended requests."""

    def __init__(self) -> None:
        super().__init__(FakeDrafter(RULE, VOCAB, num_right=5))
        self.calls: list[tuple[str | None, bool]] = []

    async def Draft(self, request, context):
        metadata = dict(context.invocation_metadata() or ())
        self.calls.append((metadata.get("traceparent"), all(q.is_final for q in request.queries)))
        return await super().Draft(request, context)


@contextlib.asynccontextmanager
async def traced_stack():
    """(scheduler stub, router client (GenerateStreams), recording worker, recording drafter)."""
    worker = RecordingWorker(FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=128, max_model_len=256))
    drafter = RecordingDrafter()
    worker_server = await serve(worker_pb2_grpc.add_WorkerServicer_to_server, worker)
    drafter_server = await serve(drafter_pb2_grpc.add_DrafterServicer_to_server, drafter)
    config = SchedulerConfig(worker_address=f"127.0.0.1:{worker_server.bound_port}", port=0,
                             drafter_addresses=[f"127.0.0.1:{drafter_server.bound_port}"], draft_timeout_ms=2000,
                             is_spec_adaptive=False)
    server, engine = await start_server(config)
    client = SchedulerClient(f"127.0.0.1:{server.bound_port}")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
            await wait_until(lambda: engine.is_connected)
            yield scheduler_pb2_grpc.SchedulerStub(channel), client, worker, drafter
    finally:
        await client.close()
        await stop_server(server, engine, grace_s=0.1)
        await drafter_server.stop(None)
        await worker_server.stop(None)


async def _generate_all(stub, client: SchedulerClient) -> None:
    """"a" and "c" as Generate calls, "b" over GenerateStreams, all at once; each as greedy decoding has it."""

    async def over_streams(request: GenerateRequest) -> list[int]:
        tokens, last = [], None
        async for event in client.generate(request):
            tokens += getattr(event, "token_ids", ())
            last = event
        assert isinstance(last, GenerateComplete)
        return tokens

    results = await asyncio.gather(collect(stub, _request("a").to_pb()), over_streams(_request("b")),
                                   collect(stub, _request("c").to_pb()))
    assert [results[0][0], results[1], results[2][0]] == [reference(PROMPTS[r], MAX_TOKENS) for r in "abc"]


async def test_traced_requests_get_their_spans_and_their_steps_context_goes_to_the_worker_and_drafter():
    with traced("scheduler") as spans:
        async with traced_stack() as (stub, client, worker, drafter):
            await _generate_all(stub, client)
            await wait_until(lambda: any(is_final for _, is_final in drafter.calls))  # the finals went out
        received = spans()
    by_name: dict[str, list] = {}
    for span in received:
        by_name.setdefault(span.name, []).append(span)
    assert {span.service for span in received} == {"segserve-scheduler"} and not any(s.is_error for s in received)
    router_spans = {span_id for _, span_id in TRACES.values()}
    for name in ("scheduler.admission", "scheduler.queue"):
        assert sorted(s.attributes["segserve.request_id"] for s in by_name[name]) == ["a", "b"]
        for span in by_name[name]:
            assert (span.trace_id, span.parent_span_id) == TRACES[span.attributes["segserve.request_id"]]
    steps = by_name["scheduler.step"]
    assert all(span.parent_span_id in router_spans for span in steps)
    for request_trace in TRACES.values():  # every traced request finds its steps: their parent, or linked
        assert any((span.trace_id, span.parent_span_id) == request_trace or request_trace in span.links
                   for span in steps)
    # a step of both traced requests hangs under the older one and links to the other's router span
    shared = [span for span in steps if span.links]
    assert shared and all(len(span.links) == 1 and span.links[0] != (span.trace_id, span.parent_span_id)
                          and span.links[0] in TRACES.values() for span in shared)
    step_ids = {span.span_id for span in steps}
    sent = [context["traceparent"].split("-")[2] for context in worker.contexts if context]
    assert sent and set(sent) <= step_ids and len(sent) == len(steps)  # each traced step reached the worker
    drafted = [parent.split("-")[2] for parent, is_final in drafter.calls if parent is not None]
    assert drafted and set(drafted) <= step_ids
    assert all(parent is None for parent, is_final in drafter.calls if is_final)  # the finals belong to no step


async def test_an_admission_refused_is_a_failed_span():
    with traced("scheduler") as spans:
        async with traced_stack() as (stub, client, worker, drafter):
            bad = GenerateRequest("a", (VOCAB + 5,), SamplingParams(), StoppingCriteria(max_tokens=4),
                                  trace_context=_context("a"))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(stub, bad.to_pb())
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        (admission,) = spans()
    assert admission.name == "scheduler.admission" and admission.is_error
    assert (admission.trace_id, admission.parent_span_id) == TRACES["a"]


@pytest.mark.parametrize("is_on", [False, True], ids=["tracing off", "untraced requests"])
async def test_without_a_traced_request_nothing_goes_to_the_worker_or_drafter(is_on):
    with traced("scheduler") if is_on else contextlib.nullcontext(lambda: []) as spans:
        async with traced_stack() as (stub, client, worker, drafter):
            requests = [_request(r) for r in "abc"]
            if is_on:  # the router sent no context
                requests = [GenerateRequest(r.request_id, r.prompt_token_ids, r.sampling, r.stopping) for r in requests]
            for request in requests:
                await collect(stub, request.to_pb())
        assert spans() == []
    assert worker.contexts and all(context == {} for context in worker.contexts)
    assert drafter.calls and all(parent is None for parent, _ in drafter.calls)


def _sequence(request_id: str, arrival_s: float) -> Sequence:
    seq = Sequence(request_id, [1, 2], arrival_time=arrival_s)
    seq.first_scheduled_time = arrival_s + 0.5
    trace_id = f"{int(request_id) + 1:032x}"
    seq.trace = traces.request_trace(GenerateRequest(request_id, (1, 2), trace_context=(
        ("traceparent", f"00-{trace_id}-{int(request_id) + 1:016x}-01"),)))
    return seq


def test_a_step_hangs_under_its_oldest_traced_request_and_links_to_at_most_max_step_links_others():
    with traced("scheduler") as spans:
        seqs = [_sequence(str(i), arrival_s=100.0 - i) for i in range(traces.MAX_STEP_LINKS + 5)]  # the last oldest
        untraced = Sequence("x", [1], arrival_time=0.0)
        plan = StepPlan(StepRequest(), [*seqs, untraced])
        traces.start_step(plan)
        assert dict(plan.request.trace_context).keys() == {"traceparent"}
        traces.end_step(plan)
        traces.end_step(plan)  # a second end is a no-op
        traces.start_step(plan)  # the next step: no second queue span
        traces.end_step(plan, "failed")
        received = spans()
    queues = [span for span in received if span.name == "scheduler.queue"]
    assert len(queues) == len(seqs)
    first, second = [span for span in received if span.name == "scheduler.step"]
    oldest = seqs[-1]
    assert first.parent_span_id == f"{int(oldest.request_id) + 1:016x}"
    assert len(first.links) == traces.MAX_STEP_LINKS and first.attributes["segserve.num_traced_seqs"] == len(seqs)
    assert not first.is_error and second.is_error


def test_a_step_without_a_traced_request_has_no_span():
    with traced("scheduler") as spans:
        plan = StepPlan(StepRequest(), [Sequence("x", [1])])
        traces.start_step(plan)
        assert plan.trace_span is None and plan.request.trace_context == {}
        with traces.drafting(plan):
            assert tracing.grpc_metadata() is None
        traces.end_step(plan)
        assert spans() == []


def test_the_choices_of_one_router_request_make_one_link_and_none_to_the_parent():
    with traced("scheduler") as spans:
        seqs = [_sequence("1", arrival_s=1.0), _sequence("1", arrival_s=2.0), _sequence("2", arrival_s=3.0),
                _sequence("2", arrival_s=4.0)]  # two requests of n = 2
        plan = StepPlan(StepRequest(), seqs)
        traces.start_step(plan)
        traces.end_step(plan)
        (step,) = [span for span in spans() if span.name == "scheduler.step"]
    assert step.parent_span_id == f"{2:016x}" and step.links == ((f"{3:032x}", f"{3:016x}"),)
