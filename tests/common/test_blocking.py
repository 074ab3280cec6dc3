"""common/blocking.py: a blocking call runs on the event loop when the last one says it is short, else in a
thread (the worker's steps and the drafter's batches; the worker's servicer is tested in
tests/worker/test_server.py)."""

from __future__ import annotations

import threading
import time

from common.blocking import INLINE_MAX_S, CallCost, run_blocking


def test_call_cost_guesses_from_the_last_call_per_unit():
    cost = CallCost()
    assert not cost.is_short(1)  # nothing measured yet
    cost.observe(10, INLINE_MAX_S / 100)
    assert cost.is_short(10) and cost.is_short(0)
    assert not cost.is_short(11)  # more units than any call so far: maybe a compile, maybe slower per unit
    cost.observe(0, 100.0)  # a call that computed nothing says nothing about its units' cost
    assert cost.is_short(10)
    cost.observe(2, INLINE_MAX_S)
    assert not cost.is_short(2) and cost.is_short(1)


async def test_run_blocking_runs_short_calls_on_the_loop_and_long_ones_in_a_thread():
    cost = CallCost()

    def call(seconds: float) -> threading.Thread:
        time.sleep(seconds)
        return threading.current_thread()

    loop_thread = threading.current_thread()
    first, _ = await run_blocking(cost, 1, call, 0.0)  # nothing measured yet
    second, _ = await run_blocking(cost, 1, call, 2 * INLINE_MAX_S)  # measured short: on the loop
    third, seconds = await run_blocking(cost, 1, call, 0.0)  # the last one took too long: a thread
    assert first is not loop_thread and second is loop_thread and third is not loop_thread
    assert seconds < INLINE_MAX_S and cost.is_short(1)
