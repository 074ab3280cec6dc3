"""The hand-over between a request's gRPC reader and its consumer (scheduler_streams.Inbox): events come out in
order and all at once; a wait with nothing to take ends empty after its own keep-alive timeout, however
many waits came before it (the timer is kept across waits, not set per wait)."""

from __future__ import annotations

import asyncio

from router.scheduler_streams import Inbox as _Inbox

TIMEOUT_S = 0.05
SLACK_S = 0.002  # the event loop may run a timer up to its clock resolution early


async def test_events_come_out_in_order_and_together():
    inbox = _Inbox()
    inbox.put("a")
    inbox.put("b")
    assert await inbox.take(TIMEOUT_S) == ["a", "b"]
    waiting = asyncio.ensure_future(inbox.take(TIMEOUT_S))
    await asyncio.sleep(0)
    inbox.put("c")
    assert await waiting == ["c"]
    inbox.close()


async def test_an_idle_wait_ends_empty_after_its_timeout():
    loop = asyncio.get_running_loop()
    inbox = _Inbox()
    started = loop.time()
    assert await inbox.take(TIMEOUT_S) == []
    assert loop.time() - started >= TIMEOUT_S - SLACK_S
    inbox.put("x")
    assert await inbox.take(TIMEOUT_S) == ["x"]
    inbox.close()


async def test_a_wait_after_busy_waits_gets_its_full_timeout():
    loop = asyncio.get_running_loop()
    inbox = _Inbox()
    for index in range(5):  # events keep coming for longer than one timeout: no keep-alive meanwhile
        waiting = asyncio.ensure_future(inbox.take(TIMEOUT_S))
        await asyncio.sleep(TIMEOUT_S / 3)
        inbox.put(index)
        assert await waiting == [index]
    await asyncio.sleep(TIMEOUT_S / 2)  # the timer set by the first wait has fired by now, unused
    started = loop.time()
    assert await inbox.take(TIMEOUT_S) == []
    assert loop.time() - started >= TIMEOUT_S - SLACK_S
    inbox.close()


async def test_a_shorter_timeout_is_not_held_up_by_an_earlier_longer_one():
    loop = asyncio.get_running_loop()
    inbox = _Inbox()
    waiting = asyncio.ensure_future(inbox.take(10.0))
    await asyncio.sleep(0)
    inbox.put("a")
    assert await waiting == ["a"]
    started = loop.time()
    assert await inbox.take(TIMEOUT_S) == []
    assert TIMEOUT_S - SLACK_S <= loop.time() - started < 5.0
    inbox.close()
