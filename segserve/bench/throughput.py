"""`segserve bench throughput`: segserve vs a peer on the same model, 1/4/16 streams.

Order (nothing else of ours runs while a system is measured): plain `generate()`
baseline in this process -> segserve (launched with `segserve.launcher.Stack`,
or an already running one via --segserve-url) -> the launched stack's router
through its public gRPC API (`grpc_public`, GenerateStream; skipped with
--no-grpc-api or --segserve-url) -> the launched stack's scheduler
called directly over gRPC (`grpc_direct`, for the router's own overhead over
HTTP and over gRPC; skipped with --no-router-overhead or --segserve-url) -> with
--overhead-rounds N, N rounds of each level through the router and then directly,
back to back -> with --decode-rounds N, N rounds of one generate() and one stream
through the router, back to back (`decode_rounds`) -> the peer (`transformers serve
--continuous-batching`, or batched `generate()` when that cannot start). With
--peer vllm instead: the baseline, then segserve and vLLM (`make vllm`) up at once,
--rounds alternated rounds of every level against both (side_by_side.py), and
their ratios with the spread. Each server is warmed up first (a short request,
then a short batched round).
Outputs go to --out: throughput.json, throughput.png, the peer's log; the
markdown table is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import shlex
import sys
from dataclasses import asdict, fields, replace
from pathlib import Path

from segserve.bench import decode_rounds, grpc_direct, grpc_public, loadgen, peers, report, side_by_side
from segserve.bench.harness import save
from segserve.bench.machine import machine_info
from segserve.bench.prompts import PROMPTS
from segserve.bench.throughput_config import PEER_CHOICES, ThroughputConfig


VLLM_MINIMUMS = {1: 1.2, 16: 1.2, 64: 1.0}
"""segserve's aggregate tokens/s over vLLM's that the goals ask for, per stream count."""


def _concurrency_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `segserve bench throughput`, one per ThroughputConfig field."""
    defaults = ThroughputConfig()
    parser.add_argument("--model", default=defaults.model,
                        help="catalog name or transformers model directory (default model if unset)")
    parser.add_argument("--concurrency", type=_concurrency_list, default=defaults.concurrency, help="e.g. 1,4,16")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--requests-per-stream", type=int, default=defaults.requests_per_stream)
    parser.add_argument("--peer", choices=PEER_CHOICES, default=defaults.peer)
    parser.add_argument("--peer-args", default=defaults.peer_args, help="extra flags for the peer's server")
    parser.add_argument("--rounds", type=int, default=defaults.rounds,
                        help="with --peer vllm: alternated rounds of every level against both (default: 3)")
    parser.add_argument("--vllm-speculative-config", default=defaults.vllm_speculative_config,
                        help="vLLM's --speculative-config when speculation is on (default: suffix decoding)")
    parser.add_argument("--segserve-url", default=None, help="bench a running segserve instead of launching one")
    parser.add_argument("--skip-segserve", action="store_true")
    parser.add_argument("--router-overhead", action=argparse.BooleanOptionalAction, default=defaults.router_overhead,
                        help="also call the scheduler's gRPC directly to measure the router's overhead")  # fmt: skip
    parser.add_argument("--overhead-rounds", type=int, default=defaults.overhead_rounds,
                        help="more rounds of router-then-direct per level, for the overhead's median and spread")
    parser.add_argument("--decode-rounds", type=int, default=defaults.decode_rounds,
                        help="alternated rounds of generate() and one stream through the router, for their ratio")
    parser.add_argument("--grpc-api", action=argparse.BooleanOptionalAction, default=defaults.grpc_api,
                        help="also stream through the router's public gRPC API (GenerateStream)")  # fmt: skip
    parser.add_argument("--baseline-runs", type=int, default=defaults.baseline_runs)
    parser.add_argument("--level-time-limit-s", type=float, default=defaults.level_time_limit_s)
    parser.add_argument("--request-timeout-s", type=float, default=defaults.request_timeout_s)
    parser.add_argument("--startup-timeout-s", type=float, default=defaults.startup_timeout_s)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=defaults.dtype)
    parser.add_argument("--speculation", action=argparse.BooleanOptionalAction, default=defaults.speculation,
                        help="drafters and speculative decoding in the launched stack")  # fmt: skip
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=defaults.async_scheduling, help="the launched scheduler's async scheduling")
    parser.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=defaults.compiled,
                        help="the launched worker's decoder compiled by torch.compile")
    parser.add_argument("--num-decode-steps", type=int, default=defaults.num_decode_steps,
                        help="the launched scheduler's most decode steps per worker request (1 = off; default: "
                        "the scheduler's)")
    parser.add_argument("--decode-steps-ms", type=float, default=defaults.decode_steps_ms,
                        help="the launched scheduler's time bound on one request's decode steps (default: its own)")
    parser.add_argument("--out", default=defaults.out, help="output directory (default: bench-results/)")


