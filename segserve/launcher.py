"""Start worker, drafter, scheduler and router as separate local processes, and stop them.

`segserve serve` and the end-to-end tests and benchmarks use the same `Stack`.
Each service runs as `python -m segserve.cli <service> <flags>` so that the local
stack is the same code path as a pod on a cluster; secrets (the router's API keys)
go in the child's environment, never on its command line. Each config's internal
TLS files reach its process as flags; the launcher's own readiness checks dial each
service with that service's files. A service not given a port binds any free one and
reports it (common/ports.py); the launcher waits for that report, then for its health,
and tells the services started after it (and a restart) that port.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
import httpx

from drafter.config import DrafterConfig
from protos.segserve.v1 import common_pb2, drafter_pb2_grpc, scheduler_pb2_grpc, worker_pb2_grpc
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from common.checkpoint import resolve_model
from common.ports import PORTS_FILE_VAR, is_free, read_ports
from segserve.flags import env_names, to_argv, to_env
from common.tls import internal_tls, open_blocking_channel
from worker.config import WorkerConfig
from worker.threads import available_cpus, format_cpu_list


SERVICE_CPU_MIN_CPUS = 4
"""From this many CPUs on, a local stack keeps one CPU for the router, scheduler and drafters (a quarter of the
machine at most); below it, the workers compute on every CPU and the services take turns with them. On the 2-core
CPU, the default model through the router against vLLM on its default placement (one core for its engine, one for its
API server), 2026-11-29: with one CPU kept, segserve 0.89x, 0.95x and 0.87x vLLM's tokens/s at 1, 16 and 64
streams; computing on both, 1.19x, 1.30x and 1.27x (medians of three alternated rounds, docs/performance/vllm.md)."""


def local_worker_threads(num_workers: int) -> int:
    """torch threads of each local worker: the CPUs this process may use, shared among the workers, but one kept
    for the router, scheduler and drafters (and clients) on the same machine where it has SERVICE_CPU_MIN_CPUS;
    at least 1. A worker whose threads outnumber the CPUs it may use waits at every parallel op's barrier
    (worker/threads.py)."""
    cpus = available_cpus()
    return max(1, (cpus - (cpus >= SERVICE_CPU_MIN_CPUS)) // num_workers)


def local_cpu_sets(num_workers: int) -> tuple[list[set[int]], set[int]] | None:
    """CPU pinning of a local stack: the CPUs of each worker, and the CPUs the router, scheduler (and its Ray
    processes) and drafters share, out of this process's affinity mask: with SERVICE_CPU_MIN_CPUS, the first CPU
    for the services and the rest shared out among the workers, as local_worker_threads() counts them; with fewer,
    every CPU shared out among the workers and the services on all of them. None where there is nothing to split:
    fewer CPUs than workers (+ 1 where one is kept), or a cgroup quota below the mask (the quota, not the CPUs,
    is the limit there)."""
    cpus = sorted(os.sched_getaffinity(0))
    is_kept = len(cpus) >= SERVICE_CPU_MIN_CPUS
    if len(cpus) < num_workers + is_kept or available_cpus() != len(cpus) or len(cpus) == 1:
        return None
    per_worker = local_worker_threads(num_workers)
    first = int(is_kept)
    workers = [set(cpus[first + i * per_worker:first + (i + 1) * per_worker]) for i in range(num_workers)]
    return workers, {cpus[0]} if is_kept else set(cpus)


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
    """Run drafters and decode speculatively; False = plain decoding, with the drafters learning only (the
    scheduler's max_draft_nodes is 0: it asks for no tree, and the drafters still learn every request's segments)."""
    num_workers: int = 1
    """Worker processes (data parallel: each loads the model and has its own KV pool); the scheduler drives all."""
    is_ray_workers: bool = False
    """Run the workers as Ray actors on the scheduler's --ray-address cluster (one GPU each when the cluster has
    GPUs) instead of local processes."""
    num_drafters: int = 1
    """Drafter replicas. They write what they learn to a log, the drafter's shared_log_dir (or <corpus_dir>/log,
    else a temporary directory of the stack's): several replicas share it, and a replica restarted after it died
    (even a lone one) replays it."""
    startup_timeout_s: float = 300.0
    """How long to wait for every service to report ready."""
    log_dir: str | None = None
    """Write each service's output to <log_dir>/<service>.log instead of the terminal."""
    is_cpu_pinned: bool = True
    """Bind each local CPU worker's compute threads to the CPUs its torch threads use (WorkerConfig.compute_cpus;
    its gRPC threads keep every CPU) and, from SERVICE_CPU_MIN_CPUS CPUs on, pin the other services to the CPU kept
    for them (local_cpu_sets), as vLLM's CPU backend binds its threads: the worker's step then runs without the
    router, scheduler and drafters taking turns on its cores. Only where the launcher chose the workers' thread
    count, and they run on the CPU."""

    def __post_init__(self) -> None:
        if self.startup_timeout_s <= 0:
            raise ValueError("startup_timeout_s must be > 0")
        if self.num_drafters < 1 or self.num_workers < 1:
            raise ValueError("num_workers and num_drafters must be >= 1")
        if self.is_ray_workers and not self.scheduler.ray_address:
            raise ValueError("Ray workers need the scheduler's ray_address (--ray-address)")


