"""Exponential back-off: the one rule every retry in segserve waits by.

The wait before retry k (k = 1, 2, ...) is min(initial_s * multiplier^(k-1), max_s), less up to
`jitter` of it drawn at random, so that callers refused together do not all come back together.
Used by the client's RetryPolicy, the router's scheduler pool, the scheduler's drafter replicas,
the supervisor's restarts and the reflow consumer's sink writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_MAX_EXP = 700.0
"""Powers up to e^700 are computed as they are; past it, through logs (a float ends near e^709)."""


@dataclass(frozen=True)
class Backoff:
    initial_s: float
    """The wait before the first retry."""
    max_s: float
    """The longest wait."""
    multiplier: float = 2.0
    """Growth of the wait from one retry to the next."""
    jitter: float = 0.0
    """Fraction of the wait drawn at random, in [0, 1]."""

    def __post_init__(self) -> None:
        if not 0 <= self.initial_s <= self.max_s:
            raise ValueError(f"a back-off needs 0 <= initial ({self.initial_s}) <= max ({self.max_s})")
        if self.multiplier < 1:
            raise ValueError(f"a back-off's multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"a back-off's jitter must be in [0, 1], got {self.jitter}")

    def delay_s(self, retry_number: int, draw: float = 0.0) -> float:
        """The wait before retry `retry_number` (1 = the first; less than 1 counts as 1), `draw` uniform in
        [0, 1) taking the jitter's share."""
        growth = max(0, retry_number - 1) * math.log(self.multiplier)  # the power's log: it may pass a float's range
        if self.initial_s == 0:
            wait_s = 0.0
        elif growth > _MAX_EXP:
            wait_s = min(self.max_s, math.exp(min(_MAX_EXP, math.log(self.initial_s) + growth)))
        else:
            wait_s = min(self.max_s, self.initial_s * self.multiplier ** max(0, retry_number - 1))
        return wait_s * (1 - self.jitter * draw)
