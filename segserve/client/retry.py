"""When a failed call is tried again, and after how long.

UNAVAILABLE (no scheduler, a connection that failed) and RESOURCE_EXHAUSTED (a full queue) are transient, so
they are retried, at most `max_attempts` calls in all and never past the call's deadline. The wait before
retry k (1, 2, ...) is the server's `retry-after-ms` when it sent one, spread by up to `jitter` of it beyond
(never sooner than asked); otherwise exponential backoff (common/backoff.py), min(initial * multiplier^(k-1),
max), less up to `jitter` of it, so that callers refused together do not all come back together. A stream is
retried only before its first event: after that a retry would repeat text the caller already has.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from common.backoff import Backoff
from segserve.client.errors import SegserveError

RETRYABLE_CODES = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED"})


@dataclass(frozen=True)
class RetryPolicy:
    """How a client retries transient failures. RetryPolicy(max_attempts=1) never retries."""

    max_attempts: int = 4
    """Calls in all, the first included."""
    initial_backoff_s: float = 0.1
    """Wait before the first retry when the server gave no retry-after-ms."""
    max_backoff_s: float = 5.0
    """Longest backoff the client picks itself (a server's retry-after-ms is honoured as given)."""
    multiplier: float = 2.0
    """Growth of the backoff from one retry to the next."""
    jitter: float = 0.5
    """Fraction of the wait drawn at random, in [0, 1]."""
    retryable_codes: frozenset[str] = RETRYABLE_CODES
    """gRPC status names retried."""
    _backoff: Backoff = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.initial_backoff_s <= 0:
            raise ValueError("initial_backoff_s must be > 0")
        object.__setattr__(self, "_backoff", Backoff(self.initial_backoff_s, self.max_backoff_s, self.multiplier,
                                                     self.jitter))  # checks the rest

    def delay_s(self, retry_number: int, retry_after_s: float | None, draw: float) -> float:
        """The wait before retry `retry_number` (1 = the first), `draw` uniform in [0, 1)."""
        if retry_after_s is not None:
            return retry_after_s * (1 + self.jitter * draw)
        return self._backoff.delay_s(retry_number, draw)

    def next_delay_s(self, error: SegserveError, num_attempts: int, remaining_s: float | None,
                     rng: random.Random) -> float | None:
        """The wait before trying again after `num_attempts` calls ended with `error`; None to give up (a code
        not retried, no attempt left, or a wait that would end past the deadline, `remaining_s` away)."""
        if error.code not in self.retryable_codes or num_attempts >= self.max_attempts:
            return None
        delay = self.delay_s(num_attempts, error.retry_after_s, rng.random())
        if remaining_s is not None and delay >= remaining_s:
            return None
        return delay
