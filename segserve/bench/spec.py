"""`segserve bench spec`: speculative decoding vs plain and prompt-lookup `generate()`, per workload.

In one run, single stream, greedy, fixed max_tokens, EOS ignored: HF plain
`generate()`, HF `generate(prompt_lookup_num_tokens=10)`, segserve with
speculation off and on (each segserve system is a fresh local stack). Every
system gets two short warm-up requests (a pattern that makes drafters propose
trees), then every workload's prompts in order.
Outputs under --out: spec.json (every raw number, the command, the machine),
spec.png, the services' logs; the markdown table and the goals are printed,
greedy-output mismatches against HF plain loudly. With --rounds N > 1 the whole
run repeats N times (round-<k>/ each) and speedup.json / speedup.png give each
workload's speedup over plain generate() per round, its median and its spread.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from segserve.bench import spec_report as report
from segserve.bench.spec_workloads import KINDS, WARMUP_PROMPT, Workload, build_workloads

SYSTEMS = (report.PLAIN, report.LOOKUP, report.OFF, report.SPEC)
SystemFactory = Callable[[], AbstractContextManager]


@dataclass
class SpecBenchConfig:
    model: str | None = None
    """Model directory; None = the default gemma-3-270m. Every system runs this one."""
    max_tokens: int = 64
    """Tokens generated per request; EOS never ends a request early."""
    num_structured: int = 4
    """Requests of the structured workload, sent in order (the corpus learns from earlier ones)."""
    num_structured_warmup: int = 1
    """Leading structured requests left out of its steady-state numbers and goals."""
    systems: tuple[str, ...] = SYSTEMS
    """Systems to run, a subset of hf_plain, hf_prompt_lookup, segserve_off, segserve_spec."""
    kinds: tuple[str, ...] = KINDS
    """Workload kinds to run, a subset of code_edit, grounded, structured, open_ended."""
    prompt_lookup_num_tokens: int = 10
    """prompt_lookup_num_tokens of the HF prompt-lookup system."""
    dtype: str = "auto"
    """Weights dtype for every system: auto = bfloat16 on cuda, float32 on cpu."""
    startup_timeout_s: float = 300.0
    """Longest a segserve stack may take to become ready."""
    request_timeout_s: float = 600.0
    """Longest one segserve request may take."""
    out: str = "bench-results/spec"
    """Directory for spec.json, spec.png and the services' logs."""
    rounds: int = 1
    """Whole runs, each with fresh systems; with more than one, each goes to round-<k>/ and speedup.png shows
    the spread of each workload's speedup over the rounds."""

    def __post_init__(self) -> None:
        self.systems, self.kinds = tuple(self.systems), tuple(self.kinds)
        if self.max_tokens < 1 or self.prompt_lookup_num_tokens < 1:
            raise ValueError("max_tokens and prompt_lookup_num_tokens must be >= 1")
        if not 0 <= self.num_structured_warmup < self.num_structured:
            raise ValueError("need 0 <= num_structured_warmup < num_structured")
        if not self.systems or set(self.systems) - set(SYSTEMS):
            raise ValueError(f"systems must be a non-empty subset of {SYSTEMS}")
        if not self.kinds or set(self.kinds) - set(KINDS):
            raise ValueError(f"kinds must be a non-empty subset of {KINDS}")
        if self.rounds < 1:
            raise ValueError("rounds must be >= 1")
        if min(self.startup_timeout_s, self.request_timeout_s) <= 0:
            raise ValueError("time limits must be > 0")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unsupported dtype {self.dtype!r}")


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `segserve bench spec`, one per SpecBenchConfig field."""
    defaults = SpecBenchConfig()
    parser.add_argument("--model", default=defaults.model, help="model directory (default: gemma-3-270m)")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--num-structured", type=int, default=defaults.num_structured)
    parser.add_argument("--num-structured-warmup", type=int, default=defaults.num_structured_warmup)
    parser.add_argument("--systems", type=_names, default=defaults.systems, help="comma-separated: " + ",".join(SYSTEMS))
    parser.add_argument("--kinds", type=_names, default=defaults.kinds, help="comma-separated: " + ",".join(KINDS))
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=defaults.prompt_lookup_num_tokens)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=defaults.dtype)
    parser.add_argument("--startup-timeout-s", type=float, default=defaults.startup_timeout_s)
    parser.add_argument("--request-timeout-s", type=float, default=defaults.request_timeout_s)
    parser.add_argument("--out", default=defaults.out, help="output directory (default: bench-results/spec)")
    parser.add_argument("--rounds", type=int, default=defaults.rounds,
                        help="whole runs with fresh systems; > 1 adds speedup.png with the spread over rounds")


def config_from_args(args: argparse.Namespace) -> SpecBenchConfig:
    return SpecBenchConfig(**{f.name: getattr(args, f.name) for f in fields(SpecBenchConfig)})


def default_factories(config: SpecBenchConfig, model_dir: Path, out: Path) -> dict[str, SystemFactory]:
    """The four real systems, started only when their turn comes."""
    from segserve.bench.spec_systems import hf_system, segserve_system

    served = dict(startup_timeout_s=config.startup_timeout_s, request_timeout_s=config.request_timeout_s)
    return {
        report.PLAIN: lambda: hf_system(model_dir, config.dtype),
        report.LOOKUP: lambda: hf_system(model_dir, config.dtype,
                                         prompt_lookup_num_tokens=config.prompt_lookup_num_tokens),  # fmt: skip
        report.OFF: lambda: segserve_system(model_dir, config.dtype, False, out / "logs-spec-off", **served),
        report.SPEC: lambda: segserve_system(model_dir, config.dtype, True, out / "logs-spec-on", **served),
    }


def run_system(name: str, factory: SystemFactory, workloads: list[Workload], max_tokens: int) -> dict:
    """Warm up, then every workload's prompts in order; a system that fails is reported, not raised."""
    runs: dict[str, list[dict]] = {}
    try:
        with factory() as complete:
            for _ in range(2):  # the first tree verifications are slow; none of them is measured
                complete(WARMUP_PROMPT, min(16, max_tokens))
            for workload in workloads:
                runs[workload.kind] = [complete(prompt, max_tokens) for prompt in workload.prompts]
                rates = ", ".join(f"{r['num_tokens'] / r['wall_s']:.1f}" for r in runs[workload.kind])
                print(f"[bench spec] {name} {workload.kind}: {rates} tok/s", file=sys.stderr, flush=True)
    except Exception as exc:  # a benchmark reports a system that would not run; it does not crash
        return {"name": name, "error": f"{type(exc).__name__}: {exc}", "workloads": runs}
    return {"name": name, "workloads": runs}


