"""The asyncio step loop: schedule -> draft -> worker step (forward/verify) -> postprocess, then deliver.

In: add_request() / abort() from the gRPC servicer. Out: per-request streams of
the contract's events (protos/segserve/v1/generate.py): TokenChunks, then a
GenerateComplete or a GenerateError. The loop sleeps on an event when there is
no work and never lets a failed step hang a stream: a step the worker fails is
retried by preemption at a smaller batch size (Scheduler.fail_step), a step the
worker does not answer (unreachable, past its deadline) fails its requests.
The Scheduler decides every step (a StepPlan); the engine only carries it out.
With a drafter, a step the speculation policy drafts in first asks it for
candidate trees (speculator.py); a drafter that fails only makes that step plain.
Connecting to the worker, the idle health check and the record of a lost worker
are in worker_link.py. A step with a traced request in it runs in a span (traces.py).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from protos.segserve.v1.generate import GenerateError, GenerateRequest
from protos.segserve.v1.info import Health, WorkerInfo
from protos.segserve.v1.step import StepRequest
from protos.segserve.v1.step_result import StepResult
from scheduler import traces
from scheduler.config import SchedulerConfig
from scheduler.outputs import RequestEvent
from scheduler.request_events import RequestEvents
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from scheduler.spec_policy import SegmentStats
from scheduler.speculator import Drafter, Speculator
from scheduler.step_plan import StepPlan
from scheduler.worker_client import WorkerError
from scheduler.worker_link import Worker, WorkerLink, WorkerLost, new_speculator

logger = logging.getLogger(__name__)


class EngineNotReady(RuntimeError):
    """The worker has not answered GetInfo yet, so no request can be admitted."""


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_used_kv_blocks: int = 0
    num_total_kv_blocks: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_failed_steps: int = 0
    """Whole worker steps that failed and were retried by preemption."""
    spec: SegmentStats = field(default_factory=SegmentStats)
    """Speculation over all segments: trees verified, draft and accepted tokens, acceptance per depth."""
    spec_segments: dict[str, SegmentStats] = field(default_factory=dict)
    """The same per segment kind ("" = not yet known)."""
    num_prefix_cache_queries: int = 0
    """Tokens of admitted sequences looked up in the prefix cache since start."""
    num_prefix_cache_hits: int = 0
    """Of those, tokens found in cached KV blocks."""
    num_workers: int = 1
    num_live_workers: int = 0
    """Workers connected now."""
    num_moved_requests: int = 0
    """Requests moved from a lost worker to another one."""
    spec_budgets: dict[str, int] = field(default_factory=dict)
    """The policy's latest node budget per segment kind (0 = drafting off for it)."""
    gate_decision: tuple[int, bool] | None = None
    """The speculation gate's latest (batch-size bucket, whether any segment kind may draft); None before its first."""
    gate_segments: dict[str, tuple[int, bool]] = field(default_factory=dict)
    """Segment kind -> the gate's (batch-size bucket, is_open) at the latest step that had the kind."""


async def _settle(task: asyncio.Task | None) -> None:
    """Wait for a step whose result is not wanted (a dropped step ahead), whatever its outcome."""
    if task is not None:
        await asyncio.gather(task, return_exceptions=True)


LostHandler = Callable[["Engine", list[tuple[Sequence, RequestEvents]], str], None]
"""Called when an engine's worker is lost, with the sequences it held (reset for recomputation), their streams
and the reason."""


