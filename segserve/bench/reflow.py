"""`segserve bench reflow`: what data reflow's recording adds to the router's latency, and the consumer's rate.

Setup: one paced scheduler (`paced_scheduler.py`, its own process, a token every
--token-interval-ms, no model) behind two real router processes (`segserve
router`), one with reflow off and one recording into a SQLite queue in a temp
dir. Only the router differs, so the difference is what recording costs it.

Order: both routers warm up; then --rounds rounds, each one level of
--concurrency closed-loop streams (the throughput bench's `loadgen`) against
each router, alternating which goes first, so that machine noise hits both
alike. The routers stop (the recording one flushes its buffer), and the queue
is drained with `segserve.reflow.consumer` (is_drain) into JSONL, timed.
Outputs go to --out: reflow.json (every raw request timing, per-round and pooled
statistics, the drain, command, machine), reflow.png, the services' logs; the
table and the goal (at most --goal-ms of p99 TTFT and ITL added) are printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import httpx

from segserve.bench import loadgen, reflow_report, report
from segserve.bench.harness import save
from segserve.bench.machine import machine_info
from segserve.bench.prompts import PROMPTS


@dataclass
class ReflowBenchConfig:
    model: str | None = None
    """Tokenizer's model for the routers and the paced scheduler: a catalog name
    (qwen2.5-coder-0.5b-instruct, gemma-3-270m) or a transformers model directory; None = the default model."""
    concurrency: int = 16
    """Concurrent streams of every level."""
    max_tokens: int = 64
    """Tokens per request (the paced scheduler always sends exactly this many)."""
    requests_per_stream: int = 2
    """Requests each stream sends back to back per level."""
    rounds: int = 10
    """Rounds; each runs one level against each router, alternating which goes first."""
    token_interval_ms: float = 20.0
    """The paced scheduler's time per token (and to the first token)."""
    goal_ms: float = 1.0
    """Most p99 TTFT / ITL that recording may add."""
    request_timeout_s: float = 60.0
    """Longest one request may take."""
    startup_timeout_s: float = 120.0
    """Longest a service may take to become ready."""
    out: str = "bench-results/reflow"
    """Directory for reflow.json, reflow.png and the services' logs."""

    def __post_init__(self) -> None:
        if min(self.concurrency, self.max_tokens, self.requests_per_stream, self.rounds) <= 0:
            raise ValueError("concurrency, max_tokens, requests_per_stream and rounds must be > 0")
        if self.max_tokens < 2:
            raise ValueError("max_tokens must be >= 2 (inter-token latency needs two tokens)")
        if min(self.token_interval_ms, self.goal_ms, self.request_timeout_s, self.startup_timeout_s) <= 0:
            raise ValueError("token_interval_ms, goal_ms and the timeouts must be > 0")


