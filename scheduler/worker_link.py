"""An engine's hold on its worker: connecting, watching it while idle, and what is left when it is lost.

In: a Worker (WorkerClient, or tests/support/fakes.py's FakeWorker). Out: its WorkerInfo once it answers (connect()
retries until then), the Scheduler and Speculator sized for it (new_scheduler, new_speculator), WorkerLost from
wait_for_work() when an idle engine finds it gone, and the record of a loss (lost(), stale_ids: the sequences
handed over, which the worker releases once it is back, as its state for them is stale).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from protos.segserve.v1.info import Health, WorkerInfo
from protos.segserve.v1.step import StepRequest
from protos.segserve.v1.step_result import StepResult
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from scheduler.spec_policy import SpecPolicy
from scheduler.speculator import Drafter, Speculator
from scheduler.worker_client import WorkerError

logger = logging.getLogger(__name__)

_CONNECT_RETRY_S = 0.5


class Worker(Protocol):
    """What the engine needs from a worker (WorkerClient, or tests/support/fakes.py's FakeWorker).

    step() raises WorkerError when the step failed as a whole.
    """

    async def get_info(self) -> WorkerInfo: ...

    async def step(self, request: StepRequest) -> StepResult: ...

    async def health(self) -> Health: ...


class WorkerLost(Exception):
    """The worker stopped answering: hand the requests over and reconnect."""


class WorkerLink:
    """One worker as its engine holds it. With is_watched (the engine hands requests over when the worker is
    lost), an idle engine checks every health_interval_s that the worker is still there."""

    def __init__(self, worker: Worker, address: str, is_watched: bool, health_interval_s: float):
        self.worker = worker
        self.address = address
        self.is_watched = is_watched
        self.health_interval_s = health_interval_s
        self.num_lost = 0
        """Times the worker was lost (and its requests handed over)."""
        self.stale_ids: list[str] = []
        """Sequences evicted from the worker (Engine.evict_all), released on it once it is back (new_scheduler)."""

    async def connect(self) -> WorkerInfo:
        """The worker's info, asking again every _CONNECT_RETRY_S until it answers (the wait is logged once)."""
        is_logged = False
        while True:
            try:
                return await self.worker.get_info()
            except WorkerError as exc:
                if not is_logged:
                    logger.warning("waiting for the worker at %s: %s", self.address, exc)
                    is_logged = True
                await asyncio.sleep(_CONNECT_RETRY_S)

    async def wait_for_work(self, wakeup: asyncio.Event) -> None:
        """Wait for `wakeup`; every health_interval_s without it, make sure the worker is still there (WorkerLost:
        it is not; only where is_watched)."""
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result, and drops a cancellation
            # (stop()) that lands as the wakeup comes, leaving the loop running and stop() waiting for it
            async with asyncio.timeout(self.health_interval_s):
                await wakeup.wait()
        except TimeoutError:
            if self.is_watched:
                health = await self.worker.health()
                if not health.is_ready:
                    raise WorkerLost(health.detail or "the worker is not ready") from None

    def lost(self, num_moved: int, reason: str) -> None:
        """The worker is lost; num_moved requests move to other workers."""
        self.num_lost += 1
        logger.warning("worker %s lost (%s): %d requests move to other workers", self.address, reason, num_moved)

    def new_scheduler(self, config: SchedulerConfig, info: WorkerInfo, speculator: Speculator | None) -> Scheduler:
        """A scheduler for the worker that answered with `info`, which releases the stale sequences first."""
        max_num_seqs = config.resolve_max_num_seqs(info.num_kv_blocks, info.block_size, info.max_model_len)
        scheduler = Scheduler(
            num_kv_blocks=info.num_kv_blocks, block_size=info.block_size, max_model_len=info.max_model_len,
            eos_token_ids=info.eos_token_ids, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_num_waiting=config.max_num_waiting,
            max_num_waiting_tokens=config.max_num_waiting_tokens,
            max_failed_steps=config.max_failed_steps,
            is_prefix_caching=config.is_prefix_caching and not info.sequence_state_reason,
            is_block_table_delta=info.block_table_deltas,
            num_decode_steps=min(config.num_decode_steps, info.max_decode_steps),
            decode_steps_s=config.decode_steps_ms / 1000,
            on_end=speculator.forget if speculator is not None else None, drafting=speculator,
            is_drafting_forced_spans=config.is_grammar_drafts and speculator is not None and speculator.is_drafting)
        if info.sequence_state_reason:
            logger.warning("no shared prefixes for %s: %s", info.model_name, info.sequence_state_reason)
        scheduler.release_later(self.stale_ids)
        self.stale_ids = []
        logger.info("connected to worker %s: %s, %d KV blocks of %d tokens; max_num_seqs %d (%s)",
                    self.address, info.model_name, info.num_kv_blocks, info.block_size, max_num_seqs,
                    "automatic, from the KV blocks" if config.max_num_seqs is None else "set")
        return scheduler


def new_speculator(config: SchedulerConfig, drafter: Drafter | None, info: WorkerInfo) -> Speculator | None:
    """The speculator for a worker's steps; None without a drafter. max_draft_nodes 0: no policy, the drafter only
    learns."""
    if drafter is None:
        return None
    policy = (SpecPolicy(config.max_draft_nodes, config.spec_probe_interval, config.is_spec_adaptive)
              if config.max_draft_nodes > 0 else None)
    return Speculator(drafter, policy, info.vocab_size)
