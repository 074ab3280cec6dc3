"""`segserve bench spec`: speculative decoding against plain decoding and prompt lookup, per workload.

One stream, fixed max_tokens per workload, EOS ignored. Systems: HF plain
`generate()`, HF `generate(prompt_lookup_num_tokens=10)`, and on segserve's own
engine plain decoding (spec off), prompt lookup only (no segment corpora, one
chain), SuffixDecoding (the drafter's suffix backend) and full segserve (segment
corpora learned online, trees): the last four are the same-engine comparison.
`--kinds peer` runs the workloads SuffixDecoding was built for (agentic loops,
self-refinement, code edits, extraction, and chat as the control), recorded as
JSONL; their warm-up requests teach the drafters and only the held-out ones
count. Each segserve system is a fresh local stack. Every system gets two short
warm-up requests, then every workload's prompts in order (edit workloads: earlier
requests teach the drafter).
With --mixed-concurrency N the workloads run as a shared server sees them instead:
their requests interleaved (one from each workload in turn) at N streams, each
workload under a tenant of its own, warm-up requests first, then the held-out
ones measured together as one row, `mixed` (servers only: no HF system; spec_mixed.py).
--workloads-file F.jsonl replaces the built-in workloads by anyone's own
(spec_workloads.load_file's format: the peer workloads' JSONL).
The whole run repeats --rounds times (3 by default) with fresh systems, each round
starting at the next system; every number is reported as its median, min, max
and per-round values. With
--finetuned-model DIR every round runs the same systems on that model too.
Outputs under --out: spec.json (every raw number, the command, the machine),
spec.png, round-<k>/<model>/spec.json and the services' logs; the markdown
tables and the goals are printed, greedy-output mismatches loudly.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from segserve.bench import spec_report as report
from segserve.bench.harness import check_runs, print_failures, save, write_json
from segserve.bench.spec_mixed import SystemFactory, run_mixed
from segserve.bench.spec_workloads import DEFAULT_KINDS, EDIT_KINDS, KINDS, MIXED, PEER_KINDS, PUBLIC_KINDS, \
    WARMUP_PROMPT, Workload, build_workloads, load_file

SYSTEMS = report.SYSTEMS
MakeFactories = Callable[[str, Path, Path], dict[str, SystemFactory]]  # (model label, model dir, out) -> factories


@dataclass
class SpecBenchConfig:
    model: str | None = None
    """A catalog name (qwen2.5-coder-0.5b-instruct, gemma-3-270m) or a transformers model directory; None = the default
    model. Every system runs this one."""
    finetuned_model: str | None = None
    """A fine-tuned checkpoint directory (`segserve finetune`): every round also runs the same systems on it,
    reported side by side; None = no such comparison (spec.json says so)."""
    max_tokens: int = 64
    """Tokens generated per request of the workloads without their own length; EOS never ends one early."""
    num_structured: int = 4
    """Requests of the structured workload, sent in order (the corpus learns from earlier ones)."""
    num_structured_warmup: int = 1
    """Leading structured requests left out of its steady-state numbers and goals."""
    num_edits: int = 4
    """Requests of each edit workload (different files, the same edit), in order; the first is a warm-up."""
    temperature: float = 0.7
    """Temperature of the sampled workloads."""
    systems: tuple[str, ...] = report.DEFAULT_SYSTEMS
    """Systems to run, a subset of hf_plain, hf_prompt_lookup, segserve_off, segserve_lookup, segserve_suffix,
    segserve_spec, vllm_plain and vllm_suffix (`make vllm`'s, its SuffixDecoding with 5 speculative tokens); the
    first six by default."""
    kinds: tuple[str, ...] = DEFAULT_KINDS
    """Workload kinds to run, a subset of spec_workloads.KINDS ("peer" on the command line: PEER_KINDS, "public":
    PUBLIC_KINDS)."""
    prompt_lookup_num_tokens: int = 10
    """prompt_lookup_num_tokens of the HF prompt-lookup system."""
    dtype: str = "auto"
    """Weights dtype for every system: auto = bfloat16 on cuda, float32 on cpu."""
    startup_timeout_s: float = 300.0
    """Longest a segserve stack may take to become ready."""
    request_timeout_s: float = 600.0
    """Longest one segserve request may take."""
    out: str = "bench-results/spec"
    """Directory for spec.json, spec.png, the rounds' own JSON and the services' logs."""
    rounds: int = 3
    """Whole runs, each with fresh systems; every number is reported with its spread over them."""
    mixed_concurrency: int = 0
    """0: each workload on its own, one stream; N: every workload's requests interleaved at N streams, a tenant per
    workload, measured together (the `mixed` row)."""
    workloads_file: str | None = None
    """A JSONL file of requests (spec_workloads.load_file) run instead of the built-in workloads; None = those."""

    def __post_init__(self) -> None:
        self.systems, self.kinds = tuple(self.systems), tuple(self.kinds)
        if self.max_tokens < 1 or self.prompt_lookup_num_tokens < 1:
            raise ValueError("max_tokens and prompt_lookup_num_tokens must be >= 1")
        if not 0 <= self.num_structured_warmup < self.num_structured:
            raise ValueError("need 0 <= num_structured_warmup < num_structured")
        if self.num_edits < 2:
            raise ValueError("num_edits must be >= 2 (the first one is a warm-up)")
        if not self.temperature > 0:
            raise ValueError("temperature must be > 0")
        check_runs(self, SYSTEMS, KINDS)
        if self.mixed_concurrency < 0:
            raise ValueError("mixed_concurrency must be >= 0 (0 = each workload on its own)")
        if self.mixed_concurrency and {report.PLAIN, report.LOOKUP} & set(self.systems):
            raise ValueError("the mixed mode runs servers side by side: leave hf_plain and hf_prompt_lookup out")
        if self.workloads_file:
            load_file(self.workloads_file)  # a bad file is named with its line before any system starts


def _names(text: str) -> tuple[str, ...]:
    """Comma-separated names; "peer" stands for the peer workloads, "public" for the public ones."""
    groups = {"peer": PEER_KINDS, "public": PUBLIC_KINDS}
    names = (part.strip() for part in text.split(",") if part.strip())
    return tuple(expanded for name in names for expanded in groups.get(name, (name,)))


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `segserve bench spec`, one per SpecBenchConfig field."""
    defaults = SpecBenchConfig()
    parser.add_argument("--model", default=defaults.model,
                        help="catalog name or transformers model directory (default model if unset)")
    parser.add_argument("--finetuned-model", default=defaults.finetuned_model,
                        help="fine-tuned checkpoint directory: the same systems run on it too, side by side")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--num-structured", type=int, default=defaults.num_structured)
    parser.add_argument("--num-structured-warmup", type=int, default=defaults.num_structured_warmup)
    parser.add_argument("--num-edits", type=int, default=defaults.num_edits,
                        help="requests per edit workload, the first a warm-up (default: 4)")
    parser.add_argument("--temperature", type=float, default=defaults.temperature,
                        help="temperature of the sampled workloads (default: 0.7)")
    parser.add_argument("--systems", type=_names, default=defaults.systems, help="comma-separated: " + ",".join(SYSTEMS))
    parser.add_argument("--kinds", type=_names, default=defaults.kinds,
                        help="comma-separated: " + ",".join(KINDS) + "; peer = " + ",".join(PEER_KINDS) +
                        "; public = " + ",".join(PUBLIC_KINDS))
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=defaults.prompt_lookup_num_tokens)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=defaults.dtype)
    parser.add_argument("--startup-timeout-s", type=float, default=defaults.startup_timeout_s)
    parser.add_argument("--request-timeout-s", type=float, default=defaults.request_timeout_s)
    parser.add_argument("--out", default=defaults.out, help="output directory (default: bench-results/spec)")
    parser.add_argument("--mixed-concurrency", type=int, default=defaults.mixed_concurrency,
                        help="N > 0: every workload's requests interleaved at N streams, a tenant each (row 'mixed')")
    parser.add_argument("--workloads-file", default=defaults.workloads_file,
                        help="a JSONL file of requests run instead of the built-in workloads")
    parser.add_argument("--rounds", type=int, default=defaults.rounds,
                        help="whole runs with fresh systems; numbers are reported with their spread (default: 3)")


