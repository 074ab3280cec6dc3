"""Keep a local stack's processes running, as systemd, supervisord or a Kubernetes restart policy would.

`segserve serve` hands its started `Stack` to a `Supervisor`. A service that exits while the stack is meant to run
is logged by name, with its exit code or signal and the last lines it wrote, and started again with its own config
(same ports) after an exponential back-off, while the others keep serving:
- a worker rejoins the scheduler, which reconnects to its address and moves nothing back (the requests of the
  dead one were moved to the survivors, or failed when there were none);
- a drafter loads its snapshot and replays the shared log (drafter/server.py); until then the scheduler drafts
  with the other replicas, or decodes without drafts;
- a scheduler reconnects to every worker and drafter; the router retries new requests until it answers
  (RouterConfig.scheduler_retry_s); streams under way on the dead one end with an error;
- a router binds the same ports again.

A service that exits more than `max_restarts` times within `window_s` stops the whole stack, which then says
which one and why: a crash loop is not hidden behind restarts. SIGINT and SIGTERM stop the supervision first, then
the stack drains and stops (Stack.stop), so a service stopped on purpose is never restarted.

The supervising process is a Linux child subreaper: what a dead service started (the Ray processes of a
scheduler) comes to it, and is killed, instead of outliving the service on the machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import psutil

from common.backoff import Backoff
from segserve.launcher import last_exception

logger = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class RestartPolicy:
    """When and how often a service that exited is started again."""

    max_restarts: int = 5
    """Restarts of one service allowed within window_s; its next exit stops the stack (0 = never restart)."""
    window_s: float = 600.0
    """The sliding window max_restarts counts in, seconds."""
    backoff_s: float = 0.5
    """The wait before a service's first restart in the window; doubled for each further one."""
    max_backoff_s: float = 30.0
    """The longest wait before a restart."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        if self.window_s <= 0:
            raise ValueError("window_s must be > 0")
        Backoff(self.backoff_s, self.max_backoff_s)  # checks 0 <= backoff_s <= max_backoff_s

    def delay_s(self, num_recent_restarts: int) -> float:
        """The back-off before the next restart of a service restarted `num_recent_restarts` times in the window."""
        return Backoff(self.backoff_s, self.max_backoff_s).delay_s(num_recent_restarts + 1)


class Services(Protocol):
    """What the supervisor needs of a stack (segserve.launcher.Stack)."""

    processes: dict

    def restart(self, name: str) -> None: ...

    def wait_ready(self, name: str, timeout_s: float) -> None: ...

    def tail(self, name: str, num_lines: int) -> list[str]: ...


def describe_exit(returncode: int) -> str:
    """"exit code 3" or "signal SIGKILL" (a Popen's negative returncode)."""
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-returncode).name}"
        return f"signal {-returncode}"
    return f"exit code {returncode}"


class GaveUp(Exception):
    """A service exhausted its restarts."""


class Supervisor:
    """Watches `services.processes` and restarts what exits (see the module's docstring)."""

    def __init__(self, services: Services, policy: RestartPolicy = RestartPolicy(), poll_s: float = 0.1,
                 ready_timeout_s: float = 300.0, num_tail_lines: int = 20, is_subreaper: bool = True):
        self.services = services
        self.policy = policy
        self.poll_s = poll_s
        self.ready_timeout_s = ready_timeout_s
        self.num_tail_lines = num_tail_lines
        self.restarts: dict[str, deque[float]] = {}
        """Service name -> when it was restarted, within the window."""
        self.num_restarts = 0
        self._due: dict[str, float] = {}
        """Service name -> when its restart is due (it exited, and waits out its back-off)."""
        self._exited_at: dict[str, float] = {}
        self._stop = threading.Event()
        self._baseline = {child.pid for child in psutil.Process().children()}
        if is_subreaper:
            set_subreaper(True)

    def stop(self) -> None:
        """End run() at its next poll (from a signal handler or another thread)."""
        self._stop.set()

    def run(self) -> None:
        """Supervise until stop(); raises GaveUp when a service exits once more than its restarts allow."""
        while not self._stop.wait(self.poll_s):
            self.check()

    def check(self) -> None:
        """One round: note the services that exited, and restart those whose back-off is over."""
        now = time.monotonic()
        for name, proc in list(self.services.processes.items()):
            if name not in self._due and proc.poll() is not None:
                self._on_exit(name, proc.returncode, now)
        for name, due in list(self._due.items()):
            if now >= due and not self._stop.is_set():
                del self._due[name]
                self._restart(name)

    def _on_exit(self, name: str, returncode: int, now: float) -> None:
        self._reap_orphans()
        lines = self.services.tail(name, self.num_tail_lines)
        last = "\n".join(f"    {line}" for line in lines)
        logger.error("%s exited unexpectedly (%s)%s", name, describe_exit(returncode),
                     f"; its last lines:\n{last}" if last else "")
        recent = self.restarts.setdefault(name, deque())
        while recent and now - recent[0] > self.policy.window_s:
            recent.popleft()
        if len(recent) >= self.policy.max_restarts:
            cause = last_exception(lines)
            raise GaveUp(f"{name} exited ({describe_exit(returncode)}) after {len(recent)} restart(s) within "
                         f"{self.policy.window_s:.0f} s (--max-restarts {self.policy.max_restarts})"
                         + (f": {cause}" if cause else ""))
        delay = self.policy.delay_s(len(recent))
        logger.warning("restarting %s in %.1f s (restart %d of %d allowed within %.0f s)", name, delay,
                       len(recent) + 1, self.policy.max_restarts, self.policy.window_s)
        self._exited_at[name] = now
        self._due[name] = now + delay

    def _restart(self, name: str) -> None:
        self._reap_orphans()  # again: a dead service's descendants re-parent here some time after it died
        self.restarts[name].append(time.monotonic())
        self.num_restarts += 1
        self.services.restart(name)
        threading.Thread(target=self._report_ready, args=(name, self._exited_at[name]), daemon=True,
                         name=f"ready-{name}").start()

    def _report_ready(self, name: str, exited_at: float) -> None:
        try:
            self.services.wait_ready(name, self.ready_timeout_s)
        except Exception as exc:  # it died again (the next check() says so) or never got ready
            logger.warning("%s did not get ready after its restart: %s", name, exc)
            return
        logger.info("%s is back: ready %.1f s after it exited", name, time.monotonic() - exited_at)

    def _reap_orphans(self) -> None:
        """Kill (and reap) the processes a dead service left behind, which came to this subreaper."""
        services = {proc.pid for proc in self.services.processes.values()}
        for child in psutil.Process().children():
            if child.pid in services or child.pid in self._baseline:
                continue
            with contextlib.suppress(psutil.Error):
                for process in [*child.children(recursive=True), child]:
                    process.kill()
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child.pid, 0)


def set_subreaper(is_subreaper: bool) -> None:
    """Whether orphaned descendants re-parent to this process rather than to init (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(is_subreaper), 0, 0, 0)
