"""The asyncio step loop: schedule -> draft -> worker step (forward/verify) -> postprocess, then deliver.

In: add_request() / abort() from the gRPC servicer. Out: per-request streams of
the contract's events (protos/segserve/v1/generate.py): TokenChunks, then a
GenerateComplete or a GenerateError. The loop sleeps on an event when there is
no work and never lets a failed step hang a stream: a step the worker fails is
retried by preemption at a smaller batch size (Scheduler.fail_step), a step the
worker does not answer (unreachable, past its deadline) fails its requests.
With a drafter, a step the speculation policy drafts in first asks it for
candidate trees (speculator.py); a drafter that fails only makes that step plain.
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
from typing import Protocol

from protos.segserve.v1.generate import GenerateError, GenerateRequest
from protos.segserve.v1.info import Health, WorkerInfo
from protos.segserve.v1.step import StepRequest
from protos.segserve.v1.step_result import StepResult
from scheduler.config import SchedulerConfig
from scheduler.decode_steps import add_decode_steps
from scheduler.outputs import RequestEvent
from scheduler.request_stream import RequestStream
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from scheduler.spec_gate import GateDecision
from scheduler.spec_policy import SegmentStats, SpecPolicy
from scheduler.speculator import Drafter, Speculator
from scheduler.worker_client import WorkerError

logger = logging.getLogger(__name__)

_CONNECT_RETRY_S = 0.5


class EngineNotReady(RuntimeError):
    """The worker has not answered GetInfo yet, so no request can be admitted."""


class Worker(Protocol):
    """What the engine needs from a worker (WorkerClient, or tests/fakes.py's FakeWorker).

    step() raises WorkerError when the step failed as a whole.
    """

    async def get_info(self) -> WorkerInfo: ...

    async def step(self, request: StepRequest) -> StepResult: ...

    async def health(self) -> Health: ...


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


LostHandler = Callable[["Engine", list[tuple[Sequence, RequestStream]], str], None]
"""Called when an engine's worker is lost, with the sequences it held (reset for recomputation), their streams
and the reason."""


class _WorkerLost(Exception):
    """The worker stopped answering: hand the requests over and reconnect."""


class Engine:
    """One worker's step loop. With `on_lost` (an EngineGroup), a worker that stops answering hands its requests
    to the handler, and the engine reconnects when the worker comes back; without, they fail."""

    def __init__(self, config: SchedulerConfig, worker: Worker, drafter: Drafter | None = None,
                 on_lost: LostHandler | None = None, health_interval_s: float = 2.0):
        self.config = config
        self.worker = worker
        self.drafter = drafter
        self.on_lost = on_lost
        self.health_interval_s = health_interval_s
        """How often an idle engine checks that its worker is still there."""
        self.speculator: Speculator | None = None
        self.info: WorkerInfo | None = None
        self.scheduler: Scheduler | None = None
        self.num_lost = 0
        """Times the worker was lost (and its requests handed over)."""
        self._step_ids = itertools.count(random.getrandbits(48) + 1)
        """Step ids for async scheduling, from a random start so that a restarted scheduler's never meet
        the ids a worker remembers from before."""
        self._streams: dict[str, RequestStream] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stale_ids: list[str] = []
        """Sequences handed over when the worker was lost, released on it once it is back."""

    @property
    def is_connected(self) -> bool:
        return self.scheduler is not None

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

    def add_request(self, request: GenerateRequest) -> RequestStream:
        """Queue a validated request; raises EngineNotReady, QueueFull (retry later), or RequestRejected."""
        if self.scheduler is None:
            raise EngineNotReady(f"the worker at {self.address} has not answered yet")
        self.scheduler.add(Sequence.of(request))
        stream = self._streams[request.request_id] = RequestStream(request.request_id)
        self._wakeup.set()
        return stream

    def adopt(self, seq: Sequence, stream: RequestStream) -> None:
        """Go on with a request another engine's lost worker held (its stream keeps every token sent so far)."""
        if self.scheduler is None:
            raise EngineNotReady(f"the worker at {self.address} is not connected")
        self.scheduler.resume(seq)
        self._streams[seq.request_id] = stream
        self._wakeup.set()

    @property
    def address(self) -> str:
        return getattr(self.worker, "address", self.config.worker_address)

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

    async def _run(self) -> None:
        try:
            while True:
                await self._connect()
                try:
                    await self._serve()
                except _WorkerLost as exc:
                    self._hand_over(str(exc))
        except asyncio.CancelledError:
            raise
        except BaseException:
            logger.exception("scheduler loop died")
            self._fail(list(self._streams), "internal", "the scheduler loop died; see the scheduler's log")
            raise

    async def _serve(self) -> None:
        """Step while there is work; when idle, wait for work and check on the worker. Raises _WorkerLost."""
        while True:
            if not self.scheduler.has_work:
                if self.speculator is not None:
                    await self.speculator.flush_ended()
                # Clear, then look again: a request added during the flush (an await) has set
                # the event already, and clearing after it without looking would sleep on it.
                self._wakeup.clear()
                if not self.scheduler.has_work:
                    await self._idle()
                continue
            await self._step()

    async def _idle(self) -> None:
        """Wait for work; every health_interval_s without any, make sure the worker is still there."""
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result, and drops a cancellation
            # (stop()) that lands as the wakeup comes, leaving the loop running and stop() waiting for it
            async with asyncio.timeout(self.health_interval_s):
                await self._wakeup.wait()
        except TimeoutError:
            if self.on_lost is not None:
                health = await self.worker.health()
                if not health.is_ready:
                    raise _WorkerLost(health.detail or "the worker is not ready") from None

    def _hand_over(self, reason: str) -> None:
        """The worker is lost: give every live request to on_lost, and forget this worker's state."""
        self.num_lost += 1
        evicted = self.scheduler.evict_all()
        items = [(seq, self._streams.pop(seq.request_id)) for seq in evicted if seq.request_id in self._streams]
        logger.warning("worker %s lost (%s): %d requests move to other workers", self.address, reason, len(items))
        self._stale_ids = [seq.request_id for seq in evicted]
        self.scheduler = None  # admits nothing until the worker is back (_connect)
        self.on_lost(self, items, reason)

    async def _step(self) -> None:
        """schedule -> draft -> worker step(s) -> apply outputs -> deliver.

        A plain decode step may take several decode steps at the worker (multi-step decoding,
        scheduler/decode_steps.py), unless the drafter was asked for trees for it.

        With async scheduling, the step after a decode step is built and sent before that step's result is
        back (Scheduler.schedule_ahead), and so on while the batch stays in the steady decode state: the
        worker goes from one step to the next without waiting for this loop's round trip. With speculation,
        only where the gate keeps drafting off for every kind in the batch (Speculator.plan_next): a tree needs
        the tokens of the step before it."""
        mark = time.perf_counter()  # end of the previous step's cycle: each cycle is timed from there
        request = self.scheduler.schedule()
        if not request.sequences:  # only right after a preemption left nothing runnable; retry next turn
            await asyncio.sleep(0.001)
            return
        decision = None
        if self.speculator is not None:
            decision = await self.speculator.propose(self.scheduler, request)
        if self.speculator is None or not self.speculator.asked_for_trees:
            # not where the drafter was asked for trees: one that found none this step may find one the next,
            # which several decode steps in one request would skip
            add_decode_steps(self.scheduler, request)
        sent, is_ahead = self._send(request), False
        while True:
            ahead, ahead_decision = self._schedule_ahead(request)
            ahead_sent = None if ahead is None else self._send(ahead, follows=request)
            try:
                events = await self._run_step(request, sent, is_ahead)
            except BaseException as exc:
                if ahead_sent is not None and isinstance(exc, asyncio.CancelledError):
                    ahead_sent.cancel()
                await _settle(ahead_sent)
                raise
            for event in events:
                self._deliver(event)
            now = time.perf_counter()
            if self.speculator is not None:
                self.speculator.observe_cycle(decision, sum(e.num_tokens for e in events), now - mark)
            mark = now
            if ahead is None:
                return
            if self.scheduler.current_step is not ahead:  # dropped: the step before it failed
                await _settle(ahead_sent)
                return
            request, sent, decision, is_ahead = ahead, ahead_sent, ahead_decision, True

    def _schedule_ahead(self, request: StepRequest) -> tuple[StepRequest | None, GateDecision | None]:
        """The step after `request`, to send now, and the gate's decision for it; (None, None) when it must wait
        for `request`'s result: async scheduling off, a step the gate may let draft, or one schedule_ahead() cannot
        build."""
        if not self.config.is_async_scheduling:
            return None, None
        if self.speculator is not None and not self.speculator.plan_next(self.scheduler, request):
            return None, None
        ahead = self.scheduler.schedule_ahead(request)
        if ahead is None or self.speculator is None:
            return ahead, None
        return ahead, self.speculator.take_planned()

    def _send(self, request: StepRequest, follows: StepRequest | None = None) -> asyncio.Task:
        """The worker's step, under way. With async scheduling every step has an id, and a step ahead names the
        step it `follows`: the worker runs it after that one, whichever of the two RPCs reaches it first."""
        if self.config.is_async_scheduling:
            request.step_id = next(self._step_ids)
            request.follows_step_id = 0 if follows is None else follows.step_id
        return asyncio.ensure_future(self._timed_step(request))

    async def _timed_step(self, request: StepRequest) -> tuple[StepResult, float]:
        start = time.perf_counter()
        result = await self.worker.step(request)
        return result, time.perf_counter() - start

    async def _run_step(self, request: StepRequest, sent: asyncio.Task, is_ahead: bool) -> list[RequestEvent]:
        """The worker's step with its outputs applied; a failed step is retried or fails its requests. A step
        sent ahead (is_ahead) waited at the worker for the step before it: its round trip is not its cost."""
        try:
            result, seconds = await sent
        except WorkerError as exc:
            return self._on_failed_step(request, exc)
        except Exception as exc:  # a bug on this side of the wire: handled like a failed step
            logger.exception("worker step failed")
            return self._on_failed_step(request, WorkerError(f"step failed: {type(exc).__name__}: {exc}"))
        if self.speculator is not None:
            self.speculator.observe_step(request, result, None if is_ahead else seconds)
        return self.scheduler.postprocess(request, result)

    def _on_failed_step(self, request: StepRequest, exc: WorkerError) -> list[RequestEvent]:
        """An unreachable worker's state is unknown: the step's requests fail (GenerateError "internal").
        Any other failure preempts the step's sequences for a retry at a smaller batch size."""
        if exc.is_unreachable and self.on_lost is not None:
            self.scheduler.discard(request)
            raise _WorkerLost(str(exc))
        if exc.is_unreachable:
            self._fail(self.scheduler.discard(request), "internal", str(exc))
            self.scheduler.block_manager.reset_prefix_cache()  # a restarted worker's KV cache is empty
            return []
        logger.warning("worker step of %d sequences failed; retrying smaller: %s", len(request.sequences), exc)
        return self.scheduler.fail_step(request, str(exc))

    async def _connect(self) -> None:
        is_logged = False
        while True:
            try:
                info = await self.worker.get_info()
                break
            except WorkerError as exc:
                if not is_logged:
                    logger.warning("waiting for the worker at %s: %s", self.address, exc)
                    is_logged = True
                await asyncio.sleep(_CONNECT_RETRY_S)
        if self.drafter is not None:  # max_draft_nodes 0: no policy, the drafter only learns
            policy = (SpecPolicy(self.config.max_draft_nodes, self.config.spec_probe_interval,
                                 self.config.is_spec_adaptive) if self.config.max_draft_nodes > 0 else None)
            self.speculator = Speculator(self.drafter, policy, info.vocab_size)
        max_num_seqs = self.config.resolve_max_num_seqs(info.num_kv_blocks, info.block_size, info.max_model_len)
        self.scheduler = Scheduler(
            num_kv_blocks=info.num_kv_blocks, block_size=info.block_size, max_model_len=info.max_model_len,
            eos_token_ids=info.eos_token_ids, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens, max_num_waiting=self.config.max_num_waiting,
            max_num_waiting_tokens=self.config.max_num_waiting_tokens,
            max_failed_steps=self.config.max_failed_steps, is_prefix_caching=self.config.is_prefix_caching,
            is_block_table_delta=info.block_table_deltas,
            num_decode_steps=min(self.config.num_decode_steps, info.max_decode_steps),
            decode_steps_s=self.config.decode_steps_ms / 1000,
            on_end=self.speculator.forget if self.speculator is not None else None)
        self.scheduler.release_later(self._stale_ids)
        self._stale_ids = []
        self.info = info
        logger.info("connected to worker %s: %s, %d KV blocks of %d tokens; max_num_seqs %d (%s)",
                    self.address, info.model_name, info.num_kv_blocks, info.block_size, max_num_seqs,
                    "automatic, from the KV blocks" if self.config.max_num_seqs is None else "set")

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