def config_from_args(args: argparse.Namespace) -> SpecBenchConfig:
    return SpecBenchConfig(**{f.name: getattr(args, f.name) for f in fields(SpecBenchConfig)})


def default_factories(config: SpecBenchConfig) -> MakeFactories:
    """The real systems of one model and round, started only when their turn comes."""
    from segserve.bench.spec_systems import VLLM_SUFFIX_CONFIG, hf_system, segserve_system, vllm_system

    served = dict(startup_timeout_s=config.startup_timeout_s, request_timeout_s=config.request_timeout_s)

    def make(label: str, model_dir: Path, out: Path) -> dict[str, SystemFactory]:
        def segserve(mode: str) -> SystemFactory:
            return lambda: segserve_system(model_dir, config.dtype, mode, out / f"logs-{mode}", **served)

        return {
            report.PLAIN: lambda: hf_system(model_dir, config.dtype),
            report.LOOKUP: lambda: hf_system(model_dir, config.dtype,
                                             prompt_lookup_num_tokens=config.prompt_lookup_num_tokens),  # fmt: skip
            report.OFF: segserve("off"),
            report.SEG_LOOKUP: segserve("lookup"),
            report.SUFFIX: segserve("suffix"),
            report.SPEC: segserve("spec"),
            report.VLLM_PLAIN: lambda: vllm_system(model_dir, config.dtype, None, out / "logs-vllm", **served),
            report.VLLM_SUFFIX: lambda: vllm_system(model_dir, config.dtype, VLLM_SUFFIX_CONFIG,
                                                    out / "logs-vllm-suffix", **served),
        }

    return make


