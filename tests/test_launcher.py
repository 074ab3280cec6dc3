"""The local launcher's start-up: a router whose auto-picked port was taken meanwhile is started again on another."""

from __future__ import annotations

import pytest

import segserve.launcher as launcher
from router.config import RouterConfig
from segserve.launcher import Stack, StackConfig


class _Process:
    def __init__(self, returncode: int | None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode


def _stack_whose_router_dies(monkeypatch, num_deaths: int) -> tuple[Stack, list[int]]:
    """A Stack whose first `num_deaths` routers exit at start-up (as on a port taken meanwhile)."""
    ports = iter(range(40001, 40100))
    monkeypatch.setattr(launcher, "free_port", lambda: next(ports))
    stack, spawned = Stack(StackConfig()), []

    def spawn(name, config):
        spawned.append(config.port)
        stack.processes[name] = _Process(3 if len(spawned) <= num_deaths else None)

    def wait_http_ready(deadline):
        stack._check_alive("router")

    monkeypatch.setattr(stack, "_spawn", spawn)
    monkeypatch.setattr(stack, "_wait_http_ready", wait_http_ready)
    return stack, spawned


def test_a_router_that_dies_at_start_up_gets_a_fresh_port(monkeypatch):
    stack, spawned = _stack_whose_router_dies(monkeypatch, num_deaths=2)
    stack._start_router(RouterConfig(port=0), deadline=0)
    assert spawned == [40001, 40002, 40003]
    assert stack.base_url.endswith(":40003")


def test_the_router_start_gives_up_after_a_few_ports(monkeypatch):
    stack, spawned = _stack_whose_router_dies(monkeypatch, num_deaths=10)
    with pytest.raises(RuntimeError, match="router exited with code 3"):
        stack._start_router(RouterConfig(port=0), deadline=0)
    assert len(spawned) == launcher._ROUTER_PORT_ATTEMPTS


def test_a_port_the_user_chose_is_not_replaced(monkeypatch):
    stack, spawned = _stack_whose_router_dies(monkeypatch, num_deaths=1)
    with pytest.raises(RuntimeError):
        stack._start_router(RouterConfig(port=8123), deadline=0)
    assert spawned == [8123]