def config_from_args(args: argparse.Namespace) -> ThroughputConfig:
    return ThroughputConfig(**{f.name: getattr(args, f.name) for f in fields(ThroughputConfig)})


def bench_http(name: str, base_url: str, model: str | None, extra_body: dict, config: ThroughputConfig) -> dict:
    """Warm up (one short request, then one short batched round), then run every level against one server."""
    system = warm_up(name, base_url, model, extra_body, config)
    if system.get("error"):
        return system
    for concurrency in config.concurrency:
        system["levels"].append(http_level(base_url, model, system["extra_body"], config, concurrency))
        _progress(name, system["levels"][-1])
    return system


def warm_up(name: str, base_url: str, model: str | None, extra_body: dict, config: ThroughputConfig) -> dict:
    """The system's entry, its levels empty, after one short request and one short batched round; without
    `extra_body` (in the entry) when the server refused it; with "error" when the short request failed."""
    spec = http_spec(base_url, model, extra_body, config, 1)
    system = {"name": name, "kind": "openai-sse", "base_url": base_url, "model": model, "extra_body": extra_body,
              "levels": []}
    warmup = loadgen.run(loadgen.probe(spec))
    if warmup.error and extra_body and warmup.error.startswith("HTTP 4"):
        system["notes"] = [f"server refused extra body {extra_body} ({warmup.error}); EOS may end requests early"]
        extra_body = system["extra_body"] = {}
        spec = replace(spec, extra_body=extra_body)
        warmup = loadgen.run(loadgen.probe(spec))
    if warmup.error:
        return {**system, "error": f"warm-up request failed: {warmup.error}"}
    # A short batched round too: the first batched steps of a server are slower than the rest.
    loadgen.run(loadgen.run_load(replace(spec, concurrency=min(4, config.concurrency[-1]),
                                         max_tokens=min(8, config.max_tokens), requests_per_stream=1)))
    return system


def http_spec(base_url: str, model: str | None, extra_body: dict, config: ThroughputConfig,
              concurrency: int) -> loadgen.LoadSpec:
    """A level of `concurrency` streams as `config` sets it (the warm-ups replace its sizes)."""
    return loadgen.LoadSpec(base_url=base_url, prompts=PROMPTS, max_tokens=config.max_tokens, model=model,
                            request_timeout_s=config.request_timeout_s, time_limit_s=config.level_time_limit_s,
                            concurrency=concurrency, requests_per_stream=config.requests_per_stream,
                            extra_body=extra_body)


def http_level(base_url: str, model: str | None, extra_body: dict, config: ThroughputConfig, concurrency: int) -> dict:
    """One level against an OpenAI-compatible server (no warm-up)."""
    level_spec = http_spec(base_url, model, extra_body, config, concurrency)
    run = loadgen.run(loadgen.run_load(level_spec))
    return report.level_result(concurrency, run.records, run.started_at, run.finished_at)


def overhead_rounds(config: ThroughputConfig, base_url: str, model: str | None, extra_body: dict,
                    scheduler_address: str, prompt_token_ids: list[list[int]]) -> list[dict]:
    """config.overhead_rounds rounds; in each, every level through the router and then straight to the scheduler,
    back to back, so that the machine's drift falls on both sides of each difference alike."""
    rounds = []
    for number in range(config.overhead_rounds):
        for concurrency in config.concurrency:
            via_router, router_cpu = loadgen.with_cpu(http_level, base_url, model, extra_body, config, concurrency)
            direct, grpc_cpu = loadgen.with_cpu(grpc_direct.grpc_level, scheduler_address, prompt_token_ids, config,
                                                concurrency)
            rounds.append({"round": number, "concurrency": concurrency,
                           "router_tpot_ms": via_router["tpot_ms_mean"], "grpc_tpot_ms": direct["tpot_ms_mean"],
                           "router_client_cpu_ms_per_token": loadgen.cpu_ms_per_token(router_cpu, via_router),
                           "grpc_client_cpu_ms_per_token": loadgen.cpu_ms_per_token(grpc_cpu, direct),
                           "num_errors": via_router["num_errors"] + direct["num_errors"]})
            print(f"[bench] overhead round {number + 1}/{config.overhead_rounds} x{concurrency}: router "
                  f"{via_router['tpot_ms_mean'] or 0:.2f}, direct {direct['tpot_ms_mean'] or 0:.2f} ms/token",
                  file=sys.stderr, flush=True)
    return rounds


