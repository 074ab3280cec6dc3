"""Numbers, goals, table and plot of `segserve bench spec`; pure except the two writers.

In: per system, per workload kind, a list of request dicts
`{"num_tokens", "wall_s", "text", "spec": {counter deltas} | None}` (see spec.py).
Out: per-workload summaries (steady state = requests after the workload's
warm-up), speedups, the issue's goals with pass/FAIL, greedy-equality
mismatches, a markdown table and a PNG.

Tokens/s of a workload = generated tokens / summed request wall time (prompt
processing included, the same for every system). Accepted tokens per step =
generated tokens / scheduler steps (prefill included); accepted drafts per verify
= accepted draft tokens / steps that verified a tree.
"""

from __future__ import annotations

import math
from pathlib import Path

from segserve.bench.spec_workloads import KINDS

PLAIN, LOOKUP, OFF, SPEC = "hf_plain", "hf_prompt_lookup", "segserve_off", "segserve_spec"
SYSTEM_LABELS = {PLAIN: "HF generate()", LOOKUP: "HF prompt lookup (10)",
                 OFF: "segserve, spec off", SPEC: "segserve, spec on"}  # fmt: skip
SPEC_COUNTERS = ("num_steps", "num_verified", "num_draft_tokens", "num_accepted_tokens")

# kind -> (minimum x plain, minimum x prompt lookup); "never slower than prompt lookup" = 1.0 at least.
GOALS = {
    "code_edit": (2.5, 1.5),
    "grounded": (3.3, 1.2),
    "structured": (3.0, 1.2),
    "open_ended": (0.97, 1.0),
}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def summarize(requests: list[dict], num_warmup: int) -> dict:
    """Steady-state (after `num_warmup`) and all-request rates, plus speculation counters if present."""
    steady = requests[num_warmup:]
    summary = {"num_requests": len(requests), "num_warmup": num_warmup,
               "tokens_per_s": _rate(steady), "tokens_per_s_all": _rate(requests)}  # fmt: skip
    if any(r.get("spec") for r in steady):
        totals = {name: sum((r.get("spec") or {}).get(name, 0) for r in steady) for name in SPEC_COUNTERS}
        num_tokens = sum(r["num_tokens"] for r in steady)
        summary["spec"] = totals
        summary["tokens_per_step"] = _ratio(num_tokens, totals["num_steps"])
        summary["accepted_per_verify"] = _ratio(totals["num_accepted_tokens"], totals["num_verified"])
        summary["draft_acceptance"] = _ratio(totals["num_accepted_tokens"], totals["num_draft_tokens"])
    return summary


def _rate(requests: list[dict]) -> float | None:
    wall_s = sum(r["wall_s"] for r in requests)
    return _ratio(sum(r["num_tokens"] for r in requests), wall_s)


def progression(requests: list[dict]) -> list[dict]:
    """Per request, in order: tokens/s and tokens per step (the corpus learning shows here)."""
    rows = []
    for index, request in enumerate(requests):
        steps = (request.get("spec") or {}).get("num_steps")
        rows.append({"index": index, "tokens_per_s": _rate([request]),
                     "tokens_per_step": _ratio(request["num_tokens"], steps)})  # fmt: skip
    return rows


def speedups(summaries: dict[str, dict[str, dict]]) -> dict[str, dict[str, float | None]]:
    """summaries[system][kind] -> per kind: each system's steady tokens/s over plain and over prompt lookup."""
    measured = {kind for per_kind in summaries.values() for kind in per_kind}
    table = {}
    for kind in sorted(measured, key=lambda k: (KINDS.index(k) if k in KINDS else len(KINDS), k)):
        rate = {system: (per_kind.get(kind) or {}).get("tokens_per_s") for system, per_kind in summaries.items()}
        row = {}
        for system in (SPEC, OFF, LOOKUP):
            row[f"{system}_vs_plain"] = _ratio(rate.get(system), rate.get(PLAIN))
        row[f"{SPEC}_vs_lookup"] = _ratio(rate.get(SPEC), rate.get(LOOKUP))
        table[kind] = row
    return table


def evaluate_goals(speedup_table: dict[str, dict]) -> list[dict]:
    """The issue's goals for every measured kind; passed is None when a number is missing."""
    goals = []
    for kind, (vs_plain, vs_lookup) in GOALS.items():
        if kind not in speedup_table:
            continue
        row = speedup_table[kind]
        goals.append(_check(f"{kind}: spec on vs plain", f">= {vs_plain}x", row[f"{SPEC}_vs_plain"], vs_plain))
        goals.append(_check(f"{kind}: spec on vs prompt lookup", f">= {vs_lookup}x",
                            row[f"{SPEC}_vs_lookup"], vs_lookup))  # fmt: skip
    return goals


def _check(name: str, target: str, measured: float | None, threshold: float) -> dict:
    passed = None if measured is None else measured >= threshold
    return {"name": name, "target": target, "measured": measured, "passed": passed}


def mismatches(texts: dict[str, dict[str, list[str]]], reference: str = PLAIN) -> list[dict]:
    """texts[system][kind] = outputs in order; every segserve output that differs from `reference`'s."""
    found = []
    for system in (OFF, SPEC, LOOKUP):
        for kind, outputs in texts.get(system, {}).items():
            expected = texts.get(reference, {}).get(kind, [])
            for index, (got, want) in enumerate(zip(outputs, expected)):
                if got != want:
                    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                    found.append({"system": system, "kind": kind, "index": index, "first_diff_char": at,
                                  "got": got, "expected": want})  # fmt: skip
    return found


