"""`segserve bench structured`: speculative decoding under a grammar, against HF generate() with xgrammar.

One stream, greedy (temperature 0), EOS ends a request (the grammar ends with
it) and --max-tokens caps it. Workloads (structured_workloads.py): `schema`,
records extracted to JSON through response_format json_schema, each schema's
records in order; `tool_loop`, multi-turn chats whose every turn forces one call
(tool_choice "required" or a named function) and appends the call and the
tool's answer. Systems (structured_systems.py): HF `generate()` under xgrammar's
logits processor (`hf_xgrammar`) and, each on a fresh local stack, segserve
with speculation off (`segserve_off`), on without the grammar's forced-span
drafts (`segserve_no_grammar_drafts`), and full (`segserve_spec`). Every system
gets a warm-up request, then every workload.
The whole run repeats --rounds times (3 by default) with fresh systems; every
number is reported as its median, min, max and per-round values.
Outputs under --out: structured.json (every raw number, the command, the
machine, the config, per round), structured.png, round-<k>/structured.json and
the services' logs; the markdown table and goals are printed, greedy-output
mismatches among the segserve systems loudly.
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

from segserve.bench import structured_report as report
from segserve.bench.harness import check_runs, print_failures, save, write_json
from segserve.bench.spec_report import medians, spread
from segserve.bench.structured_workloads import (CHATS, EXTRACTIONS, KINDS, WARMUP, call_schemas, follow_up,
                                                 schema_requests, tool_body, tool_chats)  # fmt: skip

SYSTEMS = report.SYSTEMS
SystemFactory = Callable[[], AbstractContextManager]
MakeFactories = Callable[[Path, Path], dict[str, SystemFactory]]  # (model dir, round's out) -> factories
Chat = Callable[[dict, int], dict]


@dataclass
class StructuredBenchConfig:
    model: str | None = None
    """A catalog name (qwen2.5-coder-0.5b-instruct, gemma-3-270m) or a transformers model directory; None = the default
    model. Every system runs this one."""
    max_tokens: int = 256
    """The most tokens of one request; EOS (where the grammar ends) ends it before."""
    num_schemas: int = len(EXTRACTIONS)
    """JSON schemas of the schema workload, the first ones of structured_workloads.EXTRACTIONS."""
    num_records: int = 3
    """Records extracted per schema, sent one after another."""
    num_chats: int = 3
    """Chats of the tool_loop workload."""
    num_turns: int = 4
    """Turns per chat, each one forced call."""
    systems: tuple[str, ...] = SYSTEMS
    """Systems to run, a subset of hf_xgrammar, segserve_off, segserve_no_grammar_drafts, segserve_spec."""
    kinds: tuple[str, ...] = KINDS
    """Workloads to run, a subset of schema, tool_loop."""
    num_decode_steps: int | None = None
    """The scheduler's num_decode_steps for every segserve system; None = its default. A scheduler step where
    nothing is drafted may run several decode steps (always with speculation off), so its tokens per step is
    not tokens per forward; 1 makes every step one forward."""
    dtype: str = "auto"
    """Weights dtype for every system: auto = bfloat16 on cuda, float32 on cpu."""
    startup_timeout_s: float = 300.0
    """Longest a segserve stack may take to become ready."""
    request_timeout_s: float = 600.0
    """Longest one segserve request may take."""
    out: str = "bench-results/structured"
    """Directory for structured.json, structured.png, the rounds' own JSON and the services' logs."""
    rounds: int = 3
    """Whole runs, each with fresh systems; every number is reported with its spread over them."""

    def __post_init__(self) -> None:
        self.systems, self.kinds = tuple(self.systems), tuple(self.kinds)
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not 1 <= self.num_schemas <= len(EXTRACTIONS):
            raise ValueError(f"num_schemas must be in [1, {len(EXTRACTIONS)}]")
        if not 1 <= self.num_records <= min(len(e.records) for e in EXTRACTIONS):
            raise ValueError(f"num_records must be in [1, {min(len(e.records) for e in EXTRACTIONS)}]")
        if not 1 <= self.num_chats <= len(CHATS) or not 1 <= self.num_turns <= min(map(len, CHATS)):
            raise ValueError(f"num_chats must be in [1, {len(CHATS)}] and num_turns in [1, {min(map(len, CHATS))}]")
        check_runs(self, SYSTEMS, KINDS)
        if self.num_decode_steps is not None and self.num_decode_steps < 1:
            raise ValueError("num_decode_steps must be >= 1")


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_structured_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `segserve bench structured`, one per StructuredBenchConfig field."""
    defaults = StructuredBenchConfig()
    parser.add_argument("--model", default=defaults.model,
                        help="catalog name or transformers model directory (default model if unset)")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens,
                        help="cap per request; EOS ends one first (default: 256)")
    parser.add_argument("--num-schemas", type=int, default=defaults.num_schemas,
                        help=f"JSON schemas of the schema workload (default: all {len(EXTRACTIONS)})")
    parser.add_argument("--num-records", type=int, default=defaults.num_records,
                        help="records extracted per schema, in order (default: 3)")
    parser.add_argument("--num-chats", type=int, default=defaults.num_chats, help="chats of the tool loop (default: 3)")
    parser.add_argument("--num-turns", type=int, default=defaults.num_turns,
                        help="forced calls per chat (default: 4)")
    parser.add_argument("--systems", type=_names, default=defaults.systems,
                        help="comma-separated: " + ",".join(SYSTEMS))
    parser.add_argument("--kinds", type=_names, default=defaults.kinds, help="comma-separated: " + ",".join(KINDS))
    parser.add_argument("--num-decode-steps", type=int, default=defaults.num_decode_steps,
                        help="the scheduler's decode steps per step for every segserve system; 1 = a step is one "
                             "forward (default: the scheduler's)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=defaults.dtype)
    parser.add_argument("--startup-timeout-s", type=float, default=defaults.startup_timeout_s)
    parser.add_argument("--request-timeout-s", type=float, default=defaults.request_timeout_s)
    parser.add_argument("--out", default=defaults.out, help="output directory (default: bench-results/structured)")
    parser.add_argument("--rounds", type=int, default=defaults.rounds,
                        help="whole runs with fresh systems; numbers are reported with their spread (default: 3)")


def config_from_args(args: argparse.Namespace) -> StructuredBenchConfig:
    return StructuredBenchConfig(**{f.name: getattr(args, f.name) for f in fields(StructuredBenchConfig)})


def default_factories(config: StructuredBenchConfig) -> MakeFactories:
    """The real systems of one round, started only when their turn comes."""
    from segserve.bench.structured_systems import hf_xgrammar_system, segserve_chat_system

    scheduler = {"num_decode_steps": config.num_decode_steps} if config.num_decode_steps else {}
    served = dict(startup_timeout_s=config.startup_timeout_s, request_timeout_s=config.request_timeout_s,
                  scheduler=scheduler)

    def make(model_dir: Path, out: Path) -> dict[str, SystemFactory]:
        def segserve(system: str) -> SystemFactory:
            return lambda: segserve_chat_system(model_dir, config.dtype, system, out / f"logs-{system}", **served)

        return {report.HF: lambda: hf_xgrammar_system(model_dir, config.dtype),
                **{system: segserve(system) for system in report.SEGSERVE_SYSTEMS}}  # fmt: skip

    return make


def _judged(record: dict, kind: str, schemas: dict, group: str, index: int) -> dict:
    is_finished, is_valid = report.judge(record, kind, schemas)
    return {**record, "group": group, "index": index, "is_finished": is_finished, "is_valid": is_valid}


def run_schema(chat: Chat, config: StructuredBenchConfig) -> list[dict]:
    """Every schema's records, in order."""
    requests = schema_requests(config.num_schemas, config.num_records)
    return [_judged(chat(extraction.body(index), config.max_tokens), "schema", extraction.schema, extraction.name,
                    index) for extraction, index in requests]  # fmt: skip


def run_tool_loop(chat: Chat, config: StructuredBenchConfig) -> list[dict]:
    """Every chat turn by turn: the user's message, one forced call, then the call and the tool's answer go
    into the history of the next turn."""
    records = []
    for c, turns in enumerate(tool_chats(config.num_chats, config.num_turns)):
        messages: list[dict] = []
        for t, turn in enumerate(turns):
            messages.append({"role": "user", "content": turn.user})
            record = _judged(chat(tool_body(messages, turn), config.max_tokens), "tool_loop", call_schemas(turn),
                             f"chat-{c}", t)  # fmt: skip
            records.append(record)
            messages += follow_up(f"call_{c}_{t}", record["text"], record["calls"])
    return records


RUNNERS = {"schema": run_schema, "tool_loop": run_tool_loop}


def run_system(name: str, factory: SystemFactory, config: StructuredBenchConfig) -> dict:
    """A warm-up request, then every workload; a system that fails is reported, not raised."""
    runs: dict[str, list[dict]] = {}
    try:
        with factory() as chat:
            chat(WARMUP.body(0), min(16, config.max_tokens))  # compiles, allocates, starts the drafters: unmeasured
            for kind in config.kinds:
                runs[kind] = RUNNERS[kind](chat, config)
                summary = report.summarize(runs[kind])
                print(f"[bench structured] {name} {kind}: {summary['num_valid']}/{summary['num_requests']} valid, "
                      f"{summary['tokens_per_s'] or 0:.1f} tok/s", file=sys.stderr, flush=True)  # fmt: skip
    except Exception as exc:  # a benchmark reports a system that would not run; it does not crash
        return {"name": name, "error": f"{type(exc).__name__}: {exc}", "workloads": runs}
    return {"name": name, "workloads": runs}


def run_round(config: StructuredBenchConfig, factories: dict[str, SystemFactory]) -> dict:
    """Every configured system once on every workload: raw requests, summaries, ratios, mismatches."""
    systems = {name: run_system(name, factories[name], config) for name in config.systems}
    runs = {name: system["workloads"] for name, system in systems.items()}
    summaries = {name: {kind: report.summarize(records) for kind, records in per.items()}
                 for name, per in runs.items()}  # fmt: skip
    outputs = {name: {kind: [report.output_of(r) for r in records] for kind, records in per.items()}
               for name, per in runs.items()}  # fmt: skip
    return {"systems": systems, "summaries": summaries, "ratios": report.ratios(summaries),
            "mismatches": report.mismatches(outputs),
            "hf_mismatches": report.mismatches(outputs, systems=(report.HF,), reference=report.OFF),
            "loadavg_end": list(os.getloadavg())}  # fmt: skip


def run_benchmark(config: StructuredBenchConfig, make_factories: MakeFactories, model_dir: str, out: Path,
                  header: dict | None = None) -> dict:  # fmt: skip
    """Every round with fresh systems; then the spread of every number, the goals and every mismatch (with its
    round); writes structured.json, structured.png and each round's JSON."""

    rounds = []
    for k in range(config.rounds):
        print(f"[bench structured] round {k + 1}/{config.rounds}", file=sys.stderr, flush=True)
        round_out = out / f"round-{k + 1}"
        result = run_round(config, make_factories(Path(model_dir), round_out))
        write_json(round_out / "structured.json", {"round": k + 1, "model": model_dir, **result})
        rounds.append(result)
    results = {"benchmark": "structured", "model": model_dir, **(header or {}), "config": asdict(config),
               "workloads": {"schema": [{"schema": e.name, "record": i}
                                        for e, i in schema_requests(config.num_schemas, config.num_records)],
                             "tool_loop": [[asdict(turn) for turn in turns]
                                           for turns in tool_chats(config.num_chats, config.num_turns)]},
               "summaries": spread([r["summaries"] for r in rounds]),
               "ratios": spread([r["ratios"] for r in rounds])}  # fmt: skip
    results["summaries"], results["ratios"] = results["summaries"] or {}, results["ratios"] or {}
    for key in ("mismatches", "hf_mismatches"):
        results[key] = [{"round": k + 1, **m} for k, r in enumerate(rounds) for m in r[key]]
    results["goals"] = report.evaluate_goals(results["summaries"], medians(results["ratios"]), results["mismatches"])
    results["errors"] = [{"round": k + 1, "system": name, "error": s["error"]}
                         for k, r in enumerate(rounds) for name, s in r["systems"].items() if s.get("error")]
    results["rounds"] = rounds
    return save(results, out, "structured", report.plot)


def print_results(results: dict) -> None:
    print(f"\n{results['model']}, median (min-max) over {results['config']['rounds']} rounds:\n")
    print(report.markdown_table(results))
    print_failures(results["errors"], results["mismatches"])
    if not results["mismatches"]:
        print("\ngreedy outputs: every segserve system's equal segserve_off's (or the first segserve system's)")
    hf = results["hf_mismatches"]
    print(f"HF + xgrammar vs segserve_off (informational, float paths may differ): {len(hf)} differing outputs")


def run_structured(args: argparse.Namespace) -> dict:
    """Run the whole benchmark; write structured.json + structured.png under --out, print the table, return the
    results."""
    from common.checkpoint import resolve_model
    from segserve.bench.machine import machine_info
    from segserve.bench.peers import resolve_dtype

    try:
        config = config_from_args(args)
    except ValueError as exc:  # a bad flag is named, not a traceback
        raise SystemExit(f"segserve bench structured: {exc}") from None
    config.dtype = resolve_dtype(config.dtype)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model_dir = str(resolve_model(config.model))
    header = {"command": shlex.join(sys.argv), "machine": machine_info()}
    results = run_benchmark(config, default_factories(config), model_dir, Path(config.out), header)
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    write_json(Path(config.out) / "structured.json", results)
    print_results(results)
    print(f"\n{results['outputs']['json']}, {results['outputs']['png']}")
    return results