def _progress(name: str, level: dict) -> None:
    summary = level["summary"]
    tps = summary["aggregate_tokens_per_s"]
    print(f"[bench] {name} x{level['concurrency']}: {tps or 0:.1f} tok/s, "
          f"{summary['num_errors']}/{summary['num_requests']} errors", file=sys.stderr, flush=True)  # fmt: skip


def bench_segserve(config: ThroughputConfig, model_dir: Path, out: Path,
                   generate_rate: decode_rounds.GenerateRate | None = None) -> dict[str, dict]:
    """{"segserve": through the router} and, when measured, {"segserve_grpc": its scheduler called directly}.
    generate_rate: one generate()'s decode rate, for the decode rounds."""
    extra_body = {"ignore_eos": True}
    if config.segserve_url:
        model = loadgen.run(loadgen.fetch_model_name(config.segserve_url))
        system = bench_http("segserve", config.segserve_url, model, extra_body, config)
        if config.router_overhead:
            system.setdefault("notes", []).append("router overhead not measured: --segserve-url names no scheduler")
        if config.grpc_api:
            system.setdefault("notes", []).append("gRPC API not measured: --segserve-url names no gRPC port")
        return {"segserve": system}
    try:
        from segserve.launcher import Stack

        stack_config = segserve_stack_config(config, model_dir, out)
        with Stack(stack_config) as stack:
            return bench_router_and_scheduler(config, model_dir, stack.base_url, stack.config.router.scheduler_address,
                                              stack.grpc_address, generate_rate)  # fmt: skip
    except Exception as exc:  # a benchmark reports a system that would not run; it does not crash
        return {"segserve": {"name": "segserve", "error": f"{type(exc).__name__}: {exc}", "levels": []}}


def segserve_stack_config(config: ThroughputConfig, model_dir: Path, out: Path):
    """The launched stack of `config`, every port picked by the launcher, logs under out/segserve-logs."""
    from router.config import RouterConfig
    from scheduler.config import SchedulerConfig
    from segserve.launcher import StackConfig
    from worker.config import WorkerConfig

    return StackConfig(
        worker=WorkerConfig(model=str(model_dir), dtype=config.dtype, port=0, is_compiled=config.compiled),
        scheduler=SchedulerConfig(port=0, is_async_scheduling=config.async_scheduling,
                                  **{name: value for name in ("num_decode_steps", "decode_steps_ms")
                                     if (value := getattr(config, name)) is not None}),
        is_speculative=config.speculation,
        router=RouterConfig(port=0, is_grpc_api=config.grpc_api, grpc_port=0),
        startup_timeout_s=config.startup_timeout_s,
        log_dir=str(out / "segserve-logs"),
    )


