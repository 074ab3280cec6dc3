"""The local launcher's start-up: a service whose auto-picked port was taken meanwhile is started again on
another; a service not ready in time is reported with the end of its log; local workers get the
machine's CPUs but one as torch threads; without a log directory a service's output comes through, line by line
after its name, and its last lines are kept for the supervisor."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections import deque

import pytest

import segserve.launcher as launcher
from common.ports import free_port
from drafter.config import DrafterConfig
from protos.segserve.v1 import scheduler_pb2_grpc
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from segserve.launcher import Stack, StackConfig
from worker.config import WorkerConfig


class _Process:
    def __init__(self, returncode: int | None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


_READINESS_POLLS = {"router": "_wait_http_ready", "scheduler": "_wait_grpc_ready"}


def _stack_whose_service_dies(monkeypatch, service: str, num_deaths: int) -> tuple[Stack, list[int]]:
    """A Stack whose first `num_deaths` spawns of `service` exit at start-up (as on a port taken meanwhile)."""
    ports = iter(range(40001, 40100))
    monkeypatch.setattr(launcher, "free_port", lambda: next(ports))
    stack, spawned = Stack(StackConfig()), []

    def spawn(name, config):
        spawned.append(config.port)
        stack.processes[name] = _Process(3 if len(spawned) <= num_deaths else None)

    monkeypatch.setattr(stack, "_spawn", spawn)
    monkeypatch.setattr(stack, _READINESS_POLLS[service], lambda *_: stack._check_alive(service))
    return stack, spawned


def _stack_whose_router_dies(monkeypatch, num_deaths: int) -> tuple[Stack, list[int]]:
    return _stack_whose_service_dies(monkeypatch, "router", num_deaths)


def test_a_router_that_dies_at_start_up_gets_a_fresh_port(monkeypatch):
    stack, spawned = _stack_whose_router_dies(monkeypatch, num_deaths=2)
    stack._start_router(RouterConfig(port=0), deadline=0)
    assert spawned == [40001, 40002, 40003]
    assert stack.base_url.endswith(":40003")


def test_the_router_start_gives_up_after_a_few_ports(monkeypatch):
    stack, spawned = _stack_whose_router_dies(monkeypatch, num_deaths=10)
    with pytest.raises(RuntimeError, match="router exited with code 3"):
        stack._start_router(RouterConfig(port=0), deadline=0)
    assert len(spawned) == launcher._PORT_ATTEMPTS


def test_a_port_the_user_chose_is_not_replaced(monkeypatch):
    stack, spawned = _stack_whose_router_dies(monkeypatch, num_deaths=1)
    with pytest.raises(RuntimeError):
        stack._start_router(RouterConfig(port=8123), deadline=0)
    assert spawned == [8123]


def _stack_whose_scheduler_dies(monkeypatch, num_deaths: int) -> tuple[Stack, list[int]]:
    """Its scheduler dies instead (Ray's processes took the picked port)."""
    return _stack_whose_service_dies(monkeypatch, "scheduler", num_deaths)


def test_a_scheduler_that_dies_at_start_up_gets_a_fresh_port_when_the_port_was_picked(monkeypatch):
    stack, spawned = _stack_whose_scheduler_dies(monkeypatch, num_deaths=2)
    started = stack._start_scheduler(SchedulerConfig(port=40999), deadline=0, is_port_picked=True)
    assert spawned == [40999, 40001, 40002] and started.port == 40002
    assert stack.config.scheduler.port == 40002


def test_a_scheduler_port_the_user_chose_is_not_replaced(monkeypatch):
    stack, spawned = _stack_whose_scheduler_dies(monkeypatch, num_deaths=1)
    with pytest.raises(RuntimeError, match="scheduler exited with code 3"):
        stack._start_scheduler(SchedulerConfig(port=50051), deadline=0, is_port_picked=False)
    assert spawned == [50051]


def _drafters_whose_first_dies(monkeypatch, last_line: str, num_drafters: int = 2,
                               port: int = 0) -> tuple[Stack, list[tuple[str, int]]]:
    """A Stack of `num_drafters` drafters whose first spawn of drafter-1 exits at start-up, `last_line` its last
    output; every other spawn comes up."""
    ports = iter(range(40001, 40100))
    monkeypatch.setattr(launcher, "free_port", lambda: next(ports))
    stack = Stack(StackConfig(num_drafters=num_drafters, drafter=DrafterConfig(port=port)))
    stack.drafter_configs = stack._drafter_configs("model")
    spawned = []

    def spawn(name, config, command=None):
        is_dying = name == ("drafter-1" if num_drafters > 1 else "drafter") and not any(n == name for n, _ in spawned)
        spawned.append((name, config.port))
        stack.processes[name] = _Process(1 if is_dying else None)
        stack._tails[name] = deque(["Traceback (most recent call last):", last_line] if is_dying else [])

    monkeypatch.setattr(stack, "_spawn", spawn)
    monkeypatch.setattr(stack, "_wait_grpc_ready", lambda name, *_: stack._check_alive(name))
    return stack, spawned


def test_a_replica_whose_picked_port_was_taken_meanwhile_starts_again_on_another(monkeypatch):
    stack, spawned = _drafters_whose_first_dies(monkeypatch, "OSError: cannot bind the drafter to 127.0.0.1:40002")
    stack._start_replicas("drafter", deadline=0, is_port_picked=True)
    assert spawned == [("drafter", 40001), ("drafter-1", 40002), ("drafter-1", 40003)]
    assert [d.port for d in stack.drafter_configs] == [40001, 40003]  # the addresses the scheduler is given


def test_a_replica_that_dies_for_another_reason_is_not_started_again(monkeypatch):
    stack, spawned = _drafters_whose_first_dies(monkeypatch, "ValueError: corpus_dir /x is not a directory")
    with pytest.raises(RuntimeError, match="drafter-1 exited with code 1 during start-up: ValueError: corpus_dir"):
        stack._start_replicas("drafter", deadline=0, is_port_picked=True)
    assert spawned == [("drafter", 40001), ("drafter-1", 40002)]


def test_a_replica_port_the_user_chose_is_not_replaced(monkeypatch):
    stack, spawned = _drafters_whose_first_dies(monkeypatch, "OSError: cannot bind the drafter to 127.0.0.1:50071",
                                                num_drafters=1, port=50071)
    with pytest.raises(RuntimeError, match="cannot bind the drafter to 127.0.0.1:50071"):
        stack._start_replicas("drafter", deadline=0, is_port_picked=False)
    assert spawned == [("drafter", 50071)]


def test_a_chosen_port_held_by_another_process_stops_the_start_before_anything_runs(monkeypatch):
    """Another stack's worker on the default port would answer this one's health check: refused up front."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        stack = Stack(StackConfig(worker=WorkerConfig(port=port), router=RouterConfig(port=0, is_grpc_api=False),
                                  scheduler=SchedulerConfig(port=0), drafter=DrafterConfig(port=0)))
        monkeypatch.setattr(stack, "_spawn", lambda *_: pytest.fail("spawned"))
        with pytest.raises(RuntimeError, match=rf"^port {port} \(worker\) already in use on this machine"):
            stack.start()


def test_a_service_not_ready_in_time_is_reported_with_its_last_answer_and_the_end_of_its_log(tmp_path):
    stack = Stack(StackConfig(log_dir=str(tmp_path)))
    stack.processes["scheduler"] = _Process(None)  # alive, never ready
    (tmp_path / "scheduler.log").write_text("".join(f"line {i}\n" for i in range(100)))
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(TimeoutError) as raised:
        stack._wait_grpc_ready("scheduler", scheduler_pb2_grpc.SchedulerStub, address, time.monotonic() + 1.0,
                               SchedulerConfig())
    message = str(raised.value)
    assert message.startswith(f"scheduler at {address} was not ready in time (last: Health: UNAVAILABLE)")
    assert message.endswith("\n".join(f"line {i}" for i in range(60, 100)))
    assert "line 59\n" not in message


def started_workers(monkeypatch, tmp_path, config: StackConfig) -> list[WorkerConfig]:
    """The configs the stack's start() spawns its workers with (nothing is spawned)."""
    monkeypatch.setattr(launcher, "resolve_model", lambda model: tmp_path)
    stack, spawned = Stack(config), {}
    monkeypatch.setattr(stack, "_spawn", lambda name, config, command=None: spawned.update({name: config}))
    monkeypatch.setattr(stack, "_wait_grpc_ready", lambda *_: None)
    monkeypatch.setattr(stack, "_start_scheduler", lambda scheduler, *_, **__: scheduler)
    monkeypatch.setattr(stack, "_start_router", lambda *_: None)
    stack.start()
    workers = [c for name, c in spawned.items() if name.startswith("worker")]
    assert workers == stack.worker_configs  # as restart() spawns them again
    return workers


@pytest.mark.parametrize(("num_threads", "expected"), [(0, None), (3, 3)])
def test_local_workers_get_all_cpus_but_one_unless_told(monkeypatch, tmp_path, num_threads, expected):
    monkeypatch.setattr(launcher, "available_cpus", lambda: 5)
    config = StackConfig(worker=WorkerConfig(num_threads=num_threads), num_workers=2, is_speculative=False)
    workers = started_workers(monkeypatch, tmp_path, config)
    assert len(workers) == 2
    assert {w.num_threads for w in workers} == {expected or (5 - 1) // 2}


@pytest.mark.parametrize("is_pinned", [True, False])
def test_a_pinned_stack_binds_each_workers_compute_threads_to_its_cpus(monkeypatch, tmp_path, is_pinned):
    monkeypatch.setattr(launcher, "available_cpus", lambda: 5)
    monkeypatch.setattr(launcher, "local_cpu_sets", lambda num_workers: ([{1, 2}, {3, 4}], {0}))
    monkeypatch.setattr(Stack, "_is_pinnable", staticmethod(lambda cfg: cfg.is_cpu_pinned))
    config = StackConfig(num_workers=2, is_speculative=False, is_cpu_pinned=is_pinned)
    workers = started_workers(monkeypatch, tmp_path, config)
    assert [w.compute_cpus for w in workers] == (["1,2", "3,4"] if is_pinned else ["", ""])


def test_without_a_log_dir_each_service_line_comes_through_after_its_name_and_its_tail_is_kept(tmp_path, capfd):
    stack = Stack(StackConfig(log_dir=None))
    script = "import sys; print('loading'); print('x' * 200000); print('boom', file=sys.stderr)"
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stack.processes["worker-1"] = process
    tail = stack._tails["worker-1"] = deque(maxlen=launcher._TAIL_LINES)
    forward = threading.Thread(target=launcher._forward, args=("worker-1", process.stdout, tail))
    forward.start()
    assert process.wait(timeout=30) == 0  # a line longer than a pipe's buffer did not block it
    forward.join(timeout=30)
    assert stack.tail("worker-1", 2) == ["x" * 200000, "boom"]
    assert "worker-1 | loading\n" in capfd.readouterr().out
