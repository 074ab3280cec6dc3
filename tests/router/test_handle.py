"""SchedulerClient.open: a request's events taken straight from its stream, with a timeout; and the observers
(metrics, the gRPC API's step sizes) that generate_deltas tells of them, without a task per request.

The real Engine and Scheduler service in front of tests/support/fakes.py's FakeWorker (next token = last + 1), reached
over the shared GenerateStreams call and, for a scheduler without it, over one Generate call per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import pytest

import router
from protos.segserve.v1.generate import GenerateComplete, GenerateError, TokenChunk
from router.generation import Delta, GenerationJob, generate_deltas
from router.grpc_convert import StepSizes
from router.metrics import RequestTracker, RouterMetrics
from router.scheduler_client import SchedulerClient
from tests.scheduler.test_generate_streams import client_events, request, running_stack, start_older_scheduler
from tests.scheduler.test_service import wait_until


@contextlib.asynccontextmanager
async def stack(is_per_request: bool, step_delay_s: float = 0.0):
    """(router client, engine): a scheduler with GenerateStreams, or an older one with only Generate and GetStats."""
    async with running_stack(step_delay_s) as (_, _, client, _, engine):
        if not is_per_request:
            yield client, engine
            return
        old_server, port = await start_older_scheduler(engine)
        old_client = SchedulerClient(f"127.0.0.1:{port}")
        try:
            yield old_client, engine
        finally:
            await old_client.close()
            await old_server.stop(None)


def is_idle(engine) -> bool:
    stats = engine.stats()
    return (stats.num_running, stats.num_waiting, stats.num_used_kv_blocks) == (0, 0, 0)


async def take_to_end(stream, timeout_s: float = 5.0) -> tuple[list[int], object]:
    tokens = []
    while True:
        events = await stream.take(timeout_s)
        assert events, "nothing within the timeout"
        for event in events:
            if not isinstance(event, TokenChunk):
                return tokens, event
            tokens += event.token_ids


ROUTER_DIR = os.path.dirname(router.__file__) + os.sep


def router_tasks() -> list[str]:
    """The names of the running tasks whose coroutine is the router's code (the scheduler runs in this loop too)."""
    names = []
    for task in asyncio.all_tasks():
        code = getattr(task.get_coro(), "cr_code", None)
        if code is not None and code.co_filename.startswith(ROUTER_DIR):
            names.append(task.get_name())
    return names


PATHS = pytest.mark.parametrize("is_per_request", [False, True], ids=["shared", "per_request"])


@PATHS
async def test_take_returns_every_event_that_arrived_in_one_list(is_per_request):
    async with stack(is_per_request) as (client, engine):
        stream = client.open(request("short", [1, 2, 3], max_tokens=5))
        try:
            # A longer request of the same batch ends after it: by then all of "short" has arrived.
            tokens, last = await client_events(client, request("long", [50], max_tokens=20))
            assert tokens == list(range(51, 71)) and isinstance(last, GenerateComplete)
            events = await stream.take(1.0)
            assert len(events) >= 2 and all(isinstance(e, TokenChunk) for e in events[:-1])
            assert [t for e in events[:-1] for t in e.token_ids] == [4, 5, 6, 7, 8]
            assert isinstance(events[-1], GenerateComplete) and events[-1].num_generated_tokens == 5
            assert await stream.take(0.05) == []  # over: nothing more comes
        finally:
            await stream.close()
        assert client.is_per_request is is_per_request


async def test_the_per_request_path_reads_each_request_with_its_own_task():
    async with stack(True, step_delay_s=0.02) as (client, _):
        await client_events(client, request("warm", [1], max_tokens=1))
        streams = [client.open(request(f"p{i}", [i + 1], max_tokens=3)) for i in range(3)]
        try:
            assert len(router_tasks()) == 3
        finally:
            for stream in streams:
                await stream.close()
        await asyncio.sleep(0)
        assert router_tasks() == []


@PATHS
async def test_a_take_that_times_out_returns_nothing_and_the_request_goes_on(is_per_request):
    async with stack(is_per_request, step_delay_s=0.15) as (client, engine):
        loop = asyncio.get_running_loop()
        stream = client.open(request("slow", [1], max_tokens=3))
        try:
            started_s = loop.time()
            assert await stream.take(0.03) == []  # a step takes 0.15 s
            assert loop.time() - started_s >= 0.03 - 0.002
            tokens, last = await take_to_end(stream)
        finally:
            await stream.close()
        assert tokens == [2, 3, 4] and isinstance(last, GenerateComplete)
        await wait_until(lambda: is_idle(engine), timeout_s=2.0)


@PATHS
async def test_closing_before_the_end_cancels_the_request_at_the_scheduler(is_per_request):
    async with stack(is_per_request, step_delay_s=0.02) as (client, engine):
        stream = client.open(request("cut", [1, 2], max_tokens=1000))
        try:
            events = await stream.take(5.0)
            assert events and isinstance(events[0], TokenChunk)
            assert engine.stats().num_running == 1
        finally:
            await stream.close()
        await wait_until(lambda: is_idle(engine), timeout_s=2.0)
        assert engine.stats().num_running == 0
        # The client goes on serving requests afterwards.
        tokens, last = await client_events(client, request("after", [5], max_tokens=2))
        assert tokens == [6, 7] and isinstance(last, GenerateComplete)