def bench_side_by_side(config: ThroughputConfig, model_dir: Path, out: Path) -> dict[str, dict]:
    """{"segserve", "peer"}: the launched stack (or the one at config.segserve_url) and vLLM (`make vllm`;
    speculating by config.vllm_speculative_config when config.speculation is on), both up at once, then
    config.rounds alternated rounds of every level (side_by_side.py); each system's levels are its median round's,
    every round is under "rounds"."""
    from segserve.launcher import Stack

    speculative = json.loads(config.vllm_speculative_config) if config.speculation else None
    peer = peers.VllmServe(model_dir, dtype=config.dtype, speculative_config=speculative,
                           startup_timeout_s=max(config.startup_timeout_s, 900.0), log_path=out / "vllm.log",
                           extra_args=tuple(shlex.split(config.peer_args)))
    failed = {"name": peer.name, "levels": []}
    try:
        failed["command"] = shlex.join(peer.command())
    except peers.PeerStartError as exc:  # not installed
        return {"peer": {**failed, "error": str(exc)}}
    peer.start()  # its start-up (minutes of compiling) overlaps the stack's
    try:
        with contextlib.ExitStack() as running:
            base_url = config.segserve_url
            if not base_url:
                base_url = running.enter_context(Stack(segserve_stack_config(config, model_dir, out))).base_url
            try:
                peer.wait_ready()
            except peers.PeerStartError as exc:
                return {"peer": {**failed, "error": str(exc)}}
            model = loadgen.run(loadgen.fetch_model_name(base_url))
            ours = warm_up("segserve", base_url, model, {"ignore_eos": True}, config)
            theirs = warm_up(peer.name, peer.base_url, peer.model_name, {"ignore_eos": True}, config)
            theirs["command"] = failed["command"]
            if ours.get("error") or theirs.get("error"):
                return {"segserve": ours, "peer": theirs}
            ran = side_by_side.alternated_rounds({
                "segserve": functools.partial(http_level, base_url, model, ours["extra_body"], config),
                "peer": functools.partial(http_level, peer.base_url, peer.model_name, theirs["extra_body"], config),
            }, config.concurrency, config.rounds)
    finally:
        peer.stop()
    for system, name in ((ours, "segserve"), (theirs, "peer")):
        system["levels"] = side_by_side.median_levels(ran[name])
        system["rounds"] = ran[name]
    return {"segserve": ours, "peer": theirs}


def bench_router_and_scheduler(config: ThroughputConfig, model_dir: Path, base_url: str, scheduler_address: str,
                               grpc_address: str | None = None,
                               generate_rate: decode_rounds.GenerateRate | None = None) -> dict[str, dict]:
    """One running stack: every level through the router over HTTP, then (grpc_api) through its public gRPC API
    at `grpc_address`, then (router_overhead) straight to its scheduler, then (decode_rounds, with generate_rate)
    the decode rounds through the router."""
    model = loadgen.run(loadgen.fetch_model_name(base_url))
    systems = {"segserve": bench_http("segserve", base_url, model, {"ignore_eos": True}, config)}
    extra_body = systems["segserve"].get("extra_body", {})  # what the router accepted (bench_http)
    if config.grpc_api and grpc_address:
        try:
            public = grpc_public.bench_public_grpc(grpc_address, PROMPTS, model, config)
        except Exception as exc:  # keep the other systems' numbers when this one fails
            public = {"name": grpc_public.NAME, "error": f"{type(exc).__name__}: {exc}", "levels": []}
        for level in public["levels"]:
            _progress(public["name"], level)
        systems["segserve_grpc_api"] = public
    if config.router_overhead:
        try:
            prompt_token_ids = grpc_direct.tokenize_prompts(model_dir, PROMPTS)
            direct = grpc_direct.bench_grpc(scheduler_address, prompt_token_ids, config)
        except Exception as exc:  # keep the router's numbers when the direct run fails
            direct = {"name": "segserve scheduler gRPC (direct)", "error": f"{type(exc).__name__}: {exc}", "levels": []}
        for level in direct["levels"]:
            _progress(direct["name"], level)
        if config.overhead_rounds and not direct.get("error"):
            try:
                direct["overhead_rounds"] = overhead_rounds(config, base_url, model, extra_body, scheduler_address,
                                                            prompt_token_ids)
            except Exception as exc:  # keep both systems' levels when a round fails
                direct.setdefault("notes", []).append(f"overhead rounds failed: {type(exc).__name__}: {exc}")
        systems["segserve_grpc"] = direct
    if config.decode_rounds and generate_rate is not None:
        systems["segserve"]["decode_rounds"] = decode_rounds.run(
            config.decode_rounds, generate_rate, lambda: http_level(base_url, model, extra_body, config, 1)["summary"])
    return systems


def bench_peer(config: ThroughputConfig, model_dir: Path, out: Path) -> dict | None:
    if config.peer == "none":
        return None
    notes = []
    if config.peer in ("auto", "transformers-serve"):
        server = peers.TransformersServe(
            model_dir, dtype=config.dtype, startup_timeout_s=config.startup_timeout_s,
            log_path=out / "transformers-serve.log", extra_args=tuple(shlex.split(config.peer_args)),
        )
        try:
            with server:
                extra_body = peers.ignore_eos_body(model_dir, config.max_tokens)
                system = bench_http(f"{server.name} (continuous batching)", server.base_url, server.model_name,
                                    extra_body, config)  # fmt: skip
            system["command"] = shlex.join(server.command())
            if config.peer == "transformers-serve" or "error" not in system:
                return system
            notes.append(system["error"])
        except peers.PeerStartError as exc:
            if config.peer == "transformers-serve":
                return {"name": server.name, "error": str(exc), "levels": []}
            notes.append(f"transformers serve could not start: {exc}")
    return bench_batched_generate(config, model_dir, notes)


