"""`segserve bench router`: the router's own CPU time per streamed token, model-free.

On a small CPU machine the router, the scheduler and the worker share the cores,
so every millisecond of CPU the router spends per token is taken from the
worker. Wall-clock latency differences (`bench throughput --router-overhead`)
drown that in the model's noise; CPU time does not: this bench counts the CPU
seconds (user + system, all threads) of the router process alone, over a known
number of delivered tokens.

Setup: the paced scheduler (`paced_scheduler.py`, its own process, a token every
--token-interval-ms to every stream, one token per chunk as plain decoding
sends them, no model) behind one real router process (`segserve router`, HTTP
only; with --reflow it records every request into a SQLite queue in a temp
dir, as `make serve` does); the load generator runs in this process. Per round and per
endpoint (/v1/completions, /v1/chat/completions): --concurrency closed-loop SSE
streams of --max-tokens tokens each (stream_options.include_usage), with the
router's CPU times read (psutil) just before and after. Endpoints alternate
which goes first from round to round. Last, the same streams are read straight
off the scheduler with the router's own gRPC client in this process (no HTTP,
no detokenization): the part of the router's cost its gRPC client takes.

Reported per endpoint: CPU ms per token (router CPU seconds / completion tokens
of the usage chunks), the median and spread over rounds, SSE events per token (1.0 when the
router kept up with the pace; lower when it merged chunks that piled up, which
lowers its cost per token: a run is only comparable with one at the same ratio),
wall time, and the load generator's own CPU per token (this process: httpx and
the SSE parsing, which `bench throughput` counts into the router's overhead when
both share the cores). Outputs go to --out: router.json (every round, the command, the
machine), router.png, the services' logs.

With --tracing, a second router runs beside the first with tracing on (every request traced:
trace_sample_ratio 1.0), exporting its spans over OTLP/gRPC to a receiver in a process of its
own (segserve/bench/otlp_receiver.py, the collector's TraceService; so receiving costs neither
router), and every round measures both routers on each endpoint, alternating which goes first:
the router's CPU per token with tracing off and on, side by side. The receiver's count of spans
(one per request) shows that what was traced was exported.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass
from pathlib import Path

from segserve.bench import loadgen
from segserve.bench.harness import figure, fmt, save
from segserve.bench.prompts import PROMPTS

ENDPOINTS = ("completions", "chat")
_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class RouterBenchConfig:
    model: str | None = None
    """Tokenizer's model for the router and the paced scheduler: a catalog name
    (qwen2.5-coder-0.5b-instruct, gemma-3-270m) or a transformers model directory; None = the default model."""
    concurrency: int = 64
    """Concurrent SSE streams."""
    max_tokens: int = 128
    """Tokens per request (the paced scheduler always sends exactly this many)."""
    requests_per_stream: int = 1
    """Requests each stream sends back to back per round and endpoint."""
    rounds: int = 5
    """Rounds; each runs every endpoint once, alternating which goes first."""
    token_interval_ms: float = 50.0
    """The paced scheduler's time per token, per stream."""
    request_timeout_s: float = 120.0
    """Longest one request may take."""
    startup_timeout_s: float = 120.0
    """Longest a service may take to become ready."""
    reflow: bool = False
    """The router records every request and response (data reflow) into a SQLite queue in a temp dir."""
    tracing: bool = False
    """Also measure a second router with tracing on (every request traced, spans exported over OTLP to a local
    receiver), beside the first, every round."""
    out: str = "bench-results/router"
    """Directory for router.json, router.png and the services' logs."""

    def __post_init__(self) -> None:
        if min(self.concurrency, self.max_tokens, self.requests_per_stream, self.rounds) <= 0:
            raise ValueError("concurrency, max_tokens, requests_per_stream and rounds must be > 0")
        if min(self.token_interval_ms, self.request_timeout_s, self.startup_timeout_s) <= 0:
            raise ValueError("token_interval_ms and the timeouts must be > 0")


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `segserve bench router`, one per RouterBenchConfig field."""
    d = RouterBenchConfig()
    parser.add_argument("--model", default=d.model,
                        help="catalog name or transformers model directory (default model if unset)")
    parser.add_argument("--concurrency", type=int, default=d.concurrency, help="concurrent streams")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--requests-per-stream", type=int, default=d.requests_per_stream)
    parser.add_argument("--rounds", type=int, default=d.rounds, help="rounds, each over every endpoint")
    parser.add_argument("--token-interval-ms", type=float, default=d.token_interval_ms,
                        help="the paced scheduler's time per token")
    parser.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    parser.add_argument("--startup-timeout-s", type=float, default=d.startup_timeout_s)
    parser.add_argument("--reflow", action=argparse.BooleanOptionalAction, default=d.reflow,
                        help="the router records requests and responses (data reflow) into a SQLite queue")
    parser.add_argument("--tracing", action=argparse.BooleanOptionalAction, default=d.tracing,
                        help="also measure a router with tracing on (OTLP to a local receiver), side by side")
    parser.add_argument("--out", default=d.out, help="output directory (default: bench-results/router)")


def request_body(endpoint: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy request of `endpoint` asking for the usage chunk."""
    body = {"max_tokens": max_tokens, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def run_streams(base_url: str, endpoint: str, config: RouterBenchConfig, max_tokens: int | None = None
                      ) -> list[loadgen.RequestRecord]:
    """`concurrency` closed-loop streams of `endpoint`, `requests_per_stream` requests each (loadgen's loop)."""
    url = base_url.rstrip("/") + _PATHS[endpoint]
    async with loadgen.make_client(config.concurrency, config.request_timeout_s) as client:

        def send(prompt_number: int, record: loadgen.RequestRecord) -> Awaitable[None]:
            body = request_body(endpoint, PROMPTS[prompt_number % len(PROMPTS)], max_tokens or config.max_tokens)
            return loadgen.stream_one(client, url, body, record)

        run = await loadgen.run_closed_loop(config.concurrency, config.requests_per_stream, config.request_timeout_s,
                                            math.inf, send)
    return run.records


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (all its threads) so far."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def measure_level(base_url: str, router_pid: int, endpoint: str, config: RouterBenchConfig) -> dict:
    """One endpoint's streams, with the router's CPU time around them."""
    cpu_before, wall_before, client_before = cpu_seconds(router_pid), time.perf_counter(), time.process_time()
    records = loadgen.run(run_streams(base_url, endpoint, config))
    wall_s, cpu_s = time.perf_counter() - wall_before, cpu_seconds(router_pid) - cpu_before
    client_cpu_s = time.process_time() - client_before
    num_tokens = sum(r.num_tokens for r in records)
    num_events = sum(len(r.event_times) for r in records)
    errors = [r.error for r in records if r.error]
    return {"endpoint": endpoint, "num_requests": len(records), "num_errors": len(errors), "errors": errors[:5],
            "num_tokens": num_tokens, "num_events": num_events, "router_cpu_s": cpu_s, "wall_s": wall_s,
            "cpu_ms_per_token": 1000 * cpu_s / num_tokens if num_tokens else None,
            "events_per_token": num_events / num_tokens if num_tokens else None,
            "router_cpu_share": cpu_s / wall_s if wall_s > 0 else None,
            "client_cpu_s": client_cpu_s,
            "client_cpu_ms_per_token": 1000 * client_cpu_s / num_tokens if num_tokens else None}


async def _grpc_streams(scheduler_address: str, config: RouterBenchConfig, max_tokens: int) -> int:
    """The same streams straight from the scheduler with the router's own gRPC client; events received."""
    from protos.segserve.v1.generate import GenerateRequest, TokenChunk
    from protos.segserve.v1.sampling import SamplingParams, StoppingCriteria
    from router.scheduler_client import SchedulerClient

    client = SchedulerClient(scheduler_address)

    async def stream(index: int) -> int:
        num_events = 0
        for round_index in range(config.requests_per_stream):
            request = GenerateRequest(request_id=f"grpc-{index}-{round_index}", prompt_token_ids=(2, 651, 6639),
                                      sampling=SamplingParams(), stopping=StoppingCriteria(max_tokens=max_tokens))
            async for event in client.generate(request, timeout_s=config.request_timeout_s):
                num_events += isinstance(event, TokenChunk)
        return num_events

    try:
        return sum(await asyncio.gather(*(stream(i) for i in range(config.concurrency))))
    finally:
        await client.close()


def measure_grpc_floor(scheduler_address: str, config: RouterBenchConfig) -> dict:
    """CPU per token of receiving the streams alone (this process, the router's SchedulerClient, no HTTP):
    the part of the router's cost that its gRPC client takes, whatever the router does with the tokens."""
    loadgen.run(_grpc_streams(scheduler_address, config, 8))  # warm-up
    cpu_before, wall_before = time.process_time(), time.perf_counter()
    num_events = loadgen.run(_grpc_streams(scheduler_address, config, config.max_tokens))
    cpu_s, wall_s = time.process_time() - cpu_before, time.perf_counter() - wall_before
    return {"num_tokens": num_events, "cpu_s": cpu_s, "wall_s": wall_s,
            "cpu_ms_per_token": 1000 * cpu_s / num_events if num_events else None}


def summarize(levels: list[dict]) -> dict:
    """Median and spread over rounds of one endpoint's per-round figures."""
    per_token = [lv["cpu_ms_per_token"] for lv in levels if lv["cpu_ms_per_token"] is not None]
    events = [lv["events_per_token"] for lv in levels if lv["events_per_token"] is not None]
    client = [lv["client_cpu_ms_per_token"] for lv in levels if lv.get("client_cpu_ms_per_token") is not None]
    return {"cpu_ms_per_token_median": statistics.median(per_token) if per_token else None,
            "cpu_ms_per_token_min": min(per_token, default=None),
            "cpu_ms_per_token_max": max(per_token, default=None),
            "cpu_ms_per_token_rounds": per_token,
            "events_per_token_median": statistics.median(events) if events else None,
            "client_cpu_ms_per_token_median": statistics.median(client) if client else None,
            "num_tokens": sum(lv["num_tokens"] for lv in levels),
            "num_errors": sum(lv["num_errors"] for lv in levels)}


TRACED = "tracing"
"""The key of the traced router's figures in a round (and in the results), with --tracing."""


def measure_router(config: RouterBenchConfig, model_dir: Path, log_dir: Path, workdir: Path) -> dict:
    """Start the paced scheduler and the router (with --tracing, the OTLP receiver and a traced router too), warm
    up, run the rounds, stop them."""
    from segserve.bench.reflow import _router_argv, _spawn, _stop, _wait_ready
    from common.ports import free_port

    scheduler_address = f"127.0.0.1:{free_port()}"
    scheduler = _spawn("paced-scheduler", ["segserve.bench.paced_scheduler", "--model", str(model_dir), "--port",
                                           scheduler_address.rpartition(":")[2], "--token-interval-ms",
                                           str(config.token_interval_ms)], scheduler_address, log_dir)
    routers, receiver = {}, None
    try:
        deadline = time.monotonic() + config.startup_timeout_s
        _wait_ready(scheduler, deadline, log_dir)
        variants = {"": []}
        if config.tracing:
            receiver_port = free_port()
            receiver = _spawn("otlp-receiver", ["segserve.bench.otlp_receiver", "--port", str(receiver_port), "--out",
                                                str(workdir / "received.json")], f"127.0.0.1:{receiver_port}", log_dir)
            _wait_listening(receiver, deadline, log_dir)
            variants[TRACED] = ["--otlp-traces-endpoint", f"http://127.0.0.1:{receiver_port}",
                                "--trace-sample-ratio", "1.0"]
        for variant, flags in variants.items():
            name, port = "router" + (f"-{variant}" if variant else ""), free_port()
            reflow = {"queue_url": f"sqlite:///{workdir / name}.db", "spill_dir": str(workdir / f"{name}-spill")} \
                if config.reflow else {}
            routers[variant] = _spawn(name, _router_argv(model_dir, scheduler_address, port, **reflow) + flags,
                                      f"http://127.0.0.1:{port}", log_dir)
        num_warm_up = 0
        for router in routers.values():
            _wait_ready(router, deadline, log_dir)
            for endpoint in ENDPOINTS:  # warm-up: imports, first-call caches, connections
                num_warm_up = len(loadgen.run(run_streams(router.address, endpoint, config, max_tokens=8)))
        rounds = []
        for index in range(config.rounds):
            order = ENDPOINTS if index % 2 == 0 else ENDPOINTS[::-1]
            turns = list(routers) if index % 2 == 0 else list(routers)[::-1]
            result = {"order": list(order)} | ({"router_order": [v or "off" for v in turns]} if receiver else {})
            for endpoint in order:
                for variant in turns:
                    router = routers[variant]
                    level = measure_level(router.address, router.process.pid, endpoint, config)
                    if variant:
                        result.setdefault(variant, {})[endpoint] = level
                    else:
                        result[endpoint] = level
            print(f"[bench router] round {index + 1}: " + ", ".join(
                f"{e} {result[e]['cpu_ms_per_token'] or 0:.3f} CPU ms/token "
                f"({result[e]['events_per_token'] or 0:.2f} events/token)"
                + (f", traced {result[TRACED][e]['cpu_ms_per_token'] or 0:.3f}" if receiver else "")
                for e in ENDPOINTS), file=sys.stderr, flush=True)
            rounds.append(result)
        grpc_floor = measure_grpc_floor(scheduler_address, config)
    finally:
        _stop(list(routers.values()))  # first: a traced router exports its last spans as it stops
        _stop([s for s in (receiver, scheduler) if s is not None])
    measured = {"rounds": rounds, "grpc_floor": grpc_floor, "scheduler_address": scheduler_address,
                "router_url": routers[""].address}
    if receiver is not None:
        num_requests = num_warm_up * len(ENDPOINTS) + sum(r[TRACED][e]["num_requests"] for r in rounds
                                                          for e in ENDPOINTS)
        measured[TRACED] = {"num_requests": num_requests,
                            "received": json.loads((workdir / "received.json").read_text())}
    return measured


def _wait_listening(service, deadline: float, log_dir: Path) -> None:
    """Until `service` accepts TCP connections on its host:port address."""
    import socket

    host, _, port = service.address.rpartition(":")
    while time.monotonic() < deadline:
        if service.process.poll() is not None:
            raise RuntimeError(f"{service.name} exited with code {service.process.returncode} "
                               f"(see {log_dir / service.name}.log)")
        with socket.socket() as sock:
            if sock.connect_ex((host, int(port))) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{service.name} at {service.address} was not listening in time")


def markdown_table(results: dict) -> str:
    config = results["config"]
    lines = [f"| endpoint ({config['concurrency']} streams x {config['max_tokens']} tokens) | router CPU ms/token, "
             f"median | min | max | SSE events/token | client CPU ms/token | tokens | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    tables = [("", results["endpoints"])]
    if TRACED in results:
        tables = [(", tracing off", results["endpoints"]), (", tracing on", results[TRACED]["endpoints"])]
    for label, endpoints in tables:
        for endpoint, summary in endpoints.items():
            lines.append(f"| /v1/{'chat/' if endpoint == 'chat' else ''}completions{label} "
                         f"| {fmt(summary['cpu_ms_per_token_median'], 3)} | {fmt(summary['cpu_ms_per_token_min'], 3)} "
                         f"| {fmt(summary['cpu_ms_per_token_max'], 3)} | {fmt(summary['events_per_token_median'], 2)} "
                         f"| {fmt(summary['client_cpu_ms_per_token_median'], 3)} | {summary['num_tokens']} "
                         f"| {summary['num_errors']} |")
    floor = results.get("grpc_client_floor")
    if floor:
        lines.append(f"| gRPC receive alone (the router's SchedulerClient, no HTTP) | "
                     f"{fmt(floor['cpu_ms_per_token'], 3)} | | | | | {floor['num_tokens']} | |")
    return "\n".join(lines)


def plot(path: Path, results: dict) -> Path:
    """Router CPU ms per token per round, one series per endpoint (Agg backend)."""
    with figure(path, figsize=(7, 4)) as (fig, axis):
        for color, (endpoint, summary) in enumerate(results["endpoints"].items()):
            values = summary["cpu_ms_per_token_rounds"]
            axis.plot(range(1, len(values) + 1), values, marker="o", color=f"C{color}", label=_PATHS[endpoint])
            if TRACED in results:
                values = results[TRACED]["endpoints"][endpoint]["cpu_ms_per_token_rounds"]
                axis.plot(range(1, len(values) + 1), values, marker="s", linestyle="--", color=f"C{color}",
                          label=_PATHS[endpoint] + ", tracing on")
        floor = (results.get("grpc_client_floor") or {}).get("cpu_ms_per_token")
        if floor is not None:
            axis.axhline(floor, color="grey", linestyle=":", label="gRPC receive alone")
        axis.set_xticks(range(1, len(results["rounds"]) + 1))
        axis.set_xlabel("round")
        axis.set_ylabel("router CPU ms per token")
        axis.set_ylim(bottom=0)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
        config = results["config"]
        axis.set_title(f"segserve bench router: {config['concurrency']} streams, a token every "
                       f"{config['token_interval_ms']:g} ms")
    return path


def run_router(args: argparse.Namespace) -> dict:
    """Run the whole benchmark; write JSON + PNG under --out, print the table, return the results."""
    from segserve.bench.machine import machine_info
    from common.checkpoint import resolve_model

    config = RouterBenchConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RouterBenchConfig)})
    logging.getLogger("httpx").setLevel(logging.WARNING)
    out = Path(config.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(config.model)
    results = {"benchmark": "router", "command": shlex.join(sys.argv), "config": asdict(config),
               "model": str(model_dir), "machine": machine_info()}
    with tempfile.TemporaryDirectory(prefix="segserve-bench-router-") as tmp:
        measured = measure_router(config, model_dir, out / "logs", Path(tmp))
    results["rounds"] = measured["rounds"]
    results["endpoints"] = {e: summarize([r[e] for r in measured["rounds"]]) for e in ENDPOINTS}
    results["grpc_client_floor"] = measured["grpc_floor"]
    if TRACED in measured:
        results[TRACED] = {"endpoints": {e: summarize([r[TRACED][e] for r in measured["rounds"]]) for e in ENDPOINTS},
                           **measured[TRACED]}
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    save(results, out, "router", plot)
    print(f"\npaced scheduler: a token every {config.token_interval_ms:g} ms per stream; {config.rounds} rounds; "
          f"data reflow {'on' if config.reflow else 'off'}; tokenizer {model_dir}\n")
    if TRACED in results:
        print(f"tracing on: {results[TRACED]['received']['num_spans']} spans received for "
              f"{results[TRACED]['num_requests']} requests to the traced router\n")
    print(markdown_table(results))
    return results
