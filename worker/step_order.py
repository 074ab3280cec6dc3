"""Steps ahead run after the step they follow (async scheduling), in whichever order their RPCs arrive.

A scheduler with async scheduling sends step B while step A still runs; B's continuations compute the
tokens A samples, so B must run after A. Over one StepStream they arrive in order; as two Step calls, B can
reach the worker's step lock first (a small B converts from protobuf faster than a large A, and gRPC does not
order calls).
B names A (`StepRequest.follows_step_id`); the servicer handles each step inside `handling`, which marks
its arrival and its end, and waits in `after` for the step it follows.

A followed step that never arrives (its RPC was cancelled or lost) holds its follower back for at most
`arrival_timeout_s`; the follower then runs, its continuations are refused, and the scheduler recomputes
those sequences (slower, never wrong). Once arrived, the followed step is waited for until it ends: its
own deadline bounds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator

logger = logging.getLogger(__name__)


class _Step:
    __slots__ = ("arrived", "finished")

    def __init__(self) -> None:
        self.arrived = asyncio.Event()
        self.finished = asyncio.Event()


class StepOrder:
    """The arrival and the end of recent step ids (the last `max_remembered`; create it on the serving loop)."""

    def __init__(self, arrival_timeout_s: float = 1.0, max_remembered: int = 256):
        self.arrival_timeout_s = arrival_timeout_s
        self.max_remembered = max_remembered
        self.num_timed_out = 0
        """Followers that ran without their followed step having arrived (their continuations recompute)."""
        self._steps: OrderedDict[int, _Step] = OrderedDict()

    @contextlib.contextmanager
    def handling(self, step_id: int) -> Iterator[None]:
        """Around the whole handling of step `step_id` (0: no id): it has arrived on entry, and it has finished,
        run or failed, on exit."""
        if step_id:
            self._get(step_id).arrived.set()
        try:
            yield
        finally:
            if step_id:
                step = self._get(step_id)
                step.arrived.set()  # its entry may have been evicted meanwhile
                step.finished.set()

    def has_arrived(self, step_id: int) -> bool:
        step = self._steps.get(step_id)
        return step is not None and step.arrived.is_set()

    async def after(self, follows_step_id: int) -> None:
        """Return once step `follows_step_id` finished (at once for 0), or it did not arrive in time."""
        if not follows_step_id:
            return
        step = self._get(follows_step_id)
        if not step.arrived.is_set():
            try:
                async with asyncio.timeout(self.arrival_timeout_s):
                    await step.arrived.wait()
            except TimeoutError:
                self.num_timed_out += 1
                logger.warning("step %d did not arrive within %.1f s; its follower runs without it",
                               follows_step_id, self.arrival_timeout_s)
                return
        await step.finished.wait()

    def _get(self, step_id: int) -> _Step:
        step = self._steps.get(step_id)
        if step is None:
            step = self._steps[step_id] = _Step()
            while len(self._steps) > self.max_remembered:  # the oldest ids: long finished, nobody waits on them
                self._steps.popitem(last=False)
        return step
