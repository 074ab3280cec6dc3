"""Numbers, table and plot of `segserve bench engine` (segserve/bench/engine.py)."""

from __future__ import annotations

import statistics
from functools import partial
from pathlib import Path

from segserve.bench.harness import figure, fmt

PARTS = ("schedule", "draft", "wire", "metadata", "forward", "sample", "output")
"""The parts of one engine step, in step order (draft runs between schedule and metadata)."""


def _stat(values: list[float]) -> dict:
    """Median over rounds and the spread (min, max), every value kept."""
    return {"median_ms": statistics.median(values), "min_ms": min(values), "max_ms": max(values),
            "rounds_ms": values}


def summarize_batch(batch_size: int, rounds: list[dict[str, float]]) -> dict:
    """rounds: per timed round, the mean ms of every part, "total" and "tokens_per_step" over its timed steps, and
    "untimed": the mean ms of its other steps, whose parts were not timed."""
    tokens_per_step = statistics.median(r["tokens_per_step"] for r in rounds)
    total, untimed = _stat([r["total"] for r in rounds]), _stat([r["untimed"] for r in rounds])
    return {
        "batch_size": batch_size,
        "parts": {part: _stat([r[part] for r in rounds]) for part in PARTS},
        "total": total,
        "excluding_forward": _stat([r["total"] - r["forward"] for r in rounds]),
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": 1000 * tokens_per_step / total["median_ms"] if total["median_ms"] > 0 else None,
        "untimed": untimed,
        "untimed_tokens_per_s": 1000 * tokens_per_step / untimed["median_ms"] if untimed["median_ms"] > 0 else None,
    }


def summarize_grammar(batch_size: int, plain: list[dict[str, float]], constrained: list[dict[str, float]]) -> dict:
    """With --json-schema: the constrained set's summary, and grammar_ms, the constrained round's step minus the
    plain round's run beside it, per round pair (median, spread; every part's difference besides, under "parts")."""
    def differences(key: str) -> list[float]:
        return [c[key] - p[key] for p, c in zip(plain, constrained)]

    grammar = _stat(differences("total"))
    grammar["parts"] = {part: statistics.median(differences(part)) for part in PARTS}
    grammar["untimed_ms"] = statistics.median(differences("untimed"))
    return {"constrained": summarize_batch(batch_size, constrained), "grammar_ms": grammar}


def summarize_hf(batch_size: int, ms_per_step: list[float]) -> dict:
    total = _stat(ms_per_step)
    return {**total, "tokens_per_s": 1000 * batch_size / total["median_ms"] if total["median_ms"] > 0 else None}


_fmt = partial(fmt, missing="-")


def markdown_table(results: dict) -> str:
    """One row per batch size: ms/step (median, spread), every part, excluding forward, tok/s, the same for the
    untimed steps (the others of a round, their parts not timed), HF compiled; with --json-schema, the constrained
    step, its tokens and grammar_ms (median, spread) at the end."""
    has_hf = any(b.get("hf_compiled") for b in results["batches"])
    has_grammar = any("grammar_ms" in b for b in results["batches"])
    head = ["batch", "ms/step (min-max)", *PARTS, "excl. forward", "tok/step", "tok/s", "untimed ms/step (min-max)",
            "untimed tok/s"]
    if has_hf:
        head += ["HF compiled ms/step", "HF tok/s"]
    if has_grammar:
        head += ["constrained ms/step", "constrained tok/step", "grammar ms (min-max)"]
    lines = [f"engine step on {results.get('model')} ({results.get('device')}, {results.get('dtype')}); "
             f"ms, median of {results['config']['repeats']} rounds of {results['config']['steps']} steps"
             + (f"; a step is one request of up to {num_steps} decode steps"
                if (num_steps := results["config"].get("num_decode_steps", 1)) > 1 else ""),
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in results["batches"]:
        total = b["total"]
        cells = [str(b["batch_size"]), f"{_fmt(total['median_ms'])} ({_fmt(total['min_ms'])}-{_fmt(total['max_ms'])})"]
        cells += [_fmt(b["parts"][part]["median_ms"]) for part in PARTS]
        cells += [_fmt(b["excluding_forward"]["median_ms"]), _fmt(b["tokens_per_step"], 1),
                  _fmt(b["tokens_per_s"], 0)]
        untimed = b["untimed"]
        cells += [f"{_fmt(untimed['median_ms'])} ({_fmt(untimed['min_ms'])}-{_fmt(untimed['max_ms'])})",
                  _fmt(b["untimed_tokens_per_s"], 0)]
        if has_hf:
            hf = b.get("hf_compiled") or {}
            cells += ["error" if "error" in hf else _fmt(hf.get("median_ms")), _fmt(hf.get("tokens_per_s"), 0)]
        if has_grammar:
            grammar = b.get("grammar_ms")
            cells += ["-", "-", "-"] if grammar is None else [
                _fmt(b["constrained"]["total"]["median_ms"]), _fmt(b["constrained"]["tokens_per_step"], 1),
                f"{_fmt(grammar['median_ms'])} ({_fmt(grammar['min_ms'])}-{_fmt(grammar['max_ms'])})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: Path, results: dict) -> Path:
    """Stacked bars of the median parts per batch size, and each part's share of the step (Agg backend)."""
    batches = results["batches"]
    labels = [str(b["batch_size"]) for b in batches]
    positions = list(range(len(batches)))  # numeric x with batch-size tick labels (no categorical axis)
    with figure(path, 2, (13, 4.8)) as (fig, (absolute, share)):
        bottoms, share_bottoms = [0.0] * len(batches), [0.0] * len(batches)
        for color, part in enumerate(PARTS):
            values = [b["parts"][part]["median_ms"] for b in batches]
            totals = [sum(b["parts"][p]["median_ms"] for p in PARTS) or 1.0 for b in batches]
            shares = [100 * v / t for v, t in zip(values, totals)]
            absolute.bar(positions, values, bottom=bottoms, color=f"C{color}", label=part)
            share.bar(positions, shares, bottom=share_bottoms, color=f"C{color}", label=part)
            bottoms = [b + v for b, v in zip(bottoms, values)]
            share_bottoms = [b + s for b, s in zip(share_bottoms, shares)]
        hf = [(x, b["hf_compiled"]["median_ms"]) for x, b in zip(positions, batches)
              if (b.get("hf_compiled") or {}).get("median_ms") is not None]
        if hf:
            absolute.plot([x for x, _ in hf], [y for _, y in hf], "k*", markersize=12, label="HF generate, compiled")
        absolute.set_title("ms per engine step (median)")
        share.set_title("share of the step (%)")
        for axis in (absolute, share):
            axis.set_xlabel("batch size")
            axis.set_xticks(positions, labels)
            axis.grid(True, axis="y", alpha=0.3)
        absolute.legend(fontsize=8)
        fig.suptitle(f"segserve bench engine: {results.get('model', '')} on {results.get('device', '')}")
    return path
