"""The asyncio step loop: schedule -> draft -> worker step (forward/verify) -> postprocess, then deliver.

In: add_request() / abort() from the gRPC servicer. Out: per-request streams of
RequestOutput (new tokens; the last one has finish_status and metrics) ending
with either a finished output or a RequestError. The loop sleeps on an event
when there is no work and never lets a failed step hang a stream. With a
drafter, each step first asks it for candidate trees (speculator.py); a
drafter that fails only makes that step plain.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from scheduler.config import SchedulerConfig
from scheduler.outputs import RequestError, RequestOutput, SampledTokens, SchedulerOutput
from scheduler.scheduler import Scheduler
from scheduler.sequence import SamplingParams, Sequence, StoppingCriteria
from scheduler.spec_policy import SegmentStats, SpecPolicy
from scheduler.speculator import Drafter, Speculator
from scheduler.worker_client import WorkerError, WorkerHealth, WorkerInfo

logger = logging.getLogger(__name__)

_CONNECT_RETRY_S = 0.5


class EngineNotReady(RuntimeError):
    """The worker has not answered GetInfo yet, so no request can be admitted."""


class Worker(Protocol):
    """What the engine needs from a worker (WorkerClient, or a fake in tests)."""

    async def get_info(self) -> WorkerInfo: ...

    async def step(self, output: SchedulerOutput) -> dict[str, SampledTokens]: ...

    async def health(self) -> WorkerHealth: ...


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_used_kv_blocks: int = 0
    num_total_kv_blocks: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    spec: SegmentStats = field(default_factory=SegmentStats)
    """Speculation over all segments: trees verified, draft and accepted tokens, acceptance per depth."""
    spec_segments: dict[str, SegmentStats] = field(default_factory=dict)
    """The same per segment kind ("" = not yet known)."""


Event = RequestOutput | RequestError


class RequestStream:
    """Async iterator over one request's events; ends after its terminal event."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._is_done = False

    def put(self, event: Event) -> None:
        self._queue.put_nowait(event)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        if self._is_done:
            raise StopAsyncIteration
        event = await self._queue.get()
        self._is_done = isinstance(event, RequestError) or event.is_finished
        return event


class Engine:
    def __init__(self, config: SchedulerConfig, worker: Worker, drafter: Drafter | None = None):
        self.config = config
        self.worker = worker
        self.drafter = drafter
        self.speculator: Speculator | None = None
        self.info: WorkerInfo | None = None
        self.scheduler: Scheduler | None = None
        self._streams: dict[str, RequestStream] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

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

    async def health(self) -> WorkerHealth:
        if not self.is_connected:
            return WorkerHealth(False, "not connected to the worker yet")
        return await self.worker.health()

    def add_request(self, request_id: str, prompt_token_ids: Iterable[int], sampling: SamplingParams,
                    stopping: StoppingCriteria) -> RequestStream:
        """Queue a request; raises EngineNotReady, QueueFull (retry later), or RequestRejected (never runs)."""
        if self.scheduler is None:
            raise EngineNotReady(f"the worker at {self.config.worker_address} has not answered yet")
        self.scheduler.add(Sequence(request_id, list(prompt_token_ids), sampling, stopping))
        stream = self._streams[request_id] = RequestStream(request_id)
        self._wakeup.set()
        return stream

    def abort(self, request_id: str) -> bool:
        """Cancel a live request: its blocks are free at once; its stream ends with "cancelled"."""
        if self.scheduler is None or not self.scheduler.abort(request_id):
            return False
        self._deliver(RequestError(request_id, "cancelled", "the request was cancelled"))
        return True

    def stats(self) -> EngineStats:
        if self.scheduler is None:
            return EngineStats()
        s = self.scheduler
        return EngineStats(len(s.running), len(s.waiting), s.block_manager.num_used_blocks,
                           s.block_manager.num_total_blocks, s.num_preemptions, s.num_steps,
                           copy.deepcopy(s.acceptance.total), copy.deepcopy(s.acceptance.segments))

    async def _run(self) -> None:
        try:
            await self._connect()
            while True:
                if not self.scheduler.has_work:
                    if self.speculator is not None:
                        await self.speculator.flush_finished(self.scheduler)
                    # Clear, then look again: a request added during the flush (an await) has set
                    # the event already, and clearing after it without looking would sleep on it.
                    self._wakeup.clear()
                    if not self.scheduler.has_work:
                        await self._wakeup.wait()
                    continue
                await self._step()
        except asyncio.CancelledError:
            raise
        except BaseException:
            logger.exception("scheduler loop died")
            self._fail(list(self._streams), "internal", "the scheduler loop died; see the scheduler's log")
            raise

    async def _step(self) -> None:
        cycle_start = time.perf_counter()
        output = self.scheduler.schedule()
        if output.is_empty:  # only right after a preemption left nothing runnable; retry next turn
            await asyncio.sleep(0.001)
            return
        if self.speculator is not None:
            await self.speculator.propose(self.scheduler, output)
        try:
            start = time.perf_counter()
            sampled = await self.worker.step(output)
            if self.speculator is not None:
                self.speculator.observe_step(output.num_scheduled_tokens, time.perf_counter() - start)
            results = self.scheduler.postprocess(output, sampled)
        except Exception as exc:  # the worker failed (or answered nonsense): fail this step, serve the rest
            if not isinstance(exc, WorkerError):
                logger.exception("step failed")
            message = str(exc) if isinstance(exc, WorkerError) else f"step failed: {type(exc).__name__}: {exc}"
            self._fail(self.scheduler.discard(output), "internal", message)
            return
        for result in results:
            self._deliver(result)
        if self.speculator is not None:
            self.speculator.observe_cycle(sum(len(r.token_ids) for r in results), time.perf_counter() - cycle_start)

    async def _connect(self) -> None:
        is_logged = False
        while True:
            try:
                info = await self.worker.get_info()
                break
            except WorkerError as exc:
                if not is_logged:
                    logger.warning("waiting for the worker at %s: %s", self.config.worker_address, exc)
                    is_logged = True
                await asyncio.sleep(_CONNECT_RETRY_S)
        self.scheduler = Scheduler(
            num_kv_blocks=info.num_kv_blocks, block_size=info.block_size, max_model_len=info.max_model_len,
            eos_token_ids=info.eos_token_ids, max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens, max_num_waiting=self.config.max_num_waiting,
            max_num_waiting_tokens=self.config.max_num_waiting_tokens)
        if self.drafter is not None and self.config.max_draft_nodes > 0:
            policy = SpecPolicy(self.config.max_draft_nodes, self.config.spec_probe_interval,
                                self.config.is_spec_adaptive, acceptance=self.scheduler.acceptance)
            self.speculator = Speculator(self.drafter, policy, info.vocab_size)
        self.info = info
        logger.info("connected to worker %s: %s, %d KV blocks of %d tokens", self.config.worker_address,
                    info.model_name, info.num_kv_blocks, info.block_size)

    def _fail(self, request_ids: Iterable[str], code: str, message: str) -> None:
        for request_id in request_ids:
            if self.scheduler is not None:
                self.scheduler.abort(request_id)
            self._deliver(RequestError(request_id, code, message))

    def _deliver(self, event: Event) -> None:
        is_terminal = isinstance(event, RequestError) or event.is_finished
        stream = self._streams.pop(event.request_id, None) if is_terminal else self._streams.get(event.request_id)
        if stream is not None:
            stream.put(event)
