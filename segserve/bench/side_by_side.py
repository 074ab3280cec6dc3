"""segserve and a peer server measured in one run, rounds alternated: `segserve bench throughput --peer vllm`.

Both servers are up at once (each idle while the other is measured), warmed up alike, and then every round runs
every level against both, back to back, the order flipping each time, so that the machine's drift falls on both
sides of each ratio alike. Out: each system's levels (the median round's, for the table and the plot), every round's
summaries, and per level the ratios segserve / peer of aggregate tokens/s and of the per-request decode rate, and
peer / segserve of time to first token (above 1: segserve answers first), each with its median and spread.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

from segserve.bench.report import check

RATIOS = {
    # name: (summary key, is segserve's value the numerator)
    "aggregate_tokens_per_s": ("aggregate_tokens_per_s", True),
    "decode_tokens_per_s": ("decode_tokens_per_s_median", True),
    "ttft": ("ttft_ms_p50", False),
}

Level = Callable[[int], dict]
"""One level of `concurrency` streams against one server: its level_result (summary and records)."""


def alternated_rounds(levels: dict[str, Level], concurrency: tuple[int, ...], rounds: int) -> dict[str, list[dict]]:
    """{system: [level result with its "round"]}: `rounds` rounds of every level against every system, the
    systems' order reversed from one level to the next."""
    names = list(levels)
    ran: dict[str, list[dict]] = {name: [] for name in names}
    turn = 0
    for number in range(rounds):
        for streams in concurrency:
            order = names if turn % 2 == 0 else names[::-1]
            turn += 1
            for name in order:
                level = levels[name](streams)
                ran[name].append({**level, "round": number})
                summary = level["summary"]
                print(f"[bench] round {number + 1}/{rounds} {name} x{streams}: "
                      f"{summary['aggregate_tokens_per_s'] or 0:.1f} tok/s, TTFT "
                      f"{summary['ttft_ms_p50'] or 0:.0f} ms, {summary['num_errors']}/{summary['num_requests']} "
                      "errors", file=sys.stderr, flush=True)
    return ran


def median_levels(rounds: list[dict]) -> list[dict]:
    """Per concurrency, the round whose aggregate tokens/s is the median one (a measured level, not a blend)."""
    levels = []
    for streams in sorted({level["concurrency"] for level in rounds}):
        runs = sorted((level for level in rounds if level["concurrency"] == streams),
                      key=lambda level: level["summary"]["aggregate_tokens_per_s"] or 0.0)
        levels.append(runs[(len(runs) - 1) // 2])
    return levels


def ratios(ours: list[dict], peer: list[dict]) -> list[dict]:
    """Per concurrency and ratio: each round's value, their median, min and max (None where a side measured
    nothing)."""
    out = []
    for streams in sorted({level["concurrency"] for level in ours}):
        by_round = {level["round"]: level["summary"] for level in peer if level["concurrency"] == streams}
        row: dict = {"concurrency": streams}
        for name, (key, is_ours_over_peer) in RATIOS.items():
            values = []
            for level in ours:
                theirs = by_round.get(level["round"])
                if level["concurrency"] != streams or theirs is None:
                    continue
                a, b = level["summary"][key], theirs[key]
                if a and b:
                    values.append(a / b if is_ours_over_peer else b / a)
            row[name] = spread(values)
        out.append(row)
    return out


def spread(values: list[float]) -> dict:
    if not values:
        return {"rounds": [], "median": None, "min": None, "max": None}
    return {"rounds": values, "median": statistics.median(values), "min": min(values), "max": max(values)}


def markdown(rows: list[dict], peer_name: str) -> list[str]:
    lines = ["", f"segserve / {peer_name}, alternated rounds: median [min-max] (TTFT: {peer_name}'s over segserve's, "
             "above 1 = segserve answers first)", "",
             "| streams | aggregate tok/s | per-request decode tok/s | TTFT p50 |", "|---:|---:|---:|---:|"]
    for row in rows:
        cells = [_cell(row[name]) for name in RATIOS]
        lines.append(f"| {row['concurrency']} | " + " | ".join(cells) + " |")
    return lines


def _cell(value: dict) -> str:
    if value["median"] is None:
        return "n/a"
    return f"{value['median']:.2f}x [{value['min']:.2f}-{value['max']:.2f}]"


def goals(rows: list[dict], peer_name: str, minimums: dict[int, float]) -> list[dict]:
    """Aggregate tokens/s ratio at least `minimums[concurrency]` (the median round), and TTFT no worse than the
    peer's at every level measured."""
    out = []
    for row in rows:
        minimum = minimums.get(row["concurrency"])
        if minimum is not None:
            out.append(check(f"{row['concurrency']}-stream aggregate vs {peer_name}", f">= {minimum:g}x",
                             row["aggregate_tokens_per_s"]["median"], minimum))
        out.append(check(f"{row['concurrency']}-stream TTFT p50, {peer_name}'s over ours", ">= 1x",
                         row["ttft"]["median"], 1.0))
    return out
