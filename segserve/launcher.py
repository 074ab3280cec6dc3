"""Start worker, drafter, scheduler and router as separate local processes, and stop them.

`segserve serve` and the end-to-end tests and benchmarks use the same `Stack`.
Each service runs as `python -m segserve.cli <service> <flags>` so that the local
stack is the same code path as a pod on a cluster.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
import httpx

from drafter.config import DrafterConfig
from protos.segserve.v1 import common_pb2, drafter_pb2_grpc, scheduler_pb2_grpc, worker_pb2_grpc
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from segserve.checkpoint import resolve_model
from segserve.flags import to_argv
from worker.config import WorkerConfig


@dataclass
class StackConfig:
    """One local deployment: the three services' configs (ports 0 = pick free ones)."""

    worker: WorkerConfig = field(default_factory=WorkerConfig)
    """The worker's config; its model is shared with the router."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """The scheduler's config; its worker_address is set by the launcher."""
    router: RouterConfig = field(default_factory=RouterConfig)
    """The router's config; its scheduler_address is set by the launcher."""
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    """The drafter's config; its tokenizer (the served model) is set by the launcher."""
    is_speculative: bool = True
    """Run a drafter and decode speculatively; False = plain decoding, no drafter process."""
    startup_timeout_s: float = 300.0
    """How long to wait for every service to report ready."""
    log_dir: str | None = None
    """Write each service's output to <log_dir>/<service>.log instead of the terminal."""

    def __post_init__(self) -> None:
        if self.startup_timeout_s <= 0:
            raise ValueError("startup_timeout_s must be > 0")


_ROUTER_PORT_ATTEMPTS = 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Stack:
    """Context manager running a whole segserve deployment on this machine."""

    def __init__(self, config: StackConfig):
        self.config = config
        self.processes: dict[str, subprocess.Popen] = {}
        self._logs: list[IO] = []

    @property
    def base_url(self) -> str:
        return f"http://{self.config.router.host}:{self.config.router.port}"

    def __enter__(self) -> "Stack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        cfg = self.config
        model_dir = str(resolve_model(cfg.worker.model))  # converts the default model once, with a progress bar
        worker = dataclasses.replace(cfg.worker, model=model_dir, port=cfg.worker.port or free_port())
        worker_address = f"{worker.host}:{worker.port}"
        drafter = dataclasses.replace(cfg.drafter, tokenizer=model_dir, port=cfg.drafter.port or free_port())
        drafter_address = f"{drafter.host}:{drafter.port}"
        scheduler = dataclasses.replace(cfg.scheduler, worker_address=worker_address,
                                        drafter_addresses=[drafter_address] if cfg.is_speculative else [],
                                        port=cfg.scheduler.port or free_port())
        scheduler_address = f"{scheduler.host}:{scheduler.port}"
        router = dataclasses.replace(cfg.router, model=model_dir, scheduler_address=scheduler_address,
                                     served_model_name=cfg.router.served_model_name or worker.served_model_name)
        self.config = dataclasses.replace(cfg, worker=worker, scheduler=scheduler, router=router, drafter=drafter)
        deadline = time.monotonic() + cfg.startup_timeout_s
        try:
            self._spawn("worker", worker)
            self._wait_grpc_ready("worker", worker_pb2_grpc.WorkerStub, worker_address, deadline)
            if cfg.is_speculative:
                self._spawn("drafter", drafter)
                self._wait_grpc_ready("drafter", drafter_pb2_grpc.DrafterStub, drafter_address, deadline)
            self._spawn("scheduler", scheduler)
            self._wait_grpc_ready("scheduler", scheduler_pb2_grpc.SchedulerStub, scheduler_address, deadline)
            self._start_router(router, deadline)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every service (router first), then SIGKILL whatever outlives the timeout."""
        for name in ("router", "scheduler", "drafter", "worker"):
            proc = self.processes.get(name)
            if proc and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in self.processes.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.processes.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def wait(self) -> int:
        """Block until any service exits; return its exit code."""
        while True:
            for proc in self.processes.values():
                if proc.poll() is not None:
                    return proc.returncode
            time.sleep(0.5)

    def _start_router(self, router: RouterConfig, deadline: float) -> None:
        """Spawn the router and wait for its /health. A port picked here (port 0) is picked just before the
        spawn, and picked again if the router dies at start-up: while the other services started, any of
        them (Ray opens ports of its own) may have bound the one picked earlier."""
        attempts = 1 if router.port else _ROUTER_PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            config = router if router.port else dataclasses.replace(router, port=free_port())
            self.config = dataclasses.replace(self.config, router=config)
            self._spawn("router", config)
            try:
                self._wait_http_ready(deadline)
                return
            except RuntimeError:
                if attempt == attempts or self.processes["router"].poll() is None:
                    raise

    def _spawn(self, name: str, config) -> None:
        argv = [sys.executable, "-m", "segserve.cli", name, *to_argv(config)]
        out = None
        if self.config.log_dir:
            Path(self.config.log_dir).mkdir(parents=True, exist_ok=True)
            out = open(Path(self.config.log_dir) / f"{name}.log", "ab")
            self._logs.append(out)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.processes[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT if out else None, env=env)

    def _check_alive(self, name: str) -> None:
        proc = self.processes[name]
        if proc.poll() is not None:
            where = f" (see {self.config.log_dir}/{name}.log)" if self.config.log_dir else ""
            raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up{where}")

    def _wait_grpc_ready(self, name: str, stub_cls, address: str, deadline: float) -> None:
        with grpc.insecure_channel(address) as channel:
            stub = stub_cls(channel)
            while time.monotonic() < deadline:
                self._check_alive(name)
                try:
                    if stub.Health(common_pb2.HealthRequest(), timeout=2.0).ready:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        raise TimeoutError(f"{name} at {address} was not ready in time")

    def _wait_http_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            self._check_alive("router")
            try:
                if httpx.get(self.base_url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"router at {self.base_url} was not ready in time")
