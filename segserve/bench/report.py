"""Turn raw request timings into the numbers the throughput benchmark reports.

Pure functions (percentiles, per-level summaries, goal checks, the markdown
table) plus two writers (JSON, PNG). Latencies are reported in milliseconds,
throughput in generated tokens per second.

- TTFT: request sent -> first SSE event carrying text.
- ITL: gap between consecutive text events of one request (one event may carry
  several tokens, e.g. under speculative decoding; that is what a client sees).
- Aggregate tokens/s: completion tokens of every successful request / the
  level's wall time (first request sent -> last request finished).
- Decode tokens/s of one request: (tokens - 1) / (last event - first event).
- Time per output token (TPOT) of one request: the inverse, in ms; the mean
  over a level's requests is what the router overhead compares.
- Router overhead per token: segserve's TPOT through the router (HTTP/SSE, and
  its public gRPC API's GenerateStream) minus its TPOT calling the scheduler's
  gRPC directly in the same run; the TTFT difference is reported beside it (the
  per-request part of the overhead). With --overhead-rounds, the two are also
  run back to back per level, round after round, and each level's overhead is
  given per round with its median and spread.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import median

from segserve.bench.harness import figure, fmt, goals_table
from segserve.bench.loadgen import RequestRecord


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); None if empty."""
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def inter_token_gaps(event_times: list[float]) -> list[float]:
    """Gaps between consecutive events, in seconds."""
    return [later - earlier for earlier, later in zip(event_times, event_times[1:])]


def decode_tokens_per_s(record: RequestRecord) -> float | None:
    """Decode rate of one request after its first token; None when it cannot be told."""
    if len(record.event_times) < 2 or record.num_tokens < 2:
        return None
    span = record.event_times[-1] - record.event_times[0]
    return (record.num_tokens - 1) / span if span > 0 else None


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def summarize(records: list[RequestRecord], wall_s: float | None = None) -> dict:
    """Aggregate one level's requests; `wall_s` defaults to first start -> last finish."""
    ok = [r for r in records if r.error is None and r.event_times]
    if wall_s is None and records:
        wall_s = max(r.finished_at for r in records) - min(r.started_at for r in records)
    ttfts = [r.event_times[0] - r.started_at for r in ok]
    gaps = [gap for r in ok for gap in inter_token_gaps(r.event_times)]
    decode_rates = [rate for r in ok if (rate := decode_tokens_per_s(r)) is not None]
    tpots = [1000.0 / rate for rate in decode_rates]
    total_tokens = sum(r.num_tokens for r in ok)
    return {
        "num_requests": len(records),
        "num_errors": len(records) - len(ok),
        "errors": sorted({r.error or "no tokens" for r in records if r not in ok})[:5],
        "total_tokens": total_tokens,
        "mean_tokens_per_request": total_tokens / len(ok) if ok else None,
        "wall_s": wall_s,
        "aggregate_tokens_per_s": total_tokens / wall_s if wall_s and total_tokens else None,
        "ttft_ms_p50": _ms(percentile(ttfts, 50)),
        "ttft_ms_p99": _ms(percentile(ttfts, 99)),
        "itl_ms_p50": _ms(percentile(gaps, 50)),
        "itl_ms_p99": _ms(percentile(gaps, 99)),
        "decode_tokens_per_s_median": median(decode_rates) if decode_rates else None,
        "tpot_ms_mean": sum(tpots) / len(tpots) if tpots else None,
    }


def level_result(concurrency: int, records: list, started_at: float, finished_at: float) -> dict:
    """A level for the JSON: its summary and every raw record, times relative to the level's start."""
    raw = []
    for record in records:
        item = record.to_dict()
        item["started_at"] -= started_at
        item["finished_at"] -= started_at
        item["event_times"] = [t - started_at for t in record.event_times]
        raw.append(item)
    summary = summarize(records, finished_at - started_at)
    return {"concurrency": concurrency, "summary": summary, "records": raw}


def _level(system: dict, concurrency: int) -> dict | None:
    for level in system.get("levels", []):
        if level["concurrency"] == concurrency:
            return level["summary"]
    return None


