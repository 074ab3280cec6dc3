"""The supervisor over real processes (sleeping Pythons) killed with SIGKILL: restart with back-off, the window,
giving up with the service's name, exit descriptions, and the orphans a dead service leaves."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import psutil
import pytest

from segserve.supervisor import GaveUp, RestartPolicy, Supervisor, describe_exit, set_subreaper

SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"]


class Sleepers:
    """Services that are sleeping Pythons; `argv` of a name is what a restart of it runs."""

    def __init__(self, names: list[str], argv: dict[str, list[str]] | None = None):
        self.argv = argv or {}
        self.processes: dict[str, subprocess.Popen] = {}
        self.num_ready = 0
        for name in names:
            self.restart(name)

    def restart(self, name: str) -> None:
        self.processes[name] = subprocess.Popen(self.argv.get(name, SLEEPER), stdout=subprocess.DEVNULL)

    def wait_ready(self, name: str, timeout_s: float) -> None:
        self.num_ready += 1

    def tail(self, name: str, num_lines: int) -> list[str]:
        return [f"{name}'s last words"]

    def stop(self) -> None:
        for proc in self.processes.values():
            proc.kill()
            proc.wait()


@pytest.fixture
def sleepers():
    made = []

    def make(*args, **kwargs) -> Sleepers:
        made.append(Sleepers(*args, **kwargs))
        return made[-1]

    yield make
    for services in made:
        services.stop()


def run_until(supervisor: Supervisor, predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        supervisor.check()
        time.sleep(0.02)


def test_a_killed_service_is_named_with_its_signal_and_restarted_while_the_others_run(sleepers, caplog):
    services = sleepers(["worker", "worker-1", "drafter"])
    others = {name: services.processes[name].pid for name in ("worker", "drafter")}
    supervisor = Supervisor(services, RestartPolicy(backoff_s=0.2), is_subreaper=False)
    victim = services.processes["worker-1"]
    caplog.set_level(logging.INFO)
    victim.kill()
    killed_at = time.monotonic()
    run_until(supervisor, lambda: services.processes["worker-1"] is not victim)
    assert time.monotonic() - killed_at >= 0.2  # after its back-off
    assert services.processes["worker-1"].poll() is None
    assert {name: services.processes[name].pid for name in others} == others  # nobody else was touched
    assert "worker-1 exited unexpectedly (signal SIGKILL); its last lines:\n    worker-1's last words" in caplog.text
    run_until(supervisor, lambda: "worker-1 is back" in caplog.text)
    assert supervisor.num_restarts == 1


def test_the_back_off_doubles_and_a_service_past_max_restarts_in_the_window_stops_the_stack(sleepers):
    crasher = [sys.executable, "-c", "raise SystemExit(3)"]
    services = sleepers(["router"], {"router": crasher})
    supervisor = Supervisor(services, RestartPolicy(max_restarts=3, window_s=60, backoff_s=0.1, max_backoff_s=0.3),
                            is_subreaper=False)
    started = time.monotonic()
    with pytest.raises(GaveUp, match=r"router exited \(exit code 3\) after 3 restart\(s\) within 60 s"):
        run_until(supervisor, lambda: False)
    # waits of 0.1, 0.2 and 0.3 (capped) before the three restarts
    assert time.monotonic() - started >= 0.6 and supervisor.num_restarts == 3


def test_giving_up_names_the_exception_the_service_last_printed(sleepers, monkeypatch):
    services = sleepers(["worker"], {"worker": [sys.executable, "-c", "raise SystemExit(1)"]})
    monkeypatch.setattr(services, "tail", lambda name, num_lines: [
        "Traceback (most recent call last):", '  File "worker/server.py", line 180, in start_server',
        "OSError: cannot bind the worker to 127.0.0.1:50061"])
    supervisor = Supervisor(services, RestartPolicy(max_restarts=1, window_s=60, backoff_s=0.1, max_backoff_s=0.1),
                            is_subreaper=False)
    with pytest.raises(GaveUp, match=r"after 1 restart\(s\) within 60 s \(--max-restarts 1\): "
                                     r"OSError: cannot bind the worker to 127\.0\.0\.1:50061$"):
        run_until(supervisor, lambda: False)


def test_restarts_older_than_the_window_no_longer_count(sleepers):
    services = sleepers(["drafter"])
    supervisor = Supervisor(services, RestartPolicy(max_restarts=1, window_s=0.5, backoff_s=0.0), is_subreaper=False)

    def kill_and_restart() -> None:
        victim = services.processes["drafter"]
        victim.kill()
        run_until(supervisor, lambda: services.processes["drafter"] is not victim)

    kill_and_restart()
    time.sleep(0.6)  # the first restart leaves the window
    kill_and_restart()
    services.processes["drafter"].kill()  # at once: a second exit within the window
    with pytest.raises(GaveUp, match="after 1 restart"):
        run_until(supervisor, lambda: False)
    assert supervisor.num_restarts == 2


def test_max_restarts_zero_gives_up_at_the_first_exit(sleepers):
    services = sleepers(["scheduler"])
    supervisor = Supervisor(services, RestartPolicy(max_restarts=0), is_subreaper=False)
    services.processes["scheduler"].kill()
    with pytest.raises(GaveUp, match="scheduler exited"):
        run_until(supervisor, lambda: False)
    assert supervisor.num_restarts == 0


def test_what_a_dead_service_started_is_killed_instead_of_outliving_it(sleepers):
    """A service whose own child outlives it (as Ray's agents outlive a killed scheduler) leaves no orphan."""
    spawner = [sys.executable, "-c",
               "import subprocess, sys, time; "
               f"child = subprocess.Popen({SLEEPER!r}); print(child.pid, flush=True); time.sleep(120)"]
    services = sleepers([])
    services.processes["scheduler"] = subprocess.Popen(spawner, stdout=subprocess.PIPE, text=True)
    grandchild = psutil.Process(int(services.processes["scheduler"].stdout.readline()))
    supervisor = Supervisor(services, RestartPolicy(backoff_s=0.0))  # this test process becomes the subreaper
    try:
        services.argv["scheduler"] = SLEEPER
        services.processes["scheduler"].kill()
        run_until(supervisor, lambda: services.processes["scheduler"].args == SLEEPER)
        assert psutil.wait_procs([grandchild], timeout=10)[1] == []
    finally:
        set_subreaper(False)


def test_exits_are_described_by_code_or_signal():
    assert describe_exit(-9) == "signal SIGKILL"
    assert describe_exit(-15) == "signal SIGTERM"
    assert describe_exit(1) == "exit code 1"


@pytest.mark.parametrize("kwargs", [{"max_restarts": -1}, {"window_s": 0}, {"backoff_s": 5, "max_backoff_s": 1}])
def test_a_bad_policy_is_refused(kwargs):
    with pytest.raises(ValueError):
        RestartPolicy(**kwargs)
