"""The local launcher's start-up: services bind their own ports and report them, and are reached there; a service
not ready in time is reported with the end of its log; local workers get the
machine's CPUs but one as torch threads; without a log directory a service's output comes through, line by line
after its name, and its last lines are kept for the supervisor."""

from __future__ import annotations

import json
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

    def send_signal(self, signum: int) -> None:
        self.returncode = -signum

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


def reporting_spawn(stack: Stack, spawned: dict, ports=None, dies: str = "") -> None:
    """Replace the stack's _spawn by one that runs nothing: each service "binds" its config's port, or for port 0
    the next of `ports`, and reports it as a real one does (common/ports.py), the router its gRPC port too; the
    service named `dies` exits at start-up instead, without reporting."""
    ports = ports if ports is not None else iter(range(40001, 40100))

    def spawn(name, config, command=None):
        spawned[name] = config
        stack.processes[name] = _Process(3 if name == dies else None)
        if name == dies:
            stack._tails[name] = deque(["Traceback (most recent call last):", "OSError: cannot bind"])
            return
        bound = {"port": config.port or next(ports)}
        if name == "router" and config.is_grpc_api:
            bound["grpc_port"] = config.grpc_port or next(ports)
        stack._ports_file(name).write_text(json.dumps(bound))

    stack._spawn = spawn


def started_stack(monkeypatch, tmp_path, config: StackConfig, dies: str = "") -> tuple[Stack, dict]:
    """A stack started with reporting_spawn, every health check answered at once: it and the configs it spawned."""
    monkeypatch.setattr(launcher, "resolve_model", lambda model: tmp_path)
    stack, spawned = Stack(config), {}
    reporting_spawn(stack, spawned, dies=dies)
    monkeypatch.setattr(stack, "_wait_grpc_ready", lambda name, *_: stack._check_alive(name))
    monkeypatch.setattr(stack, "_wait_http_ready", lambda *_: stack._check_alive("router"))
    stack.start()
    return stack, spawned


def test_services_asked_for_port_0_are_reached_on_the_ports_they_report(monkeypatch, tmp_path):
    """Nothing picks a port for another process: each service binds one and reports it, and the launcher gives
    the next service the addresses reported (the scheduler its workers' and drafters', the router its
    scheduler's) and takes its own URLs from the router's."""
    config = StackConfig(num_workers=2, num_drafters=2, worker=WorkerConfig(port=0), drafter=DrafterConfig(port=0),
                         scheduler=SchedulerConfig(port=0), router=RouterConfig(port=0, grpc_port=0))
    stack, spawned = started_stack(monkeypatch, tmp_path, config)
    assert [spawned[name].port for name in ("worker", "worker-1", "drafter", "drafter-1", "scheduler", "router")] \
        == [0] * 6
    assert [w.port for w in stack.worker_configs] == [40001, 40002]  # as restart() spawns them again
    assert [d.port for d in stack.drafter_configs] == [40003, 40004]
    scheduler = spawned["scheduler"]
    assert scheduler.worker_address == "127.0.0.1:40001,127.0.0.1:40002"
    assert scheduler.drafter_addresses == ["127.0.0.1:40003", "127.0.0.1:40004"]
    assert spawned["router"].scheduler_address == "127.0.0.1:40005" == f"127.0.0.1:{stack.config.scheduler.port}"
    assert stack.base_url.endswith(":40006") and stack.grpc_address.endswith(":40007")


def test_ports_the_user_chose_are_passed_on_as_they_are(monkeypatch, tmp_path):
    config = StackConfig(worker=WorkerConfig(port=50061), drafter=DrafterConfig(port=50071),
                         scheduler=SchedulerConfig(port=50051), router=RouterConfig(port=50080, grpc_port=50081))
    monkeypatch.setattr(launcher, "is_free", lambda *_, **__: True)
    stack, spawned = started_stack(monkeypatch, tmp_path, config)
    assert [spawned[name].port for name in ("worker", "drafter", "scheduler", "router")] == [50061, 50071, 50051,
                                                                                             50080]
    assert stack.base_url.endswith(":50080") and stack.grpc_address.endswith(":50081")


def test_a_service_that_dies_before_reporting_its_port_fails_the_start_with_its_error(monkeypatch, tmp_path):
    with pytest.raises(RuntimeError, match="drafter exited with code 3 during start-up: OSError: cannot bind"):
        started_stack(monkeypatch, tmp_path, StackConfig(is_speculative=False), dies="drafter")


def test_a_service_that_never_reports_a_port_is_not_ready(tmp_path):
    stack = Stack(StackConfig(log_dir=str(tmp_path)))
    stack.processes["scheduler"] = _Process(None)  # alive, never binds
    with pytest.raises(TimeoutError, match=r"^scheduler at 127\.0\.0\.1:\d+ was not ready in time \(last: no port "):
        stack._wait_started("scheduler", time.monotonic() + 0.5)


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
    """The configs the stack's start() spawns its workers with (nothing is spawned; ports as reported)."""
    stack, spawned = started_stack(monkeypatch, tmp_path, config)
    workers = [c for name, c in spawned.items() if name.startswith("worker")]
    assert [w.num_threads for w in workers] == [w.num_threads for w in stack.worker_configs]
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