_HEALTH_STUBS = {"worker": worker_pb2_grpc.WorkerStub, "drafter": drafter_pb2_grpc.DrafterStub,
                 "scheduler": scheduler_pb2_grpc.SchedulerStub}
"""The stub whose Health RPC says a service is ready, by its command."""
_TAIL_LINES = 200
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Failed|Exit)(?:: |$)"
                             r"|^segserve: error: ")
"""The last line of a Python traceback (`worker.self_check.SelfCheckFailed: BloomForCausalLM is not served: ...`)
or the CLI's error line (a bad flag, a model the worker cannot size)."""


def _forward(name: str, output: IO[bytes], tail: deque[str]) -> None:
    """Copy a service's output to this process's, each line after the service's name, keeping the last ones.
    It reads to the end whatever happens to this process's stdout: a service never blocks on a full pipe."""
    prefix = f"{name} | "
    for line in output:
        text = line.decode(errors="replace").rstrip("\n")
        tail.append(text)
        with contextlib.suppress(Exception):  # a closed or replaced stdout: the line is kept in the tail only
            print(prefix + text, flush=True)


def last_exception(lines: list[str]) -> str:
    """The last exception (or CLI error) a service printed among `lines` of its output, "" when none: the reason
    it exited (`worker.self_check.SelfCheckFailed: BloomForCausalLM is not served: ...`)."""
    causes = [line.strip() for line in lines if _EXCEPTION_LINE.match(line)]
    return causes[-1].removeprefix("segserve: error: ") if causes else ""


def replica_name(service: str, index: int) -> str:
    """The process name of a service's replica `index`: worker, worker-1, worker-2, ..."""
    return service if index == 0 else f"{service}-{index}"