def run_system(name: str, factory: SystemFactory, workloads: list[Workload], max_tokens: int) -> dict:
    """Warm up, then every workload's prompts in order; a system that fails is reported, not raised."""
    runs: dict[str, list[dict]] = {}
    try:
        with factory() as complete:
            for _ in range(2):  # the first tree verifications are slow; none of them is measured
                complete(WARMUP_PROMPT, min(16, max_tokens))
            for workload in workloads:
                length = workload.max_tokens or max_tokens
                runs[workload.kind] = [complete(prompt, length, workload.temperature,
                                                None if workload.is_greedy else workload.seed + index)
                                       for index, prompt in enumerate(workload.prompts)]  # fmt: skip
                rates = ", ".join(f"{r['num_tokens'] / r['wall_s']:.1f}" for r in runs[workload.kind])
                print(f"[bench spec] {name} {workload.kind}: {rates} tok/s", file=sys.stderr, flush=True)
    except Exception as exc:  # a benchmark reports a system that would not run; it does not crash
        return {"name": name, "error": f"{type(exc).__name__}: {exc}", "workloads": runs}
    return {"name": name, "workloads": runs}


def run_round(config: SpecBenchConfig, factories: dict[str, SystemFactory], workloads: list[Workload],
              index: int = 0) -> dict:  # fmt: skip
    """Every configured system once on every workload (or on all of them mixed), round `index` starting at the
    index-th system (the order rotates, so that machine drift does not always favour the same one): raw requests,
    summaries, speedups, mismatches."""
    warmup = {w.kind: w.num_warmup for w in workloads} | {MIXED: 0}
    greedy = tuple(w.kind for w in workloads if w.is_greedy) + (MIXED,)
    start = index % len(config.systems)
    order = config.systems[start:] + config.systems[:start]
    if config.mixed_concurrency:
        ran = {name: run_mixed(name, factories[name], workloads, config.max_tokens, config.mixed_concurrency)
               for name in order}  # fmt: skip
    else:
        ran = {name: run_system(name, factories[name], workloads, config.max_tokens) for name in order}
    systems = {name: ran[name] for name in config.systems}
    runs = {name: system["workloads"] for name, system in systems.items()}
    summaries = {name: {kind: report.summarize(requests, warmup[kind]) for kind, requests in per.items()}
                 for name, per in runs.items()}  # fmt: skip
    texts = {name: {kind: [r["text"] for r in requests] for kind, requests in per.items()}
             for name, per in runs.items()}  # fmt: skip
    return {"systems": systems, "summaries": summaries, "speedups": report.speedups(summaries),
            "mismatches": report.mismatches(texts, greedy), "loadavg_end": list(os.getloadavg())}  # fmt: skip


def model_block(model_dir: str, rounds: list[dict], workloads: list[Workload]) -> dict:
    """One model over every round: the spread of every summary and speedup, goals on the medians, every
    mismatch (with its round), and where the edit workloads' greedy outputs come from (first round)."""
    block = {"model": model_dir, "summaries": report.spread([r["summaries"] for r in rounds]),
             "speedups": report.spread([r["speedups"] for r in rounds])}  # fmt: skip
    block["mismatches"] = [{"round": k + 1, **m} for k, r in enumerate(rounds) for m in r["mismatches"]]
    block["outputs_compared"] = bool({report.PLAIN, report.OFF} & set(rounds[0]["systems"]))
    """False: no plain-decoding system ran, so no greedy output had a reference (and the goal is not listed)."""
    block["goals"] = report.evaluate_goals(report.medians(block["speedups"]),
                                           block["mismatches"] if block["outputs_compared"] else None)
    memory = report.memory_goal(report.medians(block["summaries"]))
    if memory is not None:
        block["goals"].insert(-1, memory)
    systems = rounds[0]["systems"]
    reference = next((s for s in (report.PLAIN, report.OFF) if s in systems), None)
    block["output_sources"] = {}
    for workload in workloads:
        requests = systems[reference]["workloads"].get(workload.kind) if reference else None
        if workload.kind in EDIT_KINDS and requests:
            block["output_sources"][workload.kind] = report.output_sources(list(workload.prompts),
                                                                           [r["text"] for r in requests])
    block["errors"] = [{"round": k + 1, "system": name, "error": s["error"]}
                       for k, r in enumerate(rounds) for name, s in r["systems"].items() if s.get("error")]
    block["rounds"] = rounds
    return block