@PATHS
async def test_a_deadline_ends_the_stream_with_timeout(is_per_request):
    async with stack(is_per_request, step_delay_s=0.02) as (client, engine):
        stream = client.open(request("late", [1], max_tokens=1000), timeout_s=0.2)
        try:
            tokens, last = await take_to_end(stream)
        finally:
            await stream.close()
        assert tokens and isinstance(last, GenerateError) and last.code == "timeout"
        await wait_until(lambda: is_idle(engine), timeout_s=2.0)


async def test_a_request_id_already_live_is_refused_and_the_live_one_goes_on():
    async with stack(False, step_delay_s=0.02) as (client, _):
        first = client.open(request("same", [1], max_tokens=3))
        second = client.open(request("same", [9], max_tokens=3))
        try:
            [error] = await second.take(1.0)
            assert error == GenerateError("invalid_request", "request_id: 'same' is already live")
            await second.close()
            tokens, last = await take_to_end(first)
        finally:
            await first.close()
        assert tokens == [2, 3, 4] and isinstance(last, GenerateComplete)


class _IdTexts:
    """A detokenizer stand-in: a token's text is its id and a space."""

    def add(self, token_ids) -> str:
        return "".join(f"{token} " for token in token_ids)

    def flush(self) -> str:
        return ""


def observed_deltas(client, request_id: str, prompt: list[int], max_tokens: int, observers):
    job = GenerationJob(request(request_id, prompt, max_tokens=max_tokens), eos_token_ids=frozenset())
    return generate_deltas(client, job, _IdTexts(), observers=observers)


async def test_the_shared_call_hands_events_to_observed_requests_without_a_task_per_request():
    async with stack(False, step_delay_s=0.02) as (client, engine):
        metrics = RouterMetrics("tiny")
        await client_events(client, request("warm", [1], max_tokens=1))  # the shared call and its reader exist
        generations = [observed_deltas(client, f"m{i}", [i + 1], 4, [RequestTracker(metrics.http)])
                       for i in range(8)]
        try:
            firsts = [await anext(deltas) for deltas in generations]
            assert all(isinstance(delta, Delta) and delta.token_ids for delta in firsts)
            assert router_tasks() == ["segserve-scheduler-streams"]  # the one reader, no pump per request
            rests = [[delta async for delta in deltas] for deltas in generations]
        finally:
            for deltas in generations:
                await deltas.aclose()
        for i, (first, rest) in enumerate(zip(firsts, rests)):
            assert [t for d in (first, *rest) for t in d.token_ids] == [i + 2, i + 3, i + 4, i + 5]
            assert rest[-1].finish_reason == "length"
        samples = {(s.name, s.labels.get("finished_reason")): s.value
                   for m in metrics.registry.collect() for s in m.samples}
        assert samples[("vllm:generation_tokens_total", None)] == 8 * 4
        assert samples[("vllm:request_success_total", "length")] == 8
        await wait_until(lambda: is_idle(engine), timeout_s=2.0)


async def test_a_request_closed_before_its_end_is_counted_as_aborted():
    async with stack(False, step_delay_s=0.02) as (client, engine):
        metrics = RouterMetrics("tiny")
        deltas = observed_deltas(client, "gone", [1], 1000, [RequestTracker(metrics.http)])
        assert (await anext(deltas)).token_ids
        await deltas.aclose()  # the client went away
        samples = {(s.name, s.labels.get("finished_reason")): s.value
                   for m in metrics.registry.collect() for s in m.samples}
        assert samples[("vllm:request_success_total", "abort")] == 1
        assert samples[("vllm:time_to_first_token_seconds_count", None)] == 1
        await wait_until(lambda: is_idle(engine), timeout_s=2.0)


async def test_the_grpc_apis_step_sizes_note_chunk_sizes_without_a_task_per_request():
    async with stack(False, step_delay_s=0.02) as (client, engine):
        await client_events(client, request("warm", [1], max_tokens=1))  # the shared call and its reader exist
        sizes = [StepSizes() for _ in range(4)]
        generations = [observed_deltas(client, f"g{i}", [i + 10], 3, [step_sizes])
                       for i, step_sizes in enumerate(sizes)]
        try:
            firsts = [await anext(deltas) for deltas in generations]
            assert all(isinstance(delta, Delta) and delta.token_ids for delta in firsts)
            assert router_tasks() == ["segserve-scheduler-streams"]  # no pump task for the gRPC API's choices
            rests = [[delta async for delta in deltas] for deltas in generations]
        finally:
            for deltas in generations:
                await deltas.aclose()
        for i, (step_sizes, first, rest) in enumerate(zip(sizes, firsts, rests)):
            assert [t for d in (first, *rest) for t in d.token_ids] == [i + 11, i + 12, i + 13]
            assert rest[-1].complete is not None
            assert sum(step_sizes.take(3)) == 3  # every chunk's size was noted, whole steps
        await wait_until(lambda: is_idle(engine), timeout_s=2.0)
