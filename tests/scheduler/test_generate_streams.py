"""GenerateStreams: many requests over one call, each step's events in one message.

The real Engine and Scheduler service in front of tests/support/fakes.py's FakeWorker (next token = last + 1), read
both with the raw stub (to count messages and send actions by hand) and with the router's SchedulerClient,
whose requests share one GenerateStreams call.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from protos.segserve.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2_grpc
from protos.segserve.v1.generate import (
    CancelStream,
    FinishReason,
    GenerateComplete,
    GenerateError,
    GenerateEvent,
    GenerateRequest,
    StartStream,
    TokenChunk,
    stream_events_from_pb,
    stream_events_to_pb,
)
from protos.segserve.v1.sampling import SamplingParams, StoppingCriteria
from router.scheduler_client import SchedulerClient
from scheduler.config import SchedulerConfig
from scheduler.servicer import SchedulerServicer, start_server, stop_server
from tests.support.fake_services import FakeWorkerServicer, serve
from tests.scheduler.test_service import EOS, VOCAB, collect, idle_stats, make_fake, wait_until


@contextlib.asynccontextmanager
async def running_stack(step_delay_s: float = 0.0):
    """(scheduler gRPC server, stub, router client, fake worker, engine) on the running event loop."""
    fake = make_fake()
    fake.step_delay_s = step_delay_s
    worker_server = await serve(worker_pb2_grpc.add_WorkerServicer_to_server, FakeWorkerServicer(fake))
    config = SchedulerConfig(worker_address=f"127.0.0.1:{worker_server.bound_port}", port=0,
                             max_num_batched_tokens=64)
    server, engine = await start_server(config)
    client = SchedulerClient(f"127.0.0.1:{server.bound_port}")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
            await wait_until(lambda: engine.is_connected)
            yield server, scheduler_pb2_grpc.SchedulerStub(channel), client, fake, engine
    finally:
        await client.close()
        await stop_server(server, engine, grace_s=0.1)
        await worker_server.stop(None)


def request(request_id: str, prompt: list[int], max_tokens: int = 5) -> GenerateRequest:
    return GenerateRequest(request_id, tuple(prompt), SamplingParams(), StoppingCriteria(max_tokens=max_tokens))


class RawCall:
    """A GenerateStreams call driven by hand: actions in, (request_id, event) pairs and message counts out."""

    def __init__(self, stub) -> None:
        self.actions: asyncio.Queue = asyncio.Queue()
        self.call = stub.GenerateStreams(self._send())
        self.num_messages = 0
        self.num_packed_messages = 0
        """Messages with packed chunks (StreamsResponse.packed_chunks)."""

    async def _send(self):
        while (action := await self.actions.get()) is not None:
            yield action if isinstance(action, scheduler_pb2.StreamsRequest) else action.to_pb()

    def send(self, action) -> None:
        self.actions.put_nowait(action)

    async def read_until_ended(self, request_ids: set[str], timeout_s: float = 5.0
                               ) -> dict[str, list[GenerateEvent]]:
        """Each request's events, read until every one of `request_ids` got its terminal event."""
        events: dict[str, list[GenerateEvent]] = {rid: [] for rid in request_ids}
        pending = set(request_ids)

        async def read():
            while pending:
                response = await self.call.read()
                assert response is not grpc.aio.EOF, f"the call ended with {pending} still live"
                self.num_messages += 1
                self.num_packed_messages += response.HasField("packed_chunks")
                for request_id, event in stream_events_from_pb(response):
                    events.setdefault(request_id, []).append(event)
                    if not isinstance(event, TokenChunk):
                        pending.discard(request_id)

        await asyncio.wait_for(read(), timeout_s)
        return events


async def client_events(client: SchedulerClient, req: GenerateRequest, timeout_s: float | None = None
                        ) -> tuple[list[int], GenerateEvent]:
    tokens = []
    async for event in client.generate(req, timeout_s):
        if isinstance(event, TokenChunk):
            tokens += event.token_ids
        else:
            return tokens, event
    raise AssertionError("no terminal event")


async def is_idle(stub) -> bool:
    return await idle_stats(stub) == (0, 0, 0)


