"""Data parallelism: one scheduler driving several workers, each with its own KV pool and its own Engine.

In: requests from the gRPC servicer (the same calls as one Engine: add_request, abort, stats, health,
info). Out: each request runs on one worker's Engine, which steps concurrently with the others (each
engine is its own asyncio task waiting on its own worker).

- Placement: a request goes to the worker its prompt's first tokens hash to (rendezvous over the
  connected workers), so a session's later turns find their prefix in that worker's cache, unless
  that worker's queue is longer than the shortest by more than `slack`; then the least loaded
  worker (fewest running + waiting, most free KV blocks) takes it.
- A worker lost (a step RPC or a health check that it does not answer): its engine hands every live
  request over, reset for recomputation with the tokens generated so far kept, and the group gives
  each to a connected worker, as preemption would; the stream pauses and goes on, and greedy output is
  unchanged. With no worker left, those requests end with an "unavailable" error event. The lost
  engine reconnects on its own: a restarted worker rejoins.
- Workers are given as addresses or as `dns:///name:port` (common/discovery.py), re-resolved every
  `refresh_s`: workers that appear get an engine, workers that disappear hand their requests over.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence as Seq
from itertools import zip_longest

from protos.segserve.v1.generate import GenerateError, GenerateRequest
from protos.segserve.v1.info import Health, WorkerInfo
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine, EngineNotReady, EngineStats
from scheduler.request_events import RequestEvents
from scheduler.sequence import Sequence
from scheduler.spec_policy import SegmentStats
from scheduler.speculator import Drafter
from scheduler.worker_link import Worker
from common.discovery import is_dns_target, membership_changes, parse_targets, place

logger = logging.getLogger(__name__)


class EngineGroup:
    """Several Engines behind the interface of one."""

    def __init__(self, config: SchedulerConfig, make_worker: Callable[[str, str | None], Worker],
                 drafter: Drafter | None = None, refresh_s: float = 10.0, slack: int = 4):
        self.config = config
        self.make_worker = make_worker
        self.drafter = drafter
        self.refresh_s = refresh_s
        self.slack = slack
        self.targets = parse_targets(config.worker_address, "--worker-address")
        self.engines: dict[str, Engine] = {}
        self._owner: dict[str, Engine] = {}
        """Request id -> the engine running it."""
        self._refresher: asyncio.Task | None = None
        self.num_moved = 0
        """Requests handed from a lost worker to another one."""

    @property
    def info(self) -> WorkerInfo | None:
        """The model's facts from a connected worker (every worker serves the same model)."""
        for engine in self.connected:
            return engine.info
        return next((e.info for e in self.engines.values() if e.info is not None), None)

    @property
    def is_connected(self) -> bool:
        """Whether any worker is connected (requests can be admitted)."""
        return bool(self.connected)

    @property
    def connected(self) -> list[Engine]:
        return [e for _, e in sorted(self.engines.items()) if e.is_connected]

    def start(self) -> None:
        """Start an engine per worker address (and the re-resolution of DNS targets)."""
        if not any(is_dns_target(t) for t in self.targets):
            for address in dict.fromkeys(self.targets):
                self._add_engine(address)
        else:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    async def stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        await asyncio.gather(*(engine.stop() for engine in self.engines.values()))

    async def close(self) -> None:
        """Close every worker's and the drafter's client."""
        for client in [e.worker for e in self.engines.values()] + [self.drafter]:
            close = getattr(client, "close", None)
            if close is not None:
                await close()

    def add_request(self, request: GenerateRequest) -> RequestEvents:
        """Queue a validated request on the worker chosen for it; raises EngineNotReady when none is connected."""
        engine = self._place(request.prompt_token_ids)
        if engine is None:
            raise EngineNotReady("no worker is connected")
        stream = engine.add_request(request)
        self._owner[request.request_id] = engine
        return stream

    def abort(self, request_id: str) -> bool:
        engine = self._owner.pop(request_id, None)
        return engine is not None and engine.abort(request_id)

    def forget(self, request_id: str) -> None:
        """The request's stream ended (the servicer's finally)."""
        self._owner.pop(request_id, None)

    async def health(self) -> Health:
        connected = self.connected
        if not connected:
            return Health(False, "no worker connected yet")
        healths = await asyncio.gather(*(e.health() for e in connected))
        ready = sum(h.is_ready for h in healths)
        if ready == 0:
            return Health(False, "; ".join(h.detail for h in healths if h.detail) or "no worker is ready")
        return Health(True, f"{ready} of {len(self.engines)} workers ready" if len(self.engines) > 1 else "")

    def stats(self) -> EngineStats:
        """Every engine's stats added up."""
        parts = [e.stats() for e in self.engines.values()]
        if not parts:
            return EngineStats()
        segments: dict[str, SegmentStats] = {}
        for part in parts:
            for name, stats in part.spec_segments.items():
                segments[name] = _merged(segments[name], stats) if name in segments else stats
        spec = parts[0].spec
        for part in parts[1:]:
            spec = _merged(spec, part.spec)
        numbers = {name: sum(getattr(p, name) for p in parts) for name in (
            "num_running", "num_waiting", "num_used_kv_blocks", "num_total_kv_blocks", "num_preemptions",
            "num_steps", "num_failed_steps", "num_prefix_cache_queries", "num_prefix_cache_hits")}
        budgets: dict[str, int] = {}
        for part in parts:  # a segment drafts where any worker's policy lets it
            for name, budget in part.spec_budgets.items():
                budgets[name] = max(budget, budgets.get(name, 0))
        decisions = [p.gate_decision for p in parts if p.gate_decision is not None]
        gate = max(decisions, key=lambda d: (d[1], d[0])) if decisions else None  # open wins, then the largest bucket
        gates: dict[str, tuple[int, bool]] = {}
        for part in parts:  # likewise per segment kind
            for name, (bucket, is_open) in part.gate_segments.items():
                gates[name] = max(gates.get(name, (0, False)), (bucket, is_open), key=lambda d: (d[1], d[0]))
        return EngineStats(**numbers, spec=spec, spec_segments=segments, num_workers=len(self.engines),
                           num_live_workers=len(self.connected), num_moved_requests=self.num_moved,
                           spec_budgets=budgets, gate_decision=gate, gate_segments=gates)

    def _place(self, prompt_token_ids: Seq[int], exclude: Engine | None = None) -> Engine | None:
        loads = {e.address: _load(e) for e in self.connected if e is not exclude}
        address = place(prompt_token_ids, loads, self.slack)
        return None if address is None else self.engines[address]

    def _on_lost(self, lost: Engine, items: list[tuple[Sequence, RequestEvents]], reason: str) -> None:
        """Give a lost worker's requests to the others; fail them when there is none."""
        for seq, stream in items:
            engine = self._place(seq.prompt_token_ids, exclude=lost)
            if engine is None:
                self._owner.pop(seq.request_id, None)
                stream.put(GenerateError("unavailable", f"worker {lost.address} was lost ({reason}) and no other "
                                                        "worker is connected"))
                continue
            engine.adopt(seq, stream)
            self._owner[seq.request_id] = engine
            self.num_moved += 1

    def _add_engine(self, address: str, server_name: str | None = None) -> None:
        """An engine for the worker at `address` (`server_name`: the DNS name it was resolved from, for TLS)."""
        engine = Engine(self.config, self.make_worker(address, server_name), self.drafter, on_lost=self._on_lost)
        self.engines[address] = engine
        engine.start()
        logger.info("worker %s joined (%d workers)", address, len(self.engines))

    async def _remove_engine(self, address: str) -> None:
        engine = self.engines.pop(address)
        if engine.scheduler is not None:
            self._on_lost(engine, engine.evict_all(), "it left the worker addresses")
        await engine.stop()
        close = getattr(engine.worker, "close", None)
        if close is not None:
            await close()
        logger.info("worker %s left (%d workers)", address, len(self.engines))

    async def _refresh_forever(self) -> None:
        while True:
            joined, left = await membership_changes(self.targets, self.engines)
            for address, name in joined.items():
                self._add_engine(address, name)
            for address in left:
                await self._remove_engine(address)
            await asyncio.sleep(self.refresh_s)


def _merged(a: SegmentStats, b: SegmentStats) -> SegmentStats:
    """Counts added (per depth, position by position); the policy's running averages are a's."""
    def add(x: list[int], y: list[int]) -> list[int]:
        return [i + j for i, j in zip_longest(x, y, fillvalue=0)]

    return dataclasses.replace(
        a, num_verified=a.num_verified + b.num_verified, num_draft_tokens=a.num_draft_tokens + b.num_draft_tokens,
        num_accepted_tokens=a.num_accepted_tokens + b.num_accepted_tokens,
        num_offered_by_depth=add(a.num_offered_by_depth, b.num_offered_by_depth),
        num_accepted_by_depth=add(a.num_accepted_by_depth, b.num_accepted_by_depth),
        max_num_nodes=max(a.max_num_nodes, b.max_num_nodes))


def _load(engine: Engine) -> tuple[int, int]:
    """(queued + running requests, -free KV blocks): smaller is less loaded."""
    scheduler = engine.scheduler
    if scheduler is None:
        return (1 << 30, 0)
    free = scheduler.block_manager.num_total_blocks - scheduler.block_manager.num_used_blocks
    return (len(scheduler.running) + len(scheduler.waiting), -free)
