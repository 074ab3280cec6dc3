"""Online learning off the Draft path: learned segments join their corpora on a thread of its own.

In: (corpus, tokens) jobs from the planner's learn() (segments closed here, records of other
replicas). Out: the corpora, changed a slice at a time under the CorpusGuard.

The learner runs a corpus's step generators (drafter/corpus.py: learn_steps, which evict when the
bound is passed). Slices that build suffix arrays only read the corpus and run without the lock;
the slice that swaps the built runs in takes the guard's lock, then steps aside: a reader (a Draft
batch, a snapshot) that wants the lock gets it before the learner's next slice, so it waits at most
one slice. Between slices the learner sleeps briefly, which hands the GIL to the event loop and the
Draft thread. The learner is the corpora's only writer once it runs. Jobs wait in a queue bounded in
tokens: past it new jobs are dropped and counted (learning is best effort; drafting never waits
for it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Iterator, Sequence

from drafter.corpus import LookupCorpus

logger = logging.getLogger(__name__)


class CorpusGuard:
    """The corpora's lock: readers first, the learner one slice at a time when no reader waits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._readers = threading.Condition()
        self._num_readers = 0  # waiting for the lock or holding it
        self.num_slices = 0
        """The learner's slices done under the lock so far."""
        self.most_slices_waited = 0
        """The most slices one reader waited through before it got the lock (readers first: at most 1)."""

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the corpora still (a Draft batch, a snapshot)."""
        with self._readers:
            self._num_readers += 1
            arrived_at = self.num_slices
        try:
            with self._lock:
                self.most_slices_waited = max(self.most_slices_waited, self.num_slices - arrived_at)
                yield
        finally:
            with self._readers:
                self._num_readers -= 1
                if not self._num_readers:
                    self._readers.notify_all()

    @contextmanager
    def writing(self) -> Iterator[None]:
        """One slice of the learner's: waits until no reader wants the lock."""
        with self._readers:
            while self._num_readers:
                self._readers.wait()
        with self._lock:
            try:
                yield
            finally:
                self.num_slices += 1


class Learner:
    """A background thread adding learned segments to corpora, a build at a time."""

    def __init__(self, guard: CorpusGuard | None = None, pause_s: float = 0.0002, max_pending_tokens: int = 1 << 20):
        if pause_s < 0 or max_pending_tokens <= 0:
            raise ValueError("a learner needs pause_s >= 0 and max_pending_tokens > 0")
        self.guard = guard or CorpusGuard()
        self.pause_s = pause_s
        self.max_pending_tokens = max_pending_tokens
        self.num_learned = 0
        """Jobs applied so far."""
        self.num_dropped = 0
        """Jobs dropped because the queue held max_pending_tokens already."""
        self._jobs: deque[tuple[LookupCorpus, tuple[int, ...]]] = deque()
        self._num_pending_tokens = 0
        self._is_busy = False
        self._is_closed = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, corpus: LookupCorpus, token_ids: Sequence[int]) -> None:
        """Queue a segment for `corpus` (returns at once; the thread starts with the first job)."""
        tokens = tuple(token_ids)
        with self._changed:
            if self._is_closed:
                return
            if self._num_pending_tokens + len(tokens) > self.max_pending_tokens:
                self.num_dropped += 1
                if self.num_dropped % 100 == 1:
                    logger.warning("learning falls behind: %d segments dropped", self.num_dropped)
                return
            self._jobs.append((corpus, tokens))
            self._num_pending_tokens += len(tokens)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="drafter-learner", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    @property
    def num_pending(self) -> int:
        """Jobs queued or being applied."""
        with self._changed:
            return len(self._jobs) + self._is_busy

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued job is applied; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._jobs and not self._is_busy, timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Apply what is queued, then stop the thread."""
        with self._changed:
            self._is_closed = True
            self._changed.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._jobs or self._is_closed)
                if not self._jobs:
                    return
                corpus, tokens = self._jobs.popleft()
                self._is_busy = True
            try:
                self._apply(corpus.learn_steps(tokens))
            except Exception:  # a bug here must not stop learning for good
                logger.exception("learning a segment failed")
            with self._changed:
                self._is_busy = False
                self._num_pending_tokens -= len(tokens)
                self.num_learned += 1
                self._changed.notify_all()

    def _apply(self, steps: Iterator[bool]) -> None:
        """Run a step generator: each slice that mutates under the guard, a short sleep between slices."""
        is_locked, is_done = True, False
        while not is_done:
            if is_locked:
                with self.guard.writing():
                    is_locked = next(steps, None)
            else:
                is_locked = next(steps, None)
            is_done = is_locked is None
            if not is_done:
                time.sleep(self.pause_s)
