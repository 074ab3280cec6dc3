"""The numbers `segserve bench reflow` reports: reflow on vs off, the goal, the table, the plot.

Latency statistics come from `report.summarize` (TTFT and ITL in ms, over every
request of a mode, all rounds pooled); "added" is on minus off. Per-round
paired differences are kept too, to show how much of a difference is noise.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import median

from segserve.bench.harness import figure, fmt, goals_table

LATENCY_KEYS = ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")
GOAL_KEYS = ("ttft_ms_p99", "itl_ms_p99")


def compare(off: dict, on: dict, rounds: list[dict]) -> dict:
    """Added latency of reflow (on - off) per statistic: pooled, and the median/min/max of per-round deltas."""
    result = {}
    for key in LATENCY_KEYS:
        per_round = [r["on"]["summary"][key] - r["off"]["summary"][key] for r in rounds
                     if r["on"]["summary"][key] is not None and r["off"]["summary"][key] is not None]
        pooled = None if off[key] is None or on[key] is None else on[key] - off[key]
        result[key] = {"off": off[key], "on": on[key], "added": pooled,
                       "per_round_added": per_round,
                       "per_round_added_median": median(per_round) if per_round else None}
    return result


def evaluate_goals(added: dict, goal_ms: float) -> list[dict]:
    """The issue's goal, on p99 TTFT and p99 ITL: reflow adds at most `goal_ms` (None = not measured)."""
    goals = []
    for key in GOAL_KEYS:
        measured = added[key]["added"]
        goals.append({"name": f"{key.replace('_ms_', ' ')} added by reflow", "target": f"<= {goal_ms:g} ms",
                      "measured_ms": measured, "passed": None if measured is None else measured <= goal_ms})
    return goals


def markdown_table(results: dict) -> str:
    """Latency off / on / added, the consumer's drain rate, then the goals."""
    streams = results["config"]["concurrency"]
    lines = [f"| {streams} streams | reflow off | reflow on | added | added, per-round median |",
             "|---|---:|---:|---:|---:|"]
    for key, item in results["added"].items():
        name = key.replace("_ms_", " ").replace("ttft", "TTFT").replace("itl", "ITL") + " (ms)"
        lines.append(f"| {name} | {fmt(item['off'])} | {fmt(item['on'])} | {fmt(item['added'])} "
                     f"| {fmt(item['per_round_added_median'])} |")
    off, on = results["modes"]["off"]["summary"], results["modes"]["on"]["summary"]
    lines.append(f"| requests (errors) | {off['num_requests']} ({off['num_errors']}) "
                 f"| {on['num_requests']} ({on['num_errors']}) | | |")
    drain = results["consumer"]
    lines += ["", "| consumer drain | chunks | records | seconds | chunks/s | records/s |",
              "|---|---:|---:|---:|---:|---:|",
              f"| `segserve.reflow.consumer`, SQLite -> JSONL | {drain['num_chunks']} | {drain['num_records']} "
              f"| {fmt(drain['seconds'])} | {fmt(drain['chunks_per_s'], 0)} | {fmt(drain['records_per_s'], 0)} |"]
    lines += goals_table(results["goals"], lambda goal: f"{fmt(goal['measured_ms'])} ms")
    return "\n".join(lines)


def plot(path: Path, results: dict) -> Path:
    """Pooled p50/p99 off vs on, and p99 per round (the noise the pooled number sits in)."""
    with figure(path, 3, (16, 4.5)) as (fig, axes):
        keys = list(results["added"])
        xs = range(len(keys))
        for offset, mode, color in ((-0.2, "off", "C0"), (0.2, "on", "C1")):
            values = [results["added"][key][mode] for key in keys]
            axes[0].bar([x + offset for x in xs], [math.nan if v is None else v for v in values], width=0.4,
                        color=color, label=f"reflow {mode}")
        axes[0].set_xticks(list(xs), [key.replace("_ms_", " ") for key in keys])
        axes[0].set_title("latency, all rounds pooled (ms)")
        rounds = results["rounds"]
        for axis, key in ((axes[1], "ttft_ms_p99"), (axes[2], "itl_ms_p99")):
            for mode, color in (("off", "C0"), ("on", "C1")):
                ys = [r[mode]["summary"][key] for r in rounds]
                axis.plot(range(1, len(rounds) + 1), [math.nan if y is None else y for y in ys], marker="o",
                          color=color, label=f"reflow {mode}")
            axis.set_title(f"{key.replace('_ms_', ' ')} per round (ms)")
            axis.set_xlabel("round")
        for axis in axes:
            axis.grid(True, alpha=0.3)
            axis.legend(fontsize=8)
        drain = results["consumer"]
        fig.suptitle(f"segserve bench reflow: {results['config']['concurrency']} streams, token every "
                     f"{results['config']['token_interval_ms']:g} ms; consumer "
                     f"{fmt(drain['chunks_per_s'], 0)} chunks/s")
    return path