class Engine:
    """One worker's step loop. With `on_lost` (an EngineGroup), a worker that stops answering hands its requests
    to the handler, and the engine reconnects when the worker comes back; without, they fail."""

    def __init__(self, config: SchedulerConfig, worker: Worker, drafter: Drafter | None = None,
                 on_lost: LostHandler | None = None, health_interval_s: float = 2.0):
        self.config = config
        self.worker = worker
        self.drafter = drafter
        self.on_lost = on_lost
        self.link = WorkerLink(worker, getattr(worker, "address", config.worker_address), on_lost is not None,
                               health_interval_s)
        self.speculator: Speculator | None = None
        self.info: WorkerInfo | None = None
        self.scheduler: Scheduler | None = None
        self._step = self._step_pipelined if config.is_async_scheduling else self.step
        """The step the loop runs, chosen once: with async scheduling, steps go ahead of the one in flight."""
        self._step_ids = itertools.count(random.getrandbits(48) + 1)
        """Step ids for async scheduling, from a random start so that a restarted scheduler's never meet
        the ids a worker remembers from before."""
        self._streams: dict[str, RequestEvents] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def is_connected(self) -> bool:
        return self.scheduler is not None

    @property
    def address(self) -> str:
        return self.link.address

    def start(self) -> None:
        """Start the loop on the running event loop; it connects to the worker first (retrying)."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="segserve-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._fail(list(self._streams), "unavailable", "the scheduler is shutting down")

    async def health(self) -> Health:
        if not self.is_connected:
            return Health(False, "not connected to the worker yet")
        return await self.worker.health()

    def add_request(self, request: GenerateRequest) -> RequestEvents:
        """Queue a validated request; raises EngineNotReady, QueueFull (retry later), or RequestRejected."""
        if self.scheduler is None:
            raise EngineNotReady(f"the worker at {self.address} has not answered yet")
        seq = Sequence.of(request)
        seq.trace = traces.request_trace(request)
        self.scheduler.add(seq)
        stream = self._streams[request.request_id] = RequestEvents(request.request_id)
        self._wakeup.set()
        return stream

    def adopt(self, seq: Sequence, stream: RequestEvents) -> None:
        """Go on with a request another engine's lost worker held (its stream keeps every token sent so far)."""
        if self.scheduler is None:
            raise EngineNotReady(f"the worker at {self.address} is not connected")
        self.scheduler.resume(seq)
        self._streams[seq.request_id] = stream
        self._wakeup.set()

    def evict_all(self) -> list[tuple[Sequence, RequestEvents]]:
        """Every live request leaves this engine, reset for another worker (Scheduler.evict_all), with its stream.
        Should the worker come back, it releases them (WorkerLink.stale_ids)."""
        evicted = self.scheduler.evict_all()
        self.link.stale_ids = [seq.request_id for seq in evicted]
        return [(seq, self._streams.pop(seq.request_id)) for seq in evicted if seq.request_id in self._streams]

    def abort(self, request_id: str) -> bool:
        """Cancel a live request: its blocks are free at once; its stream ends with "cancelled"."""
        if self.scheduler is None or not self.scheduler.abort(request_id):
            return False
        self._deliver(RequestEvent(request_id, GenerateError("cancelled", "the request was cancelled")))
        return True

    def stats(self) -> EngineStats:
        if self.scheduler is None:
            return EngineStats()
        s = self.scheduler
        policy = self.speculator.policy if self.speculator is not None else None
        acceptance = policy.acceptance if policy else None
        return EngineStats(len(s.running), len(s.waiting), s.block_manager.num_used_blocks,
                           s.block_manager.num_total_blocks, s.num_preemptions, s.num_steps, s.num_failed_steps,
                           copy.deepcopy(acceptance.total) if acceptance else SegmentStats(),
                           copy.deepcopy(acceptance.segments) if acceptance else {},
                           s.block_manager.num_prefix_cache_queries, s.block_manager.num_prefix_cache_hits,
                           num_live_workers=1, spec_budgets=dict(policy.last_budgets) if policy else {},
                           gate_decision=policy.gate.last_decision if policy else None,
                           gate_segments=dict(policy.gate.last_segments) if policy else {})

    async def step(self) -> None:
        """One worker step: schedule -> draft -> run on the worker -> postprocess -> deliver."""
        start = time.perf_counter()  # each cycle is timed whole, from the end of the one before, for the gate
        plan = await self._schedule_and_draft(start)
        if plan is None:
            return
        events = await self._run_step(plan, self._send(plan.request))
        self._finish_cycle(plan, events, start)

    async def _step_pipelined(self) -> None:
        """step() with async scheduling: the step after one is built and sent before that one's result is back
        (Scheduler.schedule_ahead), and so on while the batch stays in the steady decode state, so the worker goes
        from one step to the next without waiting for this loop's round trip. Every step has an id, and a step
        ahead names the one it follows: the worker runs it after that one, whichever RPC reaches it first."""
        start = time.perf_counter()
        plan = await self._schedule_and_draft(start)
        sent = None if plan is None else self._send(self._number(plan.request))
        while plan is not None:
            ahead = self.scheduler.schedule_ahead(plan)
            if ahead is not None:
                traces.start_step(ahead)
            ahead_sent = None if ahead is None else self._send(self._number(ahead.request, plan.request))
            try:
                events = await self._run_step(plan, sent)
            except BaseException as exc:
                if ahead_sent is not None and isinstance(exc, asyncio.CancelledError):
                    ahead_sent.cancel()
                await _settle(ahead_sent)
                raise
            start = self._finish_cycle(plan, events, start)
            if ahead is not None and self.scheduler.current_step is not ahead.request:  # dropped: its step failed
                await _settle(ahead_sent)
                traces.end_step(ahead, "dropped: the step before it failed")
                return
            plan, sent = ahead, ahead_sent

    async def _schedule_and_draft(self, start: float) -> StepPlan | None:
        """The next step, final: scheduled, then drafted in where the scheduler chose to (None: nothing is
        runnable). Its span (traces.py), when it has one, starts at `start` (time.perf_counter())."""
        plan = self.scheduler.schedule()
        if not plan.request.sequences:  # only right after a preemption left nothing runnable; retry next turn
            await asyncio.sleep(0.001)
            return None
        traces.start_step(plan, start)
        with traces.drafting(plan):
            trees = await self.speculator.draft(plan) if self.speculator is not None else {}
        self.scheduler.finish_plan(plan, trees)
        return plan

    def _number(self, request: StepRequest, follows: StepRequest | None = None) -> StepRequest:
        """`request` with its step id, naming the step it `follows` (async scheduling)."""
        request.step_id = next(self._step_ids)
        request.follows_step_id = 0 if follows is None else follows.step_id
        return request

    def _send(self, request: StepRequest) -> asyncio.Task:
        """The worker's step, under way."""
        return asyncio.ensure_future(self._timed_step(request))

    async def _timed_step(self, request: StepRequest) -> tuple[StepResult, float]:
        start = time.perf_counter()
        result = await self.worker.step(request)
        return result, time.perf_counter() - start

    async def _run_step(self, plan: StepPlan, sent: asyncio.Task) -> list[RequestEvent]:
        """The worker's step with its outputs applied; a failed step is retried or fails its requests. A step
        sent ahead waited at the worker for the step before it: its round trip is not its cost."""
        request = plan.request
        try:
            result, seconds = await sent
        except WorkerError as exc:
            traces.end_step(plan, str(exc))
            return self._on_failed_step(request, exc)
        except Exception as exc:  # a bug on this side of the wire: handled like a failed step
            logger.exception("worker step failed")
            traces.end_step(plan, f"{type(exc).__name__}: {exc}")
            return self._on_failed_step(request, WorkerError(f"step failed: {type(exc).__name__}: {exc}"))
        if self.speculator is not None:
            self.speculator.observe_step(request, result, None if plan.is_ahead else seconds, plan.forced_seq_ids)
        return self.scheduler.postprocess(request, result)

    def _finish_cycle(self, plan: StepPlan, events: list[RequestEvent], start: float) -> float:
        """Deliver the step's events; the cycle, start to now, and its tokens go to the speculation gate.
        Returns now: where the next cycle starts."""
        for event in events:
            self._deliver(event)
        now = time.perf_counter()
        if self.speculator is not None:
            self.speculator.observe_cycle(plan.decision, sum(e.num_tokens for e in events), now - start)
        traces.end_step(plan)
        return now

    def _on_failed_step(self, request: StepRequest, exc: WorkerError) -> list[RequestEvent]:
        """An unreachable worker's state is unknown: the step's requests fail (GenerateError "internal").
        Any other failure preempts the step's sequences for a retry at a smaller batch size."""
        if exc.is_unreachable and self.on_lost is not None:
            self.scheduler.discard(request)
            raise WorkerLost(str(exc))
        if exc.is_unreachable:
            self._fail(self.scheduler.discard(request), "internal", str(exc))
            self.scheduler.block_manager.reset_prefix_cache()  # a restarted worker's KV cache is empty
            return []
        logger.warning("worker step of %d sequences failed; retrying smaller: %s", len(request.sequences), exc)
        return self.scheduler.fail_step(request, str(exc))

    async def _run(self) -> None:
        try:
            while True:
                await self._connect()
                try:
                    await self._serve()
                except WorkerLost as exc:
                    self._hand_over(str(exc))
        except asyncio.CancelledError:
            raise
        except BaseException:
            logger.exception("scheduler loop died")
            self._fail(list(self._streams), "internal", "the scheduler loop died; see the scheduler's log")
            raise

    async def _connect(self) -> None:
        info = await self.link.connect()
        self.speculator = new_speculator(self.config, self.drafter, info)
        self.scheduler = self.link.new_scheduler(self.config, info, self.speculator)
        self.info = info

    async def _serve(self) -> None:
        """Step while there is work; when idle, wait for work and check on the worker. Raises WorkerLost."""
        while True:
            if self.scheduler.has_work:
                await self._step()
                continue
            if self.speculator is not None:
                self.speculator.on_idle()
            self._wakeup.clear()  # nothing ran since has_work: a request added from now on sets it again
            await self.link.wait_for_work(self._wakeup)

    def _hand_over(self, reason: str) -> None:
        """The worker is lost: give every live request to on_lost, and forget this worker's state."""
        items = self.evict_all()
        self.scheduler = None  # admits nothing until the worker is back (_connect)
        self.link.lost(len(items), reason)
        self.on_lost(self, items, reason)

    def _fail(self, request_ids: Iterable[str], code: str, message: str) -> None:
        for request_id in request_ids:
            if self.scheduler is not None:
                self.scheduler.abort(request_id)
            self._deliver(RequestEvent(request_id, GenerateError(code, message)))

    def _deliver(self, event: RequestEvent) -> None:
        streams = self._streams
        stream = streams.pop(event.request_id, None) if event.is_terminal else streams.get(event.request_id)
        if stream is not None:
            stream.put(event.event)