def run_benchmark(config: SpecBenchConfig, make_factories: MakeFactories, models: dict[str, str], out: Path,
                  header: dict | None = None) -> dict:  # fmt: skip
    """Every round runs every model's systems (models interleaved, so machine drift hits them alike); then the
    spread, goals and mismatches per model; writes spec.json, spec.png and each round's JSON."""

    workloads = load_file(config.workloads_file) if config.workloads_file else build_workloads(
        config.num_structured, config.num_structured_warmup, config.kinds, config.num_edits, config.temperature)
    rounds: dict[str, list[dict]] = {label: [] for label in models}
    for k in range(config.rounds):
        for label, model_dir in models.items():
            round_out = out / f"round-{k + 1}" / label
            print(f"[bench spec] round {k + 1}/{config.rounds}, {label} model", file=sys.stderr, flush=True)
            result = run_round(config, make_factories(label, Path(model_dir), round_out), workloads, k)
            write_json(round_out / "spec.json", {"round": k + 1, "model": model_dir, **result})
            rounds[label].append(result)
    results = {"benchmark": "spec", **(header or {}), "config": asdict(config),
               "workloads": [asdict(w) for w in workloads],
               "models": {label: model_block(models[label], rounds[label], workloads) for label in models}}  # fmt: skip
    if "finetuned" not in models:
        results["finetuned"] = "not measured: no --finetuned-model given"
    return save(results, out, "spec", report.plot)


def print_results(results: dict) -> None:
    for label, block in results["models"].items():
        print(f"\n{label} model ({block['model']}), median (min-max) over {results['config']['rounds']} rounds:\n")
        print(report.markdown_table(block))
        peer = report.peer_table(block)
        if peer:
            print(f"\nfull segserve against SuffixDecoding on the same engine:\n\n{peer}")
        print_failures(block["errors"], block["mismatches"])
        if not block["outputs_compared"]:
            print("\ngreedy outputs: not compared (no plain-decoding system ran: add hf_plain or segserve_off)")
        elif not block["mismatches"]:
            print("\ngreedy outputs: every compared output equals plain decoding's")
        for kind, sources in block["output_sources"].items():
            shares = ", ".join(f"{name} {_percent(value)}" for name, value in sources["after_first"].items())
            print(f"{kind} greedy output lines after the first request: {shares}")
    if "finetuned" in results:
        print(f"\nfine-tuned model: {results['finetuned']}")


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def run_spec(args: argparse.Namespace) -> dict:
    """Run the whole benchmark; write spec.json + spec.png under --out, print the tables, return the results."""
    from segserve.bench.peers import resolve_dtype
    from segserve.bench.machine import machine_info
    from common.checkpoint import resolve_model

    try:
        config = config_from_args(args)
    except ValueError as exc:  # a bad flag is named, not a traceback
        raise SystemExit(f"segserve bench spec: {exc}") from None
    if config.finetuned_model and not Path(config.finetuned_model, "config.json").is_file():
        raise SystemExit(f"--finetuned-model {config.finetuned_model}: no config.json there (not a checkpoint)")
    config.dtype = resolve_dtype(config.dtype)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    models = {"base": str(resolve_model(config.model))}
    if config.finetuned_model:
        models["finetuned"] = config.finetuned_model
    header = {"command": shlex.join(sys.argv), "model": models["base"], "machine": machine_info()}
    results = run_benchmark(config, default_factories(config), models, Path(config.out), header)
    results["machine"]["loadavg_end"] = list(os.getloadavg())

    write_json(Path(config.out) / "spec.json", results)
    print_results(results)
    print(f"\n{results['outputs']['json']}, {results['outputs']['png']}")
    return results