async def test_concurrent_requests_share_messages_and_each_gets_its_events_in_order():
    async with running_stack(step_delay_s=0.002) as (_, stub, _, fake, _):
        raw = RawCall(stub)
        prompts = {f"r{i}": [10 * i + 1, 10 * i + 2] for i in range(16)}
        for rid, prompt in prompts.items():
            raw.send(StartStream(request(rid, prompt, max_tokens=8)))
        events = await raw.read_until_ended(set(prompts))
        num_events = sum(len(e) for e in events.values())
        for rid, prompt in prompts.items():
            *chunks, last = events[rid]
            assert all(isinstance(c, TokenChunk) for c in chunks), rid
            assert [t for c in chunks for t in c.token_ids] == [prompt[-1] + 1 + k for k in range(8)], rid
            assert isinstance(last, GenerateComplete) and last.finish_reason is FinishReason.LENGTH
        # One message per step for all the call's requests, not one per request and step.
        assert num_events == 16 * 9 and raw.num_messages <= num_events // 4, (raw.num_messages, num_events)
        assert fake.max_batch > 1 and fake.problems == []
        raw.send(None)  # the client closes its side: the call ends, nothing is live
        assert await asyncio.wait_for(raw.call.read(), 2.0) is grpc.aio.EOF
        assert await raw.call.code() is grpc.StatusCode.OK
        assert await is_idle(stub)


@pytest.mark.parametrize("is_packed", [True, False], ids=["packed", "older-client"])
async def test_chunks_go_packed_only_to_a_client_that_reads_them(is_packed):
    """A client that says it reads packed chunks (as StartStream.to_pb does) gets each step's plain chunks as
    columns, and its requests' completions one message each; one that predates them gets every event one
    message each. Either way each request gets the same events."""
    async with running_stack(step_delay_s=0.002) as (_, stub, _, fake, _):
        raw = RawCall(stub)
        prompts = {f"r{i}": [10 * i + 1, 10 * i + 2] for i in range(6)}
        for rid, prompt in prompts.items():
            start = StartStream(request(rid, prompt, max_tokens=6)).to_pb()
            if not is_packed:
                start.ClearField("packed_chunks")
            raw.send(start)
        events = await raw.read_until_ended(set(prompts))
        for rid, prompt in prompts.items():
            *chunks, last = events[rid]
            assert [t for c in chunks for t in c.token_ids] == [prompt[-1] + 1 + k for k in range(6)], rid
            assert all(c.batch_size >= 1 for c in chunks), rid  # a per-chunk column
            assert isinstance(last, GenerateComplete) and last.finish_reason is FinishReason.LENGTH
        assert (raw.num_packed_messages > 0) == is_packed and fake.problems == []
        raw.send(None)


async def test_router_client_output_equals_the_per_request_generate_path():
    async with running_stack() as (_, stub, client, _, _):
        prompts = {"a": [1, 2, 3], "b": [290], "c": [40] * 9, "d": [150, 296]}
        shared = await asyncio.gather(*(client_events(client, request(rid, p, max_tokens=7))
                                        for rid, p in prompts.items()))
        per_request = await asyncio.gather(*(collect(stub, request(f"g{rid}", p, max_tokens=7).to_pb())
                                             for rid, p in prompts.items()))

        def outcome(tokens, last):
            return tokens, last.finish_reason, last.num_prompt_tokens, last.num_generated_tokens

        assert [outcome(*r) for r in shared] == [outcome(*r) for r in per_request]
        assert shared[1][0] == [291, 292, 293, 294, 295, 296, 297]
        assert outcome(*shared[3]) == ([297, 298, EOS], FinishReason.EOS_TOKEN, 2, 3)
        assert client._shared is not None and not client.is_per_request