def run_benchmark(config: SpecBenchConfig, factories: dict[str, SystemFactory], out: Path,
                  header: dict | None = None) -> dict:  # fmt: skip
    """Run every configured system, compute summaries/speedups/goals/mismatches, write JSON + PNG."""
    workloads = build_workloads(config.num_structured, config.num_structured_warmup, config.kinds)
    warmup = {w.kind: w.num_warmup for w in workloads}
    results = {"benchmark": "spec", **(header or {}), "config": asdict(config),
               "workloads": [asdict(w) for w in workloads], "systems": {}}  # fmt: skip
    for name in config.systems:
        results["systems"][name] = run_system(name, factories[name], workloads, config.max_tokens)
    runs = {name: system["workloads"] for name, system in results["systems"].items()}
    results["summaries"] = {name: {kind: report.summarize(requests, warmup[kind]) for kind, requests in per.items()}
                            for name, per in runs.items()}  # fmt: skip
    results["speedups"] = report.speedups(results["summaries"])
    results["goals"] = report.evaluate_goals(results["speedups"])
    results["progression"] = {name: report.progression(per["structured"]) for name, per in runs.items()
                              if "structured" in per}  # fmt: skip
    texts = {name: {kind: [r["text"] for r in requests] for kind, requests in per.items()} for name, per in runs.items()}
    results["mismatches"] = report.mismatches(texts)
    results["outputs"] = {"json": str(out / "spec.json"), "png": str(out / "spec.png")}
    out.mkdir(parents=True, exist_ok=True)
    report.plot(out / "spec.png", results)
    from segserve.bench.report import write_json

    write_json(out / "spec.json", results)
    return results


def print_results(results: dict) -> None:
    print(report.markdown_table(results))
    for system in results["systems"].values():
        if system.get("error"):
            print(f"\n{system['name']}: ERROR {system['error']}")
    for item in results["mismatches"]:
        print(f"\nMISMATCH: {item['system']} {item['kind']}[{item['index']}] differs from HF plain greedy at "
              f"char {item['first_diff_char']}:\n  got      {item['got']!r}\n  expected {item['expected']!r}")
    if not results["mismatches"]:
        print("\ngreedy outputs: every compared output equals HF plain generate()")


def run_spec(args: argparse.Namespace) -> dict:
    """Run the whole benchmark; write spec.json + spec.png under --out, print the table, return the results."""
    from segserve.bench.peers import resolve_dtype
    from segserve.bench.throughput import machine_info
    from segserve.checkpoint import resolve_model

    config = config_from_args(args)
    config.dtype = resolve_dtype(config.dtype)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    out = Path(config.out)
    model_dir = resolve_model(config.model)
    header = {"command": shlex.join(sys.argv), "model": str(model_dir), "machine": machine_info()}
    from segserve.bench.report import write_json

    rounds = []
    for k in range(config.rounds):
        round_out = out if config.rounds == 1 else out / f"round-{k + 1}"
        results = run_benchmark(config, default_factories(config, model_dir, round_out), round_out, header)
        results["machine"]["loadavg_end"] = list(os.getloadavg())
        write_json(round_out / "spec.json", results)
        print_results(results)
        rounds.append(results)
    if config.rounds > 1:
        spread = {"benchmark": "spec-rounds", **header, "speedups": report.speedup_spread(rounds)}
        write_json(out / "speedup.json", spread)
        report.plot_speedup_spread(out / "speedup.png", spread)
        print(f"\nspeedup over {config.rounds} rounds: {out / 'speedup.png'}")
    return results