def _fmt(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def markdown_table(results: dict) -> str:
    """One row per workload: tokens/s per system, speedups and accepted tokens per step; then the goals."""
    summaries, table = results["summaries"], results["speedups"]
    systems = [s for s in (PLAIN, LOOKUP, OFF, SPEC) if s in summaries]
    header = ["workload", *(f"{SYSTEM_LABELS[s]} tok/s" for s in systems),
              "spec vs plain", "spec vs PL", "off vs plain", "tokens/step (spec)", "accepted/verify"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for kind, row in table.items():
        spec = summaries.get(SPEC, {}).get(kind, {})
        cells = [kind, *(_fmt(summaries[s].get(kind, {}).get("tokens_per_s"), 1) for s in systems),
                 _fmt(row[f"{SPEC}_vs_plain"], suffix="x"), _fmt(row[f"{SPEC}_vs_lookup"], suffix="x"),
                 _fmt(row[f"{OFF}_vs_plain"], suffix="x"), _fmt(spec.get("tokens_per_step")),
                 _fmt(spec.get("accepted_per_verify"))]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| goal | target | measured | result |", "|---|---|---:|---|"]
    for goal in results["goals"]:
        verdict = {True: "pass", False: "FAIL", None: "not measured"}[goal["passed"]]
        lines.append(f"| {goal['name']} | {goal['target']} | {_fmt(goal['measured'], suffix='x')} | {verdict} |")
    return "\n".join(lines)


def plot(path: Path, results: dict) -> Path:
    """Left: steady tokens/s per workload and system (bars). Right: spec-on progression over requests."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = results["summaries"]
    kinds = list(results["speedups"])
    systems = [s for s in (PLAIN, LOOKUP, OFF, SPEC) if s in summaries]
    fig, (bars, lines) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(1, len(systems))
    for offset, system in enumerate(systems):
        ys = [summaries[system].get(kind, {}).get("tokens_per_s") for kind in kinds]
        xs = [i + offset * width for i in range(len(kinds))]
        bars.bar(xs, [math.nan if y is None else y for y in ys], width, label=SYSTEM_LABELS[system])
    bars.set_xticks([i + 0.4 - width / 2 for i in range(len(kinds))], kinds)
    bars.set_ylabel("tokens/s (single stream, greedy)")
    bars.legend(fontsize=8)
    for system in (SPEC, OFF):
        rows = results.get("progression", {}).get(system, [])
        if rows:
            ys = [math.nan if r["tokens_per_s"] is None else r["tokens_per_s"] for r in rows]
            lines.plot([r["index"] for r in rows], ys, marker="o", label=SYSTEM_LABELS[system])
            lines.set_xticks([r["index"] for r in rows])
    lines.set_title("structured: tokens/s per request, in order")
    lines.set_xlabel("request")
    lines.grid(True, alpha=0.3)
    if lines.get_legend_handles_labels()[0]:
        lines.legend(fontsize=8)
    fig.suptitle(f"segserve bench spec: {results.get('model', '')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def speedup_spread(rounds: list[dict]) -> dict[str, dict[str, dict]]:
    """Per workload kind and system: its speedup over plain generate() in every round, median, min and max."""
    table: dict[str, dict[str, dict]] = {}
    for results in rounds:
        for kind, row in results["speedups"].items():
            for system in (SPEC, OFF, LOOKUP):
                value = row.get(f"{system}_vs_plain")
                if value is not None:
                    table.setdefault(kind, {}).setdefault(system, {"values": []})["values"].append(value)
    for per_system in table.values():
        for entry in per_system.values():
            values = sorted(entry["values"])
            middle = len(values) // 2
            entry["median"] = values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
            entry["min"], entry["max"] = values[0], values[-1]
    return table


def plot_speedup_spread(path: Path, spread: dict) -> Path:
    """Bars: median speedup over plain generate() per workload and system; whiskers: min to max over the
    rounds; dots: each round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = spread["speedups"]
    kinds = list(table)
    systems = [s for s in (LOOKUP, OFF, SPEC) if any(s in table[k] for k in kinds)]
    fig, axes = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(systems))
    for offset, system in enumerate(systems):
        for i, kind in enumerate(kinds):
            entry = table[kind].get(system)
            if entry is None:
                continue
            x = i + offset * width
            axes.bar(x, entry["median"], width, color=f"C{offset}", label=SYSTEM_LABELS[system] if i == 0 else None)
            whiskers = [[entry["median"] - entry["min"]], [entry["max"] - entry["median"]]]
            axes.errorbar(x, entry["median"], yerr=whiskers, color="black", capsize=4)
            axes.scatter([x] * len(entry["values"]), entry["values"], color="black", s=10, zorder=3)
    axes.axhline(1.0, color="gray", linewidth=1, linestyle="--")
    axes.set_xticks([i + (len(systems) - 1) * width / 2 for i in range(len(kinds))], kinds)
    axes.set_ylabel("speedup over HF generate() (x)")
    num_rounds = max((len(e["values"]) for per in table.values() for e in per.values()), default=0)
    axes.set_title(f"single stream, greedy: median, min-max and each of {num_rounds} rounds")
    axes.legend(fontsize=8)
    axes.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"segserve bench spec: {Path(spread.get('model', '')).name}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