def add_reflow_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `segserve bench reflow`, one per ReflowBenchConfig field."""
    d = ReflowBenchConfig()
    parser.add_argument("--model", default=d.model,
                        help="catalog name or transformers model directory (default model if unset)")
    parser.add_argument("--concurrency", type=int, default=d.concurrency, help="concurrent streams")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--requests-per-stream", type=int, default=d.requests_per_stream)
    parser.add_argument("--rounds", type=int, default=d.rounds, help="alternating off/on rounds")
    parser.add_argument("--token-interval-ms", type=float, default=d.token_interval_ms,
                        help="the paced scheduler's time per token")
    parser.add_argument("--goal-ms", type=float, default=d.goal_ms, help="most p99 latency reflow may add")
    parser.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    parser.add_argument("--startup-timeout-s", type=float, default=d.startup_timeout_s)
    parser.add_argument("--out", default=d.out, help="output directory (default: bench-results/reflow)")


@dataclass
class _Service:
    name: str
    process: subprocess.Popen
    address: str


def _spawn(name: str, argv: list[str], address: str, log_dir: Path) -> _Service:
    log = open(log_dir / f"{name}.log", "ab")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    process = subprocess.Popen([sys.executable, "-m", *argv], stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()  # the child holds its own descriptor
    return _Service(name, process, address)


def _wait_ready(service: _Service, deadline: float, log_dir: Path) -> None:
    from protos.segserve.v1 import common_pb2, scheduler_pb2_grpc

    while time.monotonic() < deadline:
        if service.process.poll() is not None:
            raise RuntimeError(f"{service.name} exited with code {service.process.returncode} "
                               f"(see {log_dir / service.name}.log)")
        try:
            if service.address.startswith("http"):
                if httpx.get(service.address + "/health", timeout=2.0, trust_env=False).status_code == 200:
                    return
            else:
                with grpc.insecure_channel(service.address) as channel:
                    stub = scheduler_pb2_grpc.SchedulerStub(channel)
                    if stub.Health(common_pb2.HealthRequest(), timeout=2.0).ready:
                        return
        except (httpx.HTTPError, grpc.RpcError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{service.name} at {service.address} was not ready in time")


def _stop(services: list[_Service], timeout_s: float = 20.0) -> None:
    for service in services:
        if service.process.poll() is None:
            service.process.terminate()  # the router's lifespan closes the recorder, flushing its buffer
    for service in services:
        try:
            service.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            service.process.kill()
            service.process.wait()


def _router_argv(model_dir: Path, scheduler_address: str, port: int, queue_url: str = "",
                 spill_dir: str = "") -> list[str]:
    from router.config import RouterConfig
    from segserve.flags import to_argv

    # HTTP only: the two routers run side by side, and the gRPC API's default port can be bound once
    config = RouterConfig(model=str(model_dir), scheduler_address=scheduler_address, port=port, is_grpc_api=False,
                          reflow_queue_url=queue_url, reflow_spill_dir=spill_dir or RouterConfig.reflow_spill_dir)
    return ["segserve.cli", "router", *to_argv(config)]


def _level(base_url: str, config: ReflowBenchConfig, **overrides) -> loadgen.LoadRun:
    spec = dict(base_url=base_url, prompts=PROMPTS, max_tokens=config.max_tokens, concurrency=config.concurrency,
                requests_per_stream=config.requests_per_stream, request_timeout_s=config.request_timeout_s,
                time_limit_s=config.request_timeout_s * config.requests_per_stream)
    return loadgen.run(loadgen.run_load(loadgen.LoadSpec(**{**spec, **overrides})))


def _recorder_counters(base_url: str) -> dict[str, float]:
    """The recording router's reflow counters from /metrics (chunks recorded, dropped by reason)."""
    text = httpx.get(base_url + "/metrics", timeout=5.0, trust_env=False).text
    counters = {}
    for line in text.splitlines():
        if line.startswith(("segserve:reflow_chunks_recorded", "segserve:reflow_chunks_dropped")):
            name, _, value = line.rpartition(" ")
            counters[name] = float(value)
    return counters


def measure_routers(config: ReflowBenchConfig, model_dir: Path, workdir: Path, log_dir: Path) -> dict:
    """Start the paced scheduler and both routers, warm up, run the alternating rounds, stop them."""
    from common.ports import free_port

    scheduler_address = f"127.0.0.1:{free_port()}"
    queue_url = f"sqlite:///{workdir / 'queue.db'}"
    scheduler = _spawn("paced-scheduler", ["segserve.bench.paced_scheduler", "--model", str(model_dir), "--port",
                                           scheduler_address.rpartition(":")[2], "--token-interval-ms",
                                           str(config.token_interval_ms)], scheduler_address, log_dir)
    services = [scheduler]
    try:
        deadline = time.monotonic() + config.startup_timeout_s
        _wait_ready(scheduler, deadline, log_dir)
        urls = {}
        for mode, extra in (("off", {}), ("on", {"queue_url": queue_url, "spill_dir": str(workdir / "spill")})):
            port = free_port()
            urls[mode] = f"http://127.0.0.1:{port}"
            services.append(_spawn(f"router-reflow-{mode}", _router_argv(model_dir, scheduler_address, port, **extra),
                                   urls[mode], log_dir))
        for service in services[1:]:
            _wait_ready(service, deadline, log_dir)
        warmup = {mode: _level(url, config, max_tokens=min(8, config.max_tokens), requests_per_stream=1).records
                  for mode, url in urls.items()}
        rounds = []
        for index in range(config.rounds):
            order = ("off", "on") if index % 2 == 0 else ("on", "off")
            result = {"order": list(order)}
            for mode in order:
                run = _level(urls[mode], config)
                result[mode] = report.level_result(config.concurrency, run.records, run.started_at, run.finished_at)
                result[mode]["raw_records"] = run.records  # dropped before the JSON is written
                time.sleep(0.2)  # let the recorder's writer finish its last flush before the next level
            _progress(index, result)
            rounds.append(result)
        counters = _recorder_counters(urls["on"])
    finally:
        _stop(services[::-1])
    return {"queue_url": queue_url, "warmup": warmup, "rounds": rounds, "recorder_counters": counters,
            "scheduler_address": scheduler_address, "router_urls": urls}


