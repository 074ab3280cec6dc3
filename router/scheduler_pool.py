"""Several schedulers behind the one client interface the routes use (scheduler_client.SchedulerApi).

In: the scheduler targets (`host:port`, or `dns:///name:port` resolving to every replica; re-resolved
every `refresh_s`). Out: the same calls as one SchedulerClient (open, get_info, get_stats, health,
wait_ready, close), served by the pool.

- Placement: a request goes to the scheduler its prompt's first tokens (`affinity_key`) hash to (rendezvous hashing
  over the live schedulers), so the turns of a chat, which resend the same history, land where that
  history's KV blocks are cached; unless that scheduler is busier than the least busy one by more than
  `slack` requests, in which case the least busy one takes it. Busy = its running + waiting requests
  from its stats (polled every `stats_interval_s`), or this router's requests in flight there when
  that is more.
- Retries: a request that a scheduler refuses (queue full) or that never reached it (unavailable)
  before any token came back is sent to another one; a scheduler that was unavailable is left out
  until its stats answer again. When no other one is left, an unavailable request is tried again, with
  back-off, for up to `retry_s` (a scheduler restarting, or waiting for a worker to come back, takes it
  then). A stream already under way when its scheduler dies ends with the error event, as with one
  scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Sequence
from itertools import zip_longest

from protos.segserve.v1.generate import GenerateError, GenerateEvent, GenerateRequest
from protos.segserve.v1.info import Health, WorkerInfo
from router.scheduler_client import SchedulerApi, SchedulerClient, SchedulerLoad, SegmentLoad, SpecTotals
from router.scheduler_streams import ReadyStream, RequestStream, terminal_index
from common.backoff import Backoff
from common.discovery import is_dns_target, membership_changes, place
from common.tls import TlsFiles

logger = logging.getLogger(__name__)
RETRIED_CODES = ("overloaded", "unavailable")
_RETRY_BACKOFF = Backoff(0.1, 1.0)
"""The waits before an unavailable request tries every scheduler again: 0.1 s, doubling, at most 1 s."""


class SchedulerPool(SchedulerApi):
    """A SchedulerClient per scheduler (mutual TLS with `tls`); create it on the event loop that uses it (start()
    begins polling)."""

    def __init__(self, targets: Sequence[str], refresh_s: float = 10.0, stats_interval_s: float = 0.5,
                 slack: int = 4, tls: TlsFiles | None = None, retry_s: float = 0.0):
        self.targets = list(targets)
        self.retry_s = retry_s
        """How long a request that every scheduler answered `unavailable` is tried again (0 = not)."""
        self.tls = tls
        self.refresh_s = refresh_s
        self.stats_interval_s = stats_interval_s
        self.slack = slack
        self._clients: dict[str, SchedulerClient] = {}
        if not any(is_dns_target(t) for t in self.targets):
            self._clients = {address: SchedulerClient(address, tls) for address in dict.fromkeys(self.targets)}
        self._loads: dict[str, SchedulerLoad] = {}
        self._live: set[str] = set(self._clients)
        self._in_flight: Counter[str] = Counter()
        self._poller: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return ",".join(self.targets)

    @property
    def addresses(self) -> list[str]:
        return sorted(self._clients)

    @property
    def live(self) -> list[str]:
        return sorted(self._live)

    def start(self) -> None:
        """Begin resolving targets and polling every scheduler's stats in the background."""
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll_forever())

    def open(self, request: GenerateRequest, timeout_s: float | None = None) -> RequestStream:
        """One request's events from the scheduler chosen for it; refused or unreachable ones are retried."""
        return _PoolStream(self, request, timeout_s)

    def pick(self, prompt_token_ids: Sequence[int], exclude: set[str] = frozenset()) -> str | None:
        """The scheduler for a prompt: its affinity choice unless that one is too busy, then the least busy;
        None when every scheduler is excluded. Schedulers not known to be live are used when no live one is
        left."""
        candidates = [a for a in self._live if a in self._clients and a not in exclude]
        candidates = candidates or [a for a in self._clients if a not in exclude]
        return place(prompt_token_ids, {a: (self._busy(a),) for a in candidates}, self.slack)

    def _busy(self, address: str) -> int:
        load = self._loads.get(address)
        polled = load.num_running + load.num_waiting if load is not None else 0
        return max(polled, self._in_flight[address])

    async def get_info(self, timeout_s: float = 5.0) -> WorkerInfo:
        """The served model's facts, from a live scheduler (all schedulers serve one model)."""
        last: Exception | None = None
        for address in self.live or self.addresses:
            try:
                return await self._clients[address].get_info(timeout_s)
            except Exception as exc:
                last = exc
        raise last or ConnectionError("no scheduler known yet")

    async def get_stats(self, timeout_s: float = 2.0) -> SchedulerLoad:
        """The live schedulers' stats, added up (raises when none answers)."""
        await self._poll_stats(timeout_s)
        loads = [self._loads[a] for a in self.live if a in self._loads]
        if not loads:
            raise ConnectionError("no scheduler answered GetStats")
        return _total(loads)

    async def health(self, timeout_s: float = 2.0) -> Health:
        """Ready when any scheduler is; with several, the detail names how many are."""
        addresses = self.addresses
        if not addresses:
            return Health(False, "no scheduler found")
        healths = await asyncio.gather(*(self._clients[a].health(timeout_s) for a in addresses))
        if len(healths) == 1:
            return healths[0]
        ready = [a for a, h in zip(addresses, healths) if h.is_ready]
        if ready:
            return Health(True, f"{len(ready)} of {len(addresses)} schedulers ready")
        return Health(False, "; ".join(f"{a}: {h.detail or 'not ready'}" for a, h in zip(addresses, healths)))

    async def wait_ready(self, timeout_s: float, retry_interval_s: float = 0.5) -> WorkerInfo:
        """Resolve the targets and retry GetInfo until one scheduler answers; TimeoutError after timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            await self._refresh()
            try:
                return await self.get_info(timeout_s=max(0.1, min(5.0, deadline - loop.time())))
            except Exception as exc:
                if loop.time() + retry_interval_s >= deadline:
                    raise TimeoutError(f"no scheduler at {self.address} answered GetInfo within {timeout_s:.0f}s "
                                       f"(last error: {exc})") from exc
            await asyncio.sleep(retry_interval_s)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        for client in self._clients.values():
            await client.close()

    async def _poll_forever(self) -> None:
        loop = asyncio.get_running_loop()
        next_refresh = loop.time() + self.refresh_s
        while True:
            if loop.time() >= next_refresh:
                next_refresh = loop.time() + self.refresh_s
                await self._refresh()
            await self._poll_stats(min(2.0, 4 * self.stats_interval_s))
            await asyncio.sleep(self.stats_interval_s)

    async def _poll_stats(self, timeout_s: float) -> None:
        """Ask every scheduler for its stats; those that answer are live, the others not."""
        addresses = self.addresses
        results = await asyncio.gather(*(self._clients[a].get_stats(timeout_s) for a in addresses),
                                       return_exceptions=True)
        for address, result in zip(addresses, results):
            if isinstance(result, BaseException):
                if address in self._live:
                    logger.warning("scheduler %s does not answer: %s", address, result)
                self._live.discard(address)
                self._loads.pop(address, None)
            else:
                if address not in self._live:
                    logger.info("scheduler %s is live", address)
                self._live.add(address)
                self._loads[address] = result

    async def _refresh(self) -> None:
        """Resolve the DNS targets again; add new schedulers, drop gone ones."""
        if not any(is_dns_target(t) for t in self.targets):
            return
        joined, left = await membership_changes(self.targets, self._clients)
        for address, name in joined.items():
            self._clients[address] = SchedulerClient(address, self.tls, name)
            self._live.add(address)
        for address in left:
            if self._in_flight[address] == 0:
                self._live.discard(address)
                await self._clients.pop(address).close()


class _PoolStream:
    """A request on the pool: the stream of the scheduler it was placed on, or, when that one refused it or was
    unreachable before any token came back, of the next one."""

    def __init__(self, pool: SchedulerPool, request: GenerateRequest, timeout_s: float | None) -> None:
        self._pool = pool
        self._request = request
        self._timeout_s = timeout_s
        self._tried: set[str] = set()
        self._retry_deadline = time.monotonic() + pool.retry_s
        self._num_waits = 0
        """Times this request waited to try every scheduler again."""
        self._is_started = False
        self._address: str | None = None
        """The scheduler of the current attempt, counted in flight there until it is closed."""
        self._stream: RequestStream = self._next()

    def _next(self) -> RequestStream:
        pool = self._pool
        address = pool.pick(self._request.prompt_token_ids, exclude=self._tried)
        if address is None:
            return ReadyStream([GenerateError("unavailable", "no scheduler is available")])
        self._tried.add(address)
        pool._in_flight[address] += 1
        self._address = address
        return pool._clients[address].open(self._request, self._timeout_s)

    async def take(self, timeout_s: float | None = None) -> list[GenerateEvent]:
        while True:
            events = await self._stream.take(timeout_s)
            if self._is_started:
                return events
            index = terminal_index(events)
            if index != 0:  # a token came (or nothing yet)
                self._is_started = bool(events)
                return events
            error = events[0]
            pool = self._pool
            if not (isinstance(error, GenerateError) and error.code in RETRIED_CODES):
                return events
            if pool.pick(self._request.prompt_token_ids, exclude=self._tried) is None:
                if not (error.code == "unavailable" and await self._wait_to_retry()):
                    return events
                self._tried.clear()
            if error.code == "unavailable":
                pool._live.discard(self._address)
            logger.info("scheduler %s: %s; retrying request %s", self._address, error.message,
                        self._request.request_id)
            await self._close_attempt()
            self._stream = self._next()

    async def _wait_to_retry(self) -> bool:
        """Back off before trying every scheduler again; False once retry_s is spent."""
        self._num_waits += 1
        wait_s = min(_RETRY_BACKOFF.delay_s(self._num_waits), self._retry_deadline - time.monotonic())
        if wait_s <= 0:
            return False
        await asyncio.sleep(wait_s)
        return True

    async def _close_attempt(self) -> None:
        try:
            await self._stream.close()
        finally:
            if self._address is not None:
                self._pool._in_flight[self._address] -= 1
                self._address = None

    async def close(self) -> None:
        await self._close_attempt()


def _total(loads: list[SchedulerLoad]) -> SchedulerLoad:
    """Field-wise sums (per-depth acceptance counts added position by position); a segment drafts, and the
    gate is open (overall and per segment kind), where any scheduler says so; every scheduler's drafter replicas,
    each address once."""
    numbers = {f.name: sum(getattr(load, f.name) for load in loads)
               for f in dataclasses.fields(SchedulerLoad) if f.name not in ("spec", "segments", "drafters")}
    gate = max(((load.spec.is_gate_open, load.spec.gate_batch_bucket) for load in loads), default=(False, 0))
    spec = SpecTotals(
        sum(load.spec.num_drafts for load in loads), sum(load.spec.num_draft_tokens for load in loads),
        sum(load.spec.num_accepted_tokens for load in loads),
        tuple(sum(depth) for depth in zip_longest(*(load.spec.num_accepted_by_position for load in loads),
                                                   fillvalue=0)), gate[1], gate[0])
    segments: dict[str, list] = {}
    for segment in (s for load in loads for s in load.segments):
        counts = segments.setdefault(segment.segment, [0, 0, 0, 0, 0, False])
        for i, value in enumerate((segment.num_drafts, segment.num_draft_tokens, segment.num_accepted_tokens)):
            counts[i] += value
        counts[3] = max(counts[3], segment.num_budget_nodes)
        if (segment.is_gate_open, segment.gate_batch_bucket) > (counts[5], counts[4]):  # open, then the larger bucket
            counts[4:] = segment.gate_batch_bucket, segment.is_gate_open
    drafters = {d.address: d for load in loads for d in load.drafters}
    return SchedulerLoad(spec=spec, segments=tuple(SegmentLoad(name, *counts) for name, counts in sorted(
        segments.items())), drafters=tuple(drafters[a] for a in sorted(drafters)), **numbers)
