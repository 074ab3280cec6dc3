"""Where an asyncio gRPC service runs a blocking call: on the event loop when it should be short, else in a thread.

A leaf module (stdlib only), so every service may import it. A call handed to a thread (`asyncio.to_thread`)
leaves the loop free to answer Health while it runs, but the hand-off is not free: the loop's thread and the
call's take turns at the GIL. Measured on the 2-core CPU through the whole stack, the worker's one-stream decode
step of the tiny model (about 1.9 ms of work) took 2.5-2.8 ms in a thread and 1.9-2.0 on the loop; one stream
went from 305 and 375 to 344 and 449 tok/s through the router, 64 streams from 6,234 and 6,001 to 8,275 and
7,157 (two alternated pairs).

So `run_blocking` runs a call on the loop when `CallCost` expects it to end within INLINE_MAX_S (the loop, and
Health with it, waits at most about that long), and in a thread otherwise. The guess is the last call's seconds
per unit of work (scheduled tokens, queries) times this call's units; a call with more units than any before
goes to a thread (it may be slower per unit: a compiled worker compiles a new shape), as does the first.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

INLINE_MAX_S = 0.02
"""A call expected to take less than this runs on the event loop's thread."""

T = TypeVar("T")


class CallCost:
    """Guesses a call's seconds from the last one's, per unit of work."""

    def __init__(self) -> None:
        self.seconds_per_unit: float | None = None
        self.most_units = 0
        """The most units a call has had."""

    def is_short(self, num_units: int) -> bool:
        """Whether a call of num_units should take under INLINE_MAX_S."""
        if self.seconds_per_unit is None or num_units > self.most_units:
            return False
        return self.seconds_per_unit * num_units < INLINE_MAX_S

    def observe(self, num_units: int, seconds: float) -> None:
        if num_units > 0:  # a call with no work says nothing about the cost of work
            self.seconds_per_unit = seconds / num_units
            self.most_units = max(self.most_units, num_units)


async def run_blocking(cost: CallCost, num_units: int, call: Callable[..., T], *args,
                       executor: Executor | None = None) -> tuple[T, float]:
    """call(*args) on the loop if cost expects it short, else in a thread of `executor` (None: asyncio's default
    one, as asyncio.to_thread), in this context (its trace span, say); its result and seconds (observed)."""
    start = time.perf_counter()
    if cost.is_short(num_units):
        result = call(*args)
    else:
        result = await in_thread(executor, call, *args)
    seconds = time.perf_counter() - start
    cost.observe(num_units, seconds)
    return result, seconds


async def in_thread(executor: Executor | None, call: Callable[..., T], *args) -> T:
    """call(*args) in a thread of `executor` (None: asyncio's default one), in this context: asyncio.to_thread with
    an executor of the caller's choosing."""
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(context.run, call, *args))
