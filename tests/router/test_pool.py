"""The router over several schedulers: load and prefix affinity, retries, a dead scheduler, the live set."""

from __future__ import annotations

import asyncio

import pytest

from protos.segserve.v1.generate import GenerateComplete, GenerateError, GenerateRequest, TokenChunk
from protos.segserve.v1.sampling import SamplingParams, StoppingCriteria
from common.discovery import parse_targets
from router.scheduler_pool import SchedulerPool
from tests.support.fake_scheduler import start_fake_scheduler
from tests.router.test_server import tokenizer  # noqa: F401 (fixture)


@pytest.fixture
def schedulers(tokenizer):  # noqa: F811
    started = [start_fake_scheduler(tokenizer) for _ in range(2)]
    yield [(server, fake, f"127.0.0.1:{port}") for server, fake, port in started]
    for server, _, _ in started:
        server.stop(grace=None)


def request(tokenizer, text: str, request_id: str, max_tokens: int = 6) -> GenerateRequest:  # noqa: F811
    ids = tuple(tokenizer(text, add_special_tokens=False).input_ids)
    return GenerateRequest(request_id, ids, SamplingParams(), StoppingCriteria(max_tokens=max_tokens))


async def run(pool: SchedulerPool, req: GenerateRequest) -> list:
    return [event async for event in pool.generate(req)]


async def test_requests_spread_over_the_schedulers_and_a_prompt_prefix_stays_on_one(tokenizer, schedulers):  # noqa: F811
    pool = SchedulerPool([address for _, _, address in schedulers], slack=100)
    prompts = [f"System: you are a helpful assistant. User {i}: tell me about the history of the printing press, "
               f"the movable type and how it spread over Europe" for i in range(32)]
    for i, text in enumerate(prompts):
        events = await run(pool, request(tokenizer, text, f"a{i}"))
        assert isinstance(events[-1], GenerateComplete)
    counts = [len(fake.requests) for _, fake, _ in schedulers]
    # The schedulers' ports are random, so the split is too: at most 3 of 32 on one has odds of 3 in a million.
    assert min(counts) >= 4 and sum(counts) == 32
    owner = pool.pick(request(tokenizer, prompts[0], "x").prompt_token_ids)
    for turn in range(3):  # the same history, longer each turn, goes to the same scheduler
        ids = request(tokenizer, prompts[0] + " Assistant: it began in Mainz. User: and then?" * turn,
                      "x").prompt_token_ids
        assert len(ids) >= 16 and pool.pick(ids) == owner
    await pool.close()


async def test_a_busy_affinity_scheduler_gives_way_to_the_least_busy_one(tokenizer, schedulers):  # noqa: F811
    pool = SchedulerPool([address for _, _, address in schedulers], slack=1)
    ids = request(tokenizer, "some shared prefix", "x").prompt_token_ids
    owner = pool.pick(ids)
    other = next(address for _, _, address in schedulers if address != owner)
    pool._in_flight[owner] = 5
    assert pool.pick(ids) == other
    pool._in_flight[owner] = 1
    assert pool.pick(ids) == owner
    await pool.close()


async def test_a_refusing_or_dead_scheduler_is_skipped_without_failing_a_request(tokenizer, schedulers):  # noqa: F811
    (server_a, fake_a, a), (_, fake_b, b) = schedulers
    fake_a.is_refusing = True
    pool = SchedulerPool([a, b])
    for i in range(6):
        events = await run(pool, request(tokenizer, f"prompt {i}", f"r{i}"))
        assert isinstance(events[-1], GenerateComplete) and not any(isinstance(e, GenerateError) for e in events)
    assert len(fake_b.requests) == 6
    fake_a.is_refusing = False
    # prompts that a owns, so that each would go there first (which prompts those are depends on the ports)
    again = [request(tokenizer, f"again {i}", f"s{i}") for i in range(200)]
    owned_by_a = [req for req in again if pool.pick(req.prompt_token_ids) == a]
    assert len(owned_by_a) >= 6
    server_a.stop(grace=None)  # dies: requests that would go there never reach it and go to b
    for req in owned_by_a[:6]:
        events = await run(pool, req)
        assert isinstance(events[-1], GenerateComplete)
    assert len(fake_b.requests) == 12 and pool.live == [b]
    health = await pool.health()
    assert health.is_ready and "1 of 2" in health.detail
    await pool.close()


async def test_a_stream_under_way_when_its_scheduler_dies_ends_with_an_error_event(tokenizer, schedulers):  # noqa: F811
    (server_a, _, a), (_, _, b) = schedulers
    pool = SchedulerPool([a])
    events = []

    async def consume():
        async for event in pool.generate(request(tokenizer, "SLOW stream", "slow", max_tokens=200)):
            events.append(event)

    task = asyncio.create_task(consume())
    while not any(isinstance(e, TokenChunk) for e in events):
        await asyncio.sleep(0.02)
    server_a.stop(grace=None)
    await asyncio.wait_for(task, timeout=10)
    assert isinstance(events[-1], GenerateError) and events[-1].code in ("unavailable", "cancelled", "internal")
    await pool.close()


async def test_no_scheduler_at_all_is_a_clean_error_and_stats_add_up(tokenizer, schedulers):  # noqa: F811
    (server_a, _, a), (server_b, _, b) = schedulers
    pool = SchedulerPool([a, b])
    stats = await pool.get_stats()
    assert stats.num_total_kv_blocks == 128  # both fakes' 64
    server_a.stop(grace=None)
    server_b.stop(grace=None)
    events = await run(pool, request(tokenizer, "anyone there?", "n"))
    assert len(events) == 1 and isinstance(events[0], GenerateError) and events[0].code == "unavailable"
    assert not (await pool.health()).is_ready
    await pool.close()


async def test_a_new_request_waits_for_a_restarting_scheduler_within_retry_s(tokenizer, schedulers):  # noqa: F811
    (server_a, _, a), _ = schedulers
    port = int(a.rsplit(":", 1)[1])
    server_a.stop(grace=None)
    pool = SchedulerPool([a], retry_s=20)
    restarted = []

    async def restart_later():
        await asyncio.sleep(1.0)  # the request below has been refused a few times by then
        restarted.append(start_fake_scheduler(tokenizer, port=port))

    restart = asyncio.create_task(restart_later())
    events = await run(pool, request(tokenizer, "are you back?", "back"))
    await restart
    server, fake, _ = restarted[0]
    assert isinstance(events[-1], GenerateComplete) and [r.request_id for r in fake.requests] == ["back"]
    server.stop(grace=None)
    gone = SchedulerPool([a], retry_s=0.5)  # nobody comes back: the error, once retry_s is spent
    started = asyncio.get_running_loop().time()
    events = await run(gone, request(tokenizer, "anyone?", "gone"))
    assert [e.code for e in events] == ["unavailable"]
    assert 0.4 <= asyncio.get_running_loop().time() - started < 5
    await pool.close()
    await gone.close()


def test_scheduler_targets_are_comma_separated():
    assert parse_targets("a:1, dns:///s:2", "--scheduler-address") == ["a:1", "dns:///s:2"]
    with pytest.raises(ValueError, match="--scheduler-address names no replica"):
        parse_targets(" , ", "--scheduler-address")