class Stack:
    """Context manager running a whole segserve deployment on this machine."""

    def __init__(self, config: StackConfig):
        self.config = config
        self.processes: dict[str, subprocess.Popen] = {}
        """Service name ("worker", "drafter", "drafter-1", ...) -> its process."""
        self._logs: list[IO] = []
        self._tails: dict[str, deque[str]] = {}
        """Without a log_dir: each service's last lines of output, which _spawn forwards to this one's."""
        self._shared_dir: tempfile.TemporaryDirectory | None = None
        self._ports_dir = tempfile.TemporaryDirectory(prefix="segserve-ports-")
        """Where each service reports the ports it bound (common/ports.py: <name>.json)."""
        self._ray_actors: list = []
        """Worker actors, with is_ray_workers."""
        self._ray_groups: list = []
        """The tensor-parallel Ray workers' placement groups, removed at stop."""
        self.worker_configs: list[WorkerConfig] = []
        """Every worker's config as started (worker i is process replica_name("worker", i))."""
        self.drafter_configs: list[DrafterConfig] = []
        """Every drafter's config as started (drafter i is process replica_name("drafter", i))."""
        self._service_cpus: set[int] | None = None
        """With CPU pinning: the CPUs of every service but the workers (which bind their compute threads)."""

    @property
    def base_url(self) -> str:
        scheme = "https" if self.config.router.tls else "http"
        return f"{scheme}://{self.config.router.host}:{self.config.router.port}"

    @property
    def grpc_address(self) -> str | None:
        """host:port of the router's public gRPC API; None when it is turned off."""
        router = self.config.router
        return f"{router.host}:{router.grpc_port}" if router.is_grpc_api else None

    def __enter__(self) -> "Stack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        cfg = self.config
        self._check_chosen_ports()
        model_dir = str(resolve_model(cfg.worker.model))  # converts the default model once, with a progress bar
        ports = [cfg.worker.port] if cfg.worker.port and cfg.num_workers == 1 else [0] * cfg.num_workers
        num_threads = cfg.worker.num_threads or (0 if cfg.is_ray_workers else local_worker_threads(cfg.num_workers))
        workers = [dataclasses.replace(cfg.worker, model=model_dir, num_threads=num_threads, port=port)
                   for port in ports]
        cpu_sets = local_cpu_sets(cfg.num_workers) if self._is_pinnable(cfg) else None
        if cpu_sets is not None:  # each worker counts its CPUs, and takes as many threads as its model pays for
            workers = [dataclasses.replace(worker, compute_cpus=format_cpu_list(cpus), num_threads=0)
                       for worker, cpus in zip(workers, cpu_sets[0])]
            self._service_cpus = cpu_sets[1]
        self.worker_configs = workers
        deadline = time.monotonic() + cfg.startup_timeout_s
        self.drafter_configs = self._drafter_configs(model_dir)
        try:
            if cfg.is_ray_workers:
                worker_addresses = self._start_ray_workers(workers, deadline)
            else:
                self._start_replicas("worker", deadline)
                worker_addresses = [f"{w.host}:{w.port}" for w in self.worker_configs]
            self._start_replicas("drafter", deadline)
            drafters = self.drafter_configs
            scheduler = dataclasses.replace(cfg.scheduler, worker_address=",".join(worker_addresses),
                                            drafter_addresses=[f"{d.host}:{d.port}" for d in drafters],
                                            max_draft_nodes=cfg.scheduler.max_draft_nodes if cfg.is_speculative else 0)
            router = dataclasses.replace(cfg.router, model=model_dir,
                                         served_model_name=cfg.router.served_model_name or workers[0].served_model_name)
            self.config = dataclasses.replace(cfg, worker=self.worker_configs[0], scheduler=scheduler, router=router,
                                              drafter=drafters[0] if drafters else cfg.drafter)
            self._spawn("scheduler", scheduler)
            scheduler = self._wait_started("scheduler", deadline)
            router = dataclasses.replace(router, scheduler_address=f"{scheduler.host}:{scheduler.port}")
            self.config = dataclasses.replace(self.config, router=router)
            self._spawn("router", router)
            self._wait_started("router", deadline)
        except BaseException:
            self.stop()
            raise

    def _check_chosen_ports(self) -> None:
        """RuntimeError when a port the user chose for a local service is held already (another `segserve serve`,
        say): its health check would be answered by that other process, and the stack would start against it."""
        cfg = self.config
        chosen = {"router": [(cfg.router.host, cfg.router.port)],
                  "scheduler": [(cfg.scheduler.host, cfg.scheduler.port)]}
        if cfg.router.is_grpc_api:
            chosen["router"].append((cfg.router.host, cfg.router.grpc_port))
        if cfg.num_workers == 1 and not cfg.is_ray_workers:
            chosen["worker"] = [(cfg.worker.host, cfg.worker.port)]
        if cfg.num_drafters == 1:
            chosen["drafter"] = [(cfg.drafter.host, cfg.drafter.port)]
        taken = [f"{port} ({role})" for role, addresses in chosen.items() for host, port in addresses
                 if port and not is_free(host, port, is_reuse_address=True)]
        if taken:
            raise RuntimeError(f"port{'s' if len(taken) > 1 else ''} {', '.join(taken)} already in use on this machine "
                               "(another segserve serve?): stop what holds them, or choose other ports")

    def _start_replicas(self, role: str, deadline: float) -> None:
        """Spawn every worker or drafter replica (self.worker_configs or self.drafter_configs), then wait until each
        has bound its port and is ready: the scheduler is told the addresses once all are."""
        configs = self.worker_configs if role == "worker" else self.drafter_configs
        for i, config in enumerate(configs):
            self._spawn(replica_name(role, i), config, role)
        for i in range(len(configs)):
            self._wait_started(replica_name(role, i), deadline)

    def _wait_started(self, name: str, deadline: float):
        """Wait until the service `name`, just spawned, reports the ports it bound (common/ports.py: a port 0 of
        its config is any free one it found), which its config as started then takes, and until it is ready.
        Returns that config."""
        role, config = self._role_config(name)
        wanted = {"port", "grpc_port"} if role == "router" and config.is_grpc_api else {"port"}
        while True:
            self._check_alive(name)
            ports = read_ports(self._ports_file(name)) or {}
            if wanted <= ports.keys():
                break
            if time.monotonic() > deadline:
                raise self._not_ready(name, f"{config.host}:{config.port}", "no port reported")
            time.sleep(0.1)
        bound = dataclasses.replace(config, **{key: ports[key] for key in wanted})
        if role in ("worker", "drafter"):
            configs = self.worker_configs if role == "worker" else self.drafter_configs
            configs[int(name.partition("-")[2] or 0)] = bound
        else:
            self.config = dataclasses.replace(self.config, **{role: bound})
        self._wait_until_ready(name, deadline)
        return bound

    def _ports_file(self, name: str) -> Path:
        return Path(self._ports_dir.name) / f"{name}.json"

    def _start_ray_workers(self, workers: list[WorkerConfig], deadline: float) -> list[str]:
        """Start one WorkerActor per config on the scheduler's Ray cluster; their addresses once all are ready."""
        import ray

        from worker.actor import WorkerActor

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address=self.config.scheduler.ray_address, namespace="segserve", logging_level="ERROR")
        num_gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
        self._ray_actors = [WorkerActor.options(name=f"segserve-worker-{os.getpid()}-{i}", num_gpus=num_gpus,
                                                **self._ray_placement(config, num_gpus, deadline)).remote()
                            for i, config in enumerate(workers)]
        starts = [actor.start.remote(config) for actor, config in zip(self._ray_actors, workers)]
        return ray.get(starts, timeout=max(1.0, deadline - time.monotonic()))

    def _ray_placement(self, config: WorkerConfig, num_gpus: int, deadline: float) -> dict:
        """A tensor-parallel worker's actor options: a placement group of one bundle per rank, packed on one node
        (a GPU each where the cluster has GPUs, else a nominal CPU share: torch's threads are not Ray's to count),
        the actor in bundle 0 (worker/actor.py starts the other ranks in theirs). Nothing for one rank."""
        if config.tensor_parallel_size == 1:
            return {}
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"GPU": 1} if num_gpus else {"CPU": 0.01}
        group = placement_group([bundle] * config.tensor_parallel_size, strategy="STRICT_PACK")
        self._ray_groups.append(group)
        ray.get(group.ready(), timeout=max(1.0, deadline - time.monotonic()))
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)}

    def _stop_ray_workers(self) -> None:
        import ray

        try:
            ray.get([actor.stop.remote() for actor in self._ray_actors], timeout=10)
        except Exception:  # stopping anyway
            pass
        for actor in self._ray_actors:
            ray.kill(actor)
        self._ray_actors = []
        for group in self._ray_groups:  # the rank actors in them end with their rank 0
            ray.util.remove_placement_group(group)
        self._ray_groups = []
        ray.shutdown()

    def _drafter_configs(self, model_dir: str) -> list[DrafterConfig]:
        """One config per drafter replica: port 0 (any free one, which it reports) unless one was chosen for a lone
        replica, and one log for all (a restarted replica replays it)."""
        base = dataclasses.replace(self.config.drafter, tokenizer=model_dir)
        if not (base.redis_url or base.shared_log_dir or base.corpus_dir):
            self._shared_dir = tempfile.TemporaryDirectory(prefix="segserve-drafters-")
            base = dataclasses.replace(base, shared_log_dir=self._shared_dir.name)
        ports = [base.port] if base.port and self.config.num_drafters == 1 else [0] * self.config.num_drafters
        return [dataclasses.replace(base, port=port, replica_name=base.replica_name or replica_name("drafter", i))
                for i, port in enumerate(ports)]

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every service (router first), then SIGKILL whatever outlives the timeout."""
        for role in ("router", "scheduler", "drafter", "worker"):
            for name, proc in self.processes.items():
                if name.split("-")[0] == role and proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, proc in self.processes.items():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"segserve: {name} outlived SIGTERM by {timeout_s:g} s: killed", file=sys.stderr, flush=True)
                proc.kill()
                proc.wait()
        self.processes.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self._shared_dir is not None:
            self._shared_dir.cleanup()
            self._shared_dir = None
        if self._ray_actors:
            self._stop_ray_workers()

    def restart(self, name: str) -> None:
        """Start a service that exited again with the config it ran with (same ports): "router", "scheduler",
        or a worker or drafter replica ("worker", "worker-1", "drafter-1", ...)."""
        role, config = self._role_config(name)
        self._spawn(name, config, role)

    def wait_ready(self, name: str, timeout_s: float) -> None:
        """Block until the service answers its health check as ready; raises when it exits or the time is up."""
        self._wait_until_ready(name, time.monotonic() + timeout_s)

    def _wait_until_ready(self, name: str, deadline: float) -> None:
        """The router's /health, or the Health RPC of any other service, at the address of its config as started."""
        role, config = self._role_config(name)
        if role == "router":
            self._wait_http_ready(deadline)
            return
        self._wait_grpc_ready(name, _HEALTH_STUBS[role], f"{config.host}:{config.port}", deadline, config)

    def tail(self, name: str, num_lines: int) -> list[str]:
        """The last lines the service wrote (its log file's, with a log_dir)."""
        if not self.config.log_dir:
            return list(self._tails.get(name, ()))[-num_lines:]
        try:
            return (Path(self.config.log_dir) / f"{name}.log").read_text(errors="replace").splitlines()[-num_lines:]
        except OSError:
            return []

    def _role_config(self, name: str):
        """(the service's command, its config as started) of a process name."""
        role, _, index = name.partition("-")
        if role in ("worker", "drafter"):
            configs = self.worker_configs if role == "worker" else self.drafter_configs
            return role, configs[int(index or 0)]
        if role in ("router", "scheduler") and not index:
            return role, getattr(self.config, role)
        raise KeyError(f"no service named {name!r}")

    @staticmethod
    def _is_pinnable(cfg: StackConfig) -> bool:
        """Whether the stack's workers are local CPU processes whose thread count the launcher chooses."""
        if not cfg.is_cpu_pinned or cfg.is_ray_workers or cfg.worker.num_threads or cfg.worker.compute_cpus:
            return False
        if cfg.worker.device == "auto":
            import torch

            return not torch.cuda.is_available()
        return cfg.worker.device == "cpu"

    def _spawn(self, name: str, config, command: str | None = None) -> None:
        """Run `segserve <command or name>` with config's flags; its output goes to <log_dir>/<name>.log. With CPU
        pinning, any service but a worker runs on the services' CPU (Ray's processes, which the scheduler starts,
        inherit its mask); a worker binds its compute threads itself (its config's compute_cpus)."""
        argv = [sys.executable, "-m", "segserve.cli", command or name, *to_argv(config)]
        out = subprocess.PIPE
        if self.config.log_dir:
            Path(self.config.log_dir).mkdir(parents=True, exist_ok=True)
            out = open(Path(self.config.log_dir) / f"{name}.log", "ab")
            self._logs.append(out)
        # The configs already hold what this process's SEGSERVE_* variables set; a child reading them again
        # would take a value meant for another service (SEGSERVE_PORT is the router's in `segserve serve`).
        flag_vars = env_names(type(config))
        env = {k: v for k, v in os.environ.items() if k not in flag_vars}
        ports_file = self._ports_file(name)
        ports_file.unlink(missing_ok=True)  # a restarted service reports its ports anew
        env.update(to_env(config), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **{PORTS_FILE_VAR: str(ports_file)})
        proc = self.processes[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        if out is subprocess.PIPE:
            tail = self._tails[name] = deque(maxlen=_TAIL_LINES)
            threading.Thread(target=_forward, args=(name, proc.stdout, tail), daemon=True,
                             name=f"output-{name}").start()
        cpus = None if (command or name) == "worker" else self._service_cpus
        if cpus is not None:  # right after exec, before the interpreter has started a thread (they inherit the mask)
            try:
                os.sched_setaffinity(self.processes[name].pid, cpus)
            except OSError:
                pass  # it died already: _check_alive reports that

    def _check_alive(self, name: str) -> None:
        """RuntimeError when the service `name` has exited, with the exception it last printed (the reason a
        worker refuses a model, say)."""
        proc = self.processes[name]
        if proc.poll() is not None:
            where = f" (see {self.config.log_dir}/{name}.log)" if self.config.log_dir else ""
            time.sleep(0.2)  # the output thread's last lines
            cause = last_exception(self.tail(name, _TAIL_LINES))
            cause = f": {cause}" if cause else ""
            raise RuntimeError(f"{name} exited with code {proc.returncode} during start-up{where}{cause}")

    def _wait_grpc_ready(self, name: str, stub_cls, address: str, deadline: float, config) -> None:
        """Poll the Health RPC of the service `config` configures (over its internal TLS, when it has one)."""
        detail = "not polled"
        with open_blocking_channel(address, internal_tls(config)) as channel:
            stub = stub_cls(channel)
            while time.monotonic() < deadline:
                self._check_alive(name)
                try:
                    health = stub.Health(common_pb2.HealthRequest(), timeout=2.0)
                    if health.ready:
                        return
                    detail = health.detail
                except grpc.RpcError as exc:
                    detail = f"Health: {exc.code().name}"
                time.sleep(0.5)
        raise self._not_ready(name, address, detail)

    def _wait_http_ready(self, deadline: float) -> None:
        detail = "not polled"
        while time.monotonic() < deadline:
            self._check_alive("router")
            try:
                # A liveness poll of the process started here, sending nothing secret: the router's certificate
                # is for the names its clients use, which need not include the bind address dialled here.
                response = httpx.get(self.base_url + "/health", timeout=2.0, verify=False)
                if response.status_code == 200:
                    return
                detail = f"/health answered {response.status_code}"
            except httpx.HTTPError as exc:
                detail = f"/health: {type(exc).__name__}"
            time.sleep(0.5)
        raise self._not_ready("router", self.base_url, detail)

    def _not_ready(self, name: str, address: str, detail: str, num_lines: int = 40) -> TimeoutError:
        """The error for a service still not ready at the deadline: its last answer, and the end of its log
        (where it is stuck is there, and a test's failure report is often all anyone sees)."""
        message = f"{name} at {address} was not ready in time (last: {detail})"
        if self.config.log_dir:
            path = Path(self.config.log_dir) / f"{name}.log"
            try:
                lines = path.read_text(errors="replace").splitlines()[-num_lines:]
            except OSError:
                lines = []
            if lines:
                message += f"; the end of {path}:\n" + "\n".join(lines)
        return TimeoutError(message)