def evaluate_goals(baseline: dict | None, ours: dict | None, peer: dict | None, low: int, high: int) -> list[dict]:
    """The issue's three goals, each with its measured value and pass/fail (None = not measurable, as the scaling
    goal is when only one concurrency level ran)."""
    ours_low = _level(ours, low) if ours else None
    ours_high = _level(ours, high) if ours else None
    peer_high = _level(peer, high) if peer else None
    goals = []

    measured = ratio(ours_low and ours_low["decode_tokens_per_s_median"], baseline and baseline["decode_tokens_per_s"])
    goals.append(check(f"{low}-stream decode vs plain generate()", ">= 0.95x", measured, 0.95))
    scaled = low != high  # one concurrency level has nothing to scale against
    measured = ratio(ours_high and ours_high["aggregate_tokens_per_s"],
                     ours_low and ours_low["aggregate_tokens_per_s"]) if scaled else None
    goals.append(check(f"{high}-stream aggregate vs our {low}-stream", ">= 3x", measured, 3.0))
    measured = ratio(ours_high and ours_high["aggregate_tokens_per_s"],
                     peer_high and peer_high["aggregate_tokens_per_s"])
    goals.append(check(f"{high}-stream aggregate vs {peer['name'] if peer else 'peer'}", "> 1x", measured, 1.0,
                       strict=True))
    return goals


OVERHEAD_KEYS = ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "tpot_ms_mean")


def router_overhead(http: dict, grpc: dict) -> list[dict]:
    """Per concurrency level both systems ran: their latencies side by side, and the router's overhead."""
    levels = []
    for level in http.get("levels", []):
        direct = _level(grpc, level["concurrency"])
        if direct is None:
            continue
        via_router = {key: level["summary"][key] for key in OVERHEAD_KEYS}
        direct = {key: direct[key] for key in OVERHEAD_KEYS}
        levels.append({
            "concurrency": level["concurrency"], "router": via_router, "grpc": direct,
            "overhead_ms_per_token": _difference(via_router["tpot_ms_mean"], direct["tpot_ms_mean"]),
            "ttft_ms_p50_difference": _difference(via_router["ttft_ms_p50"], direct["ttft_ms_p50"]),
        })  # fmt: skip
    return levels


def overhead_rounds(rounds: list[dict]) -> list[dict]:
    """Per level of the alternated rounds (throughput.overhead_rounds): the router's overhead per token in each
    round (router TPOT minus direct TPOT, measured back to back), and their median, min and max."""
    by_level: dict[int, list[float]] = {}
    client_cpu: dict[int, dict[str, list[float]]] = {}
    for item in rounds:
        overhead = _difference(item["router_tpot_ms"], item["grpc_tpot_ms"])
        if overhead is not None:
            by_level.setdefault(item["concurrency"], []).append(overhead)
        for side in ("router", "grpc"):
            cpu = item.get(f"{side}_client_cpu_ms_per_token")
            if cpu is not None:
                client_cpu.setdefault(item["concurrency"], {}).setdefault(side, []).append(cpu)
    return [{"concurrency": concurrency, "overhead_ms_per_token": values, "median": median(values),
             "min": min(values), "max": max(values),
             "client_cpu_ms_per_token": {side: median(cpu) for side, cpu in client_cpu.get(concurrency, {}).items()}}
            for concurrency, values in sorted(by_level.items())]


def _difference(minuend: float | None, subtrahend: float | None) -> float | None:
    return None if minuend is None or subtrahend is None else minuend - subtrahend


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator; None when either is missing or zero."""
    return numerator / denominator if numerator and denominator else None


def check(name: str, target: str, measured: float | None, threshold: float, strict: bool = False) -> dict:
    """A goal row: measured against threshold (> when strict, else >=); passed is None when nothing was measured."""
    if measured is None:
        passed = None
    else:
        passed = measured > threshold if strict else measured >= threshold
    return {"name": name, "target": target, "measured": measured, "passed": passed}


def markdown_table(results: dict) -> str:
    """The README table: one row per system and concurrency, then the baseline and the goals."""
    lines = [
        "| system | streams | agg tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for system in results.get("systems", {}).values():
        for level in system["levels"]:
            s = level["summary"]
            lines.append(
                f"| {system['name']} | {level['concurrency']} | {fmt(s['aggregate_tokens_per_s'], 1)} "
                f"| {fmt(s['ttft_ms_p50'], 0)} | {fmt(s['ttft_ms_p99'], 0)} | {fmt(s['itl_ms_p50'], 0)} "
                f"| {fmt(s['itl_ms_p99'], 0)} | {s['num_errors']}/{s['num_requests']} |"
            )
    baseline = results.get("baseline")
    if baseline:
        lines.append(
            f"| plain generate() | 1 | {fmt(baseline['tokens_per_s'], 1)} | {fmt(baseline['ttft_ms'], 0)} | | "
            f"{fmt(baseline['itl_ms_p50'], 0)} | {fmt(baseline['itl_ms_p99'], 0)} | |"
        )
    lines += overhead_table(results.get("router_overhead") or [])
    lines += overhead_table(results.get("grpc_api_overhead") or [], via="gRPC API")
    rounds = results.get("router_overhead_rounds") or []
    if rounds:
        lines += ["", "The level rows above ran through the router first and straight to the scheduler after it, "
                  "so what the speculation gate learned in between (with speculation on) favours the direct ones; "
                  "the alternated rounds below compare the two back to back."]
        lines += ["", "| streams | router overhead ms/token, alternated rounds: median [min-max] | each round "
                  "| load generator CPU ms/token, HTTP / gRPC (medians) |", "|---:|---:|---|---:|"]
        for level in rounds:
            cpu = level.get("client_cpu_ms_per_token", {})
            lines.append(f"| {level['concurrency']} | {fmt(level['median'], 2)} [{fmt(level['min'], 2)}-"
                         f"{fmt(level['max'], 2)}] | {', '.join(fmt(v, 2) for v in level['overhead_ms_per_token'])} "
                         f"| {fmt(cpu.get('router'), 3)} / {fmt(cpu.get('grpc'), 3)} |")
    lines += decode_rounds_table(results.get("decode_rounds"))
    lines += goals_table(results.get("goals", []),
                         lambda goal: "n/a" if goal["measured"] is None else f"{goal['measured']:.2f}x")
    return "\n".join(lines)


def decode_rounds_table(summary: dict | None) -> list[str]:
    """Markdown lines for the decode rounds' summary (segserve/bench/decode_rounds.py); [] when not run."""
    if summary is None:
        return []
    each = ", ".join(f"{value:.2f}" for value in summary["ratios"])
    return ["", "| 1-stream decode rate vs plain generate(), alternated rounds: median [min-max] | each round |",
            "|---:|---|", f"| {summary['median']:.2f}x [{summary['min']:.2f}-{summary['max']:.2f}] | {each} |"]