async def test_an_invalid_request_gets_an_error_event_naming_the_field_and_the_others_go_on():
    async with running_stack(step_delay_s=0.005) as (_, stub, client, _, _):
        raw = RawCall(stub)
        raw.send(StartStream(request("good", [1], max_tokens=20)))
        raw.send(StartStream(request("bad", [VOCAB + 5])))
        raw.send(StartStream(request("", [1])))
        events = await raw.read_until_ended({"good", "bad", ""})
        assert events["bad"] == [GenerateError("invalid_request",
                                               f"prompt_token_ids: holds id {VOCAB + 5}, outside the vocabulary "
                                               f"of {VOCAB}")]
        assert events[""] == [GenerateError("invalid_request", "request_id: must not be empty")]
        assert isinstance(events["good"][-1], GenerateComplete) and events["good"][-1].num_generated_tokens == 20
        raw.call.cancel()
        tokens, last = await client_events(client, request("bad2", [1], max_tokens=0))
        assert tokens == [] and last.code == "invalid_request" and last.message.startswith("max_tokens: ")


async def test_cancel_ends_the_request_once_and_frees_its_slot_and_blocks():
    async with running_stack(step_delay_s=0.02) as (_, stub, client, fake, _):
        raw = RawCall(stub)
        raw.send(StartStream(request("long", [1, 2, 3], max_tokens=100)))
        first = await asyncio.wait_for(raw.call.read(), 5.0)
        assert stream_events_from_pb(first)[0][0] == "long"
        stats = await stub.GetStats(scheduler_pb2.StatsRequest())
        assert stats.num_running == 1 and stats.num_used_kv_blocks > 0
        raw.send(CancelStream("long"))
        events = await raw.read_until_ended({"long"})
        assert events["long"][-1] == GenerateError("cancelled", "the request was cancelled")
        await wait_until(lambda: is_idle(stub), timeout_s=2.0)
        raw.send(StartStream(request("after", [5], max_tokens=2)))
        events = await raw.read_until_ended({"after"})
        assert [e.token_ids for e in events["after"][:-1]] == [(6,), (7,)]
        assert "long" in fake.released  # the worker dropped it with the next step
        # The router client: closing the iterator early cancels the request the same way.
        events = client.generate(request("closed", [1, 2], max_tokens=100))
        assert isinstance(await anext(events), TokenChunk)
        await events.aclose()
        await wait_until(lambda: is_idle(stub), timeout_s=2.0)
        raw.call.cancel()


async def test_a_deadline_ends_the_request_with_timeout_and_frees_it():
    async with running_stack(step_delay_s=0.02) as (_, stub, client, _, _):
        raw = RawCall(stub)
        raw.send(StartStream(request("slow", [1], max_tokens=1000), timeout_s=0.2))
        raw.send(StartStream(request("quick", [1], max_tokens=2), timeout_s=5.0))
        events = await raw.read_until_ended({"slow", "quick"})
        assert events["slow"][-1] == GenerateError("timeout", "the request passed its deadline of 0.2 s")
        assert 2 <= len(events["slow"]) < 30
        assert isinstance(events["quick"][-1], GenerateComplete)
        await wait_until(lambda: is_idle(stub), timeout_s=2.0)
        raw.call.cancel()
        tokens, last = await asyncio.wait_for(client_events(client, request("c", [1], max_tokens=1000), 0.2), 3.0)
        assert tokens and last.code == "timeout"
        await wait_until(lambda: is_idle(stub), timeout_s=2.0)


async def test_closing_the_call_aborts_every_live_request_of_it():
    async with running_stack(step_delay_s=0.02) as (_, stub, _, _, engine):
        raw = RawCall(stub)
        for i in range(4):
            raw.send(StartStream(request(f"l{i}", [i + 1], max_tokens=200)))
        await asyncio.wait_for(raw.call.read(), 5.0)
        await wait_until(lambda: engine.stats().num_running == 4)
        assert engine.stats().num_used_kv_blocks > 0
        raw.call.cancel()
        await wait_until(lambda: is_idle(stub), timeout_s=2.0)
        assert engine.stats().num_used_kv_blocks == 0