def bench_batched_generate(config: ThroughputConfig, model_dir: Path, notes: list[str]) -> dict:
    """The fallback peer: every stream of a level is one row of one generate() batch."""
    model, tokenizer = peers.load_model(model_dir, config.dtype)
    system = {"name": "batched generate()", "kind": "batched-generate", "notes": notes, "levels": []}
    for concurrency in config.concurrency:
        records = peers.run_batched_generate(
            model, tokenizer, PROMPTS, concurrency, config.max_tokens, config.requests_per_stream
        )
        started_at, finished_at = records[0].started_at, records[-1].finished_at
        system["levels"].append(report.level_result(concurrency, records, started_at, finished_at))
        _progress(system["name"], system["levels"][-1])
    return system


def run_throughput(args: argparse.Namespace) -> dict:
    """Run the whole benchmark; write JSON + PNG under --out, print the table, return the results."""
    from common.checkpoint import resolve_model
    from common.heap import freeze_startup_heap

    config = config_from_args(args)
    config.dtype = peers.resolve_dtype(config.dtype)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(config.model)
    results = {
        "benchmark": "throughput",
        "command": shlex.join(sys.argv),
        "config": asdict(config),
        "model": str(model_dir),
        "machine": machine_info(),
        "prompts": PROMPTS,
        "systems": {},
    }
    model, tokenizer = peers.load_model(model_dir, config.dtype)
    results["baseline"] = peers.measure_plain_generate(model, tokenizer, PROMPTS[0], config.max_tokens,
                                                       config.baseline_runs)  # fmt: skip
    generate_rate = functools.partial(decode_rounds.generate_rate, model, tokenizer, PROMPTS[0], config.max_tokens)
    freeze_startup_heap()  # the client's own full collections would stall its reading of every stream
    if config.peer == "vllm":
        del model, tokenizer
        results["systems"].update(bench_side_by_side(config, model_dir, out))
    else:
        if not config.skip_segserve:
            results["systems"].update(bench_segserve(config, model_dir, out, generate_rate))
        del model, tokenizer
        results["systems"]["peer"] = bench_peer(config, model_dir, out)
    peer = results["systems"].get("peer")
    if peer is None:
        results["systems"].pop("peer", None)
    systems = results["systems"]
    if "segserve_grpc" in systems:
        results["router_overhead"] = report.router_overhead(systems["segserve"], systems["segserve_grpc"])
        if systems["segserve_grpc"].get("overhead_rounds"):
            results["router_overhead_rounds"] = report.overhead_rounds(systems["segserve_grpc"]["overhead_rounds"])
        if "segserve_grpc_api" in systems:
            api, direct = systems["segserve_grpc_api"], systems["segserve_grpc"]
            results["grpc_api_overhead"] = report.router_overhead(api, direct)
    low, high = config.concurrency[0], config.concurrency[-1]
    results["goals"] = report.evaluate_goals(results["baseline"], results["systems"].get("segserve"), peer, low, high)
    if peer is not None and peer.get("rounds") and systems.get("segserve", {}).get("rounds"):
        results["side_by_side"] = side_by_side.ratios(systems["segserve"]["rounds"], peer["rounds"])
        results["goals"] += side_by_side.goals(results["side_by_side"], peer["name"], VLLM_MINIMUMS)
    if systems.get("segserve", {}).get("decode_rounds"):
        results["decode_rounds"] = decode_rounds.summarize(systems["segserve"]["decode_rounds"])
        results["goals"].append(decode_rounds.goal(results["decode_rounds"]))
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    save(results, out, "throughput", report.plot)
    print(f"\npeer: {peer['name'] if peer else 'none'}; baseline: {results['baseline']['method']}\n")
    print(report.markdown_table(results))
    if results.get("side_by_side"):
        print("\n".join(side_by_side.markdown(results["side_by_side"], peer["name"])))
    for system in results["systems"].values():
        for line in [system["error"]] if system.get("error") else []:
            print(f"\n{system['name']}: {line}")
        for note in system.get("notes", []):
            print(f"\n{system['name']}: {note}")
    return results