def overhead_table(levels: list[dict], via: str = "router") -> list[str]:
    """Markdown lines: through the router (`via`: "router" for HTTP/SSE, "gRPC API") vs the scheduler's gRPC
    called directly, "<via> / gRPC" per cell; [] if not measured."""
    if not levels:
        return []
    header = " | ".join(f"{name} {via} / gRPC" for name in ("TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
                                                           "ITL p99 ms", "ms/token"))  # fmt: skip
    overhead = "router overhead ms/token" if via == "router" else f"router overhead ({via}) ms/token"
    lines = ["", f"| streams | {header} | {overhead} | TTFT p50 diff ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for level in levels:
        pairs = " | ".join(f"{fmt(level['router'][key], 1 if key == 'tpot_ms_mean' else 0)} / "
                           f"{fmt(level['grpc'][key], 1 if key == 'tpot_ms_mean' else 0)}"
                           for key in OVERHEAD_KEYS)  # fmt: skip
        lines.append(f"| {level['concurrency']} | {pairs} | {fmt(level['overhead_ms_per_token'], 2)} "
                     f"| {fmt(level['ttft_ms_p50_difference'], 1)} |")  # fmt: skip
    return lines


def plot(path: Path, results: dict) -> Path:
    """Aggregate tokens/s, TTFT, ITL and time per token against concurrency, one line per system (Agg backend)."""
    with figure(path, 4, (20, 4.5)) as (fig, axes):
        panels = [
            (axes[0], "aggregate tokens/s", [("aggregate_tokens_per_s", "")]),
            (axes[1], "TTFT (ms)", [("ttft_ms_p50", " p50"), ("ttft_ms_p99", " p99")]),
            (axes[2], "inter-token latency (ms)", [("itl_ms_p50", " p50"), ("itl_ms_p99", " p99")]),
            (axes[3], "time per output token, mean (ms)", [("tpot_ms_mean", "")]),
        ]
        systems = [system for system in results.get("systems", {}).values() if system.get("levels")]
        ticks = sorted({level["concurrency"] for system in systems for level in system["levels"]})
        for axis, title, keys in panels:
            for color, system in enumerate(systems):
                xs = [level["concurrency"] for level in system["levels"]]
                for key, suffix in keys:
                    ys = [level["summary"][key] for level in system["levels"]]
                    ys = [math.nan if y is None else y for y in ys]
                    axis.plot(xs, ys, marker="o", color=f"C{color}", linestyle="--" if suffix == " p99" else "-",
                              label=system["name"] + suffix)  # fmt: skip
            axis.set_title(title)
            axis.set_xlabel("concurrent streams")
            axis.set_xscale("log", base=2)
            axis.set_xticks(ticks, [str(t) for t in ticks])
            axis.grid(True, alpha=0.3)
        baseline = results.get("baseline")
        if baseline and baseline.get("tokens_per_s"):
            axes[0].axhline(baseline["tokens_per_s"], color="grey", linestyle=":", label="plain generate()")
        for axis in axes:
            axis.legend(fontsize=8)
        fig.suptitle(f"segserve bench throughput: {results.get('model', '')}")
    return path