async def test_a_scheduler_gone_mid_stream_ends_every_request_with_an_error_and_the_next_call_is_new():
    async with running_stack(step_delay_s=0.02) as (server, _, client, _, engine):
        tasks = [asyncio.create_task(client_events(client, request(f"k{i}", [i + 1], max_tokens=500)))
                 for i in range(4)]
        await wait_until(lambda: engine.stats().num_running == 4 and engine.stats().num_steps >= 5)
        await asyncio.sleep(0.05)  # the tokens of those steps reach the client
        first_call = client._shared
        await server.stop(None)  # the scheduler's gRPC server is gone, its engine still runs
        results = await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        for tokens, last in results:
            assert tokens and isinstance(last, GenerateError) and last.code in ("unavailable", "cancelled"), last
        assert client._shared is None or client._shared is not first_call
        tokens, last = await asyncio.wait_for(client_events(client, request("next", [1])), 5.0)
        assert isinstance(last, GenerateError) and last.code == "unavailable"  # a new call, refused: no hang


async def start_breaking_scheduler() -> tuple[grpc.aio.Server, int]:
    """A scheduler whose GenerateStreams answers the first request it is sent with one token, reads a second
    start, and then fails the call with INTERNAL (what gRPC reports when a start is written just as a draining
    scheduler ends its last call); (server, port)."""

    async def generate_streams(request_iterator, context):
        await context.send_initial_metadata(())
        actions = aiter(request_iterator)
        first = await anext(actions)
        yield stream_events_to_pb([(first.start.request.request_id, TokenChunk((7,), (0.0,)))])
        await anext(actions)
        await context.abort(grpc.StatusCode.INTERNAL, "Internal error from Core")

    handlers = {"GenerateStreams": grpc.stream_stream_rpc_method_handler(
        generate_streams, request_deserializer=scheduler_pb2.StreamsRequest.FromString,
        response_serializer=scheduler_pb2.StreamsResponse.SerializeToString)}
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("segserve.v1.Scheduler", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def test_a_broken_call_ends_an_unanswered_request_as_unavailable_and_an_answered_one_as_its_failure():
    server, port = await start_breaking_scheduler()
    client = SchedulerClient(f"127.0.0.1:{port}")
    try:
        answered = asyncio.create_task(client_events(client, request("answered", [1], max_tokens=50)))
        await wait_until(lambda: client._shared is not None and client._shared.inboxes["answered"].is_answered)
        unanswered = await asyncio.wait_for(client_events(client, request("unanswered", [2])), 5.0)
        # Nothing of it runs at the scheduler: a pool may send it to another one (router/scheduler_pool.py).
        assert unanswered == ([], GenerateError("unavailable", "scheduler: Internal error from Core"))
        assert await asyncio.wait_for(answered, 5.0) == (
            [7], GenerateError("internal", "scheduler: Internal error from Core"))
    finally:
        await client.close()
        await server.stop(None)


async def test_draining_ends_the_streams_with_unavailable_without_waiting_for_the_grace():
    async with running_stack(step_delay_s=0.02) as (server, stub, client, _, engine):
        tasks = [asyncio.create_task(client_events(client, request(f"d{i}", [i + 1], max_tokens=500)))
                 for i in range(3)]
        await wait_until(lambda: engine.stats().num_running == 3)
        loop = asyncio.get_running_loop()
        started_s = loop.time()
        await stop_server(server, engine, grace_s=3.0)
        assert loop.time() - started_s < 2.0  # the shared call ended by itself once its requests were over
        for tokens, last in await asyncio.wait_for(asyncio.gather(*tasks), 5.0):
            assert last == GenerateError("unavailable", "the scheduler is shutting down")


async def start_older_scheduler(engine) -> tuple[grpc.aio.Server, int]:
    """An older scheduler in front of `engine`: Generate and GetStats, no GenerateStreams; (server, port)."""
    servicer = SchedulerServicer(engine)
    server = grpc.aio.server()
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=scheduler_pb2.GenerateRequest.FromString,
            response_serializer=scheduler_pb2.GenerateResponse.SerializeToString),
        "GetStats": grpc.unary_unary_rpc_method_handler(
            servicer.GetStats, request_deserializer=scheduler_pb2.StatsRequest.FromString,
            response_serializer=scheduler_pb2.SchedulerStats.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("segserve.v1.Scheduler", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def test_a_scheduler_without_generate_streams_gets_one_generate_call_per_request():
    async with running_stack() as (_, _, _, _, engine):
        old_server, port = await start_older_scheduler(engine)
        client = SchedulerClient(f"127.0.0.1:{port}")
        try:
            results = await asyncio.gather(*(client_events(client, request(f"o{i}", [i + 1], max_tokens=3))
                                             for i in range(3)))
            assert [tokens for tokens, _ in results] == [[i + 2, i + 3, i + 4] for i in range(3)]
            assert all(isinstance(last, GenerateComplete) for _, last in results)
            assert client.is_per_request
            tokens, last = await client_events(client, request("later", [7], max_tokens=2), timeout_s=5.0)
            assert tokens == [8, 9] and isinstance(last, GenerateComplete)
            events = client.generate(request("cut", [1], max_tokens=1000))
            assert isinstance(await anext(events), TokenChunk)
            await events.aclose()
            stats = await client.get_stats()
            await wait_until(lambda: engine.stats().num_running == 0, timeout_s=2.0)
            assert stats.num_total_kv_blocks > 0
        finally:
            await client.close()
            await old_server.stop(None)


@pytest.mark.parametrize("timeout_s, timeout_ms", [(None, 0), (0.25, 250), (0.0001, 1)])
def test_start_stream_round_trips_its_deadline(timeout_s, timeout_ms):
    from protos.segserve.v1.generate import stream_action_from_pb

    start = StartStream(request("x", [1, 2]), timeout_s)
    pb = start.to_pb()
    assert pb.start.timeout_ms == timeout_ms
    back = stream_action_from_pb(pb)
    assert back.request == start.request and back.timeout_s == (timeout_ms / 1000 if timeout_ms else None)
    assert stream_action_from_pb(CancelStream("x").to_pb()) == CancelStream("x")
    assert stream_action_from_pb(scheduler_pb2.StreamsRequest()) is None


async def test_the_paced_bench_scheduler_sends_one_message_per_tick_for_all_its_streams(tiny_gemma3_dir):
    from segserve.bench.paced_scheduler import PacedScheduler, load_tokenizer

    paced = PacedScheduler(load_tokenizer(str(tiny_gemma3_dir)), token_interval_s=0.005)
    server = await serve(scheduler_pb2_grpc.add_SchedulerServicer_to_server, paced)
    client = SchedulerClient(f"127.0.0.1:{server.bound_port}")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            raw = RawCall(stub)
            for i in range(8):
                raw.send(StartStream(request(f"p{i}", [1, 2], max_tokens=6)))
            events = await raw.read_until_ended({f"p{i}" for i in range(8)})
            expected, _ = await collect(stub, request("one", [1, 2], max_tokens=6).to_pb())
            assert len(expected) == 6
            for i in range(8):
                *chunks, last = events[f"p{i}"]
                assert [t for c in chunks for t in c.token_ids] == expected
                assert isinstance(last, GenerateComplete) and last.num_generated_tokens == 6
            assert raw.num_messages < sum(len(e) for e in events.values()) // 4
            raw.send(None)
            assert await asyncio.wait_for(raw.call.read(), 2.0) is grpc.aio.EOF
            tokens, last = await client_events(client, request("c", [3], max_tokens=4), timeout_s=5.0)
            assert tokens == expected[:4] and isinstance(last, GenerateComplete)
            assert not client.is_per_request and paced.num_running == 0
    finally:
        await client.close()
        await server.stop(None)


def test_a_step_of_many_logprob_chunks_goes_out_as_several_bounded_messages():
    from protos.segserve.v1.step_result import TopLogprobs
    from scheduler.streams import split_messages

    top = tuple(TopLogprobs(tuple(range(20)), tuple(-0.5 for _ in range(20))) for _ in range(50))
    heavy = TokenChunk(tuple(range(50)), (0.0,) * 50, top)
    events = [(f"h{i}", heavy if i % 2 else TokenChunk((i,), (0.0,))) for i in range(40)]
    size = heavy.to_pb().ByteSize()
    messages = split_messages(events, max_heavy_bytes=3 * size)
    assert len(messages) == 7  # 20 heavy chunks, 3 per message
    assert [(e.request_id, e.event) for m in messages for e in m.events] == [(rid, ev.to_pb()) for rid, ev in events]
    assert all(m.ByteSize() < 4 * size for m in messages)
    assert len(split_messages(events[:1] * 100)) == 1  # plain token chunks: one message