def _progress(index: int, result: dict) -> None:
    off, on = result["off"]["summary"], result["on"]["summary"]
    print(f"[bench reflow] round {index + 1}: ITL p99 off {off['itl_ms_p99'] or 0:.2f} ms, "
          f"on {on['itl_ms_p99'] or 0:.2f} ms; TTFT p99 off {off['ttft_ms_p99'] or 0:.2f}, "
          f"on {on['ttft_ms_p99'] or 0:.2f}", file=sys.stderr, flush=True)


def measure_drain(queue_url: str, sink_dir: Path) -> dict:
    """Drain the queue with the real consumer (is_drain) and time it."""
    from router.reflow.queue import open_queue
    from segserve.reflow.config import ConsumerConfig
    from segserve.reflow.consumer import consume

    queue = open_queue(queue_url)
    num_chunks = queue.depth()
    queue.close()
    started = time.perf_counter()
    consumer = consume(ConsumerConfig(queue_url=queue_url, sink_dir=str(sink_dir), is_drain=True))
    seconds = time.perf_counter() - started
    queue = open_queue(queue_url)
    num_left = queue.depth()
    queue.close()
    return {"num_chunks": num_chunks, "num_records": consumer.num_records_written, "seconds": seconds,
            "chunks_per_s": num_chunks / seconds if seconds > 0 else None,
            "records_per_s": consumer.num_records_written / seconds if seconds > 0 else None,
            "num_chunks_left": num_left, "num_bad_chunks": consumer.num_bad_chunks,
            "num_log_files": sum(1 for p in sink_dir.rglob("*") if p.is_file())}


def run_reflow(args: argparse.Namespace) -> dict:
    """Run the whole benchmark; write JSON + PNG under --out, print the table, return the results."""
    from common.checkpoint import resolve_model

    config = ReflowBenchConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ReflowBenchConfig)})
    logging.getLogger("httpx").setLevel(logging.WARNING)
    out = Path(config.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(config.model)
    results = {"benchmark": "reflow", "command": shlex.join(sys.argv), "config": asdict(config),
               "model": str(model_dir), "machine": machine_info()}
    with tempfile.TemporaryDirectory(prefix="segserve-bench-reflow-") as tmp:
        measured = measure_routers(config, model_dir, Path(tmp), out / "logs")
        results["consumer"] = measure_drain(measured["queue_url"], Path(tmp) / "logs")
    rounds = measured["rounds"]
    on_requests = measured["warmup"]["on"] + [r for rnd in rounds for r in rnd["on"]["raw_records"]]
    # What the recording router should have queued: per request its body, one chunk per text delta, the final.
    results["consumer"]["num_requests_recorded"] = len(on_requests)
    results["consumer"]["num_chunks_expected"] = sum(len(r.event_times) + 2 for r in on_requests)
    results["recorder_counters"] = measured["recorder_counters"]
    results["modes"] = {}
    for mode in ("off", "on"):
        records = [r for rnd in rounds for r in rnd[mode]["raw_records"]]
        results["modes"][mode] = {"summary": report.summarize(records, sum(rnd[mode]["summary"]["wall_s"]
                                                                          for rnd in rounds))}
    for rnd in rounds:
        for mode in ("off", "on"):
            del rnd[mode]["raw_records"]
    results["rounds"] = rounds
    results["warmup"] = {mode: [r.to_dict() for r in records] for mode, records in measured["warmup"].items()}
    results["added"] = reflow_report.compare(results["modes"]["off"]["summary"], results["modes"]["on"]["summary"],
                                             rounds)
    results["goals"] = reflow_report.evaluate_goals(results["added"], config.goal_ms)
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    save(results, out, "reflow", reflow_report.plot)
    print(f"\npaced scheduler: a token every {config.token_interval_ms:g} ms; {config.rounds} rounds; "
          f"tokenizer {model_dir}\n")
    print(reflow_report.markdown_table(results))
    return results
