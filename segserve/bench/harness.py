"""What every `segserve bench` report shares: its figure (matplotlib, headless), its numbers and its table of goals.

`figure` gives a row of axes and, when the block ends without error, lays them out, makes the folder and
saves the figure; it closes it in any case; `save` keeps a bench's record, its JSON and its figure. `fmt` writes a
number for a table (n/a when there is none), and `fmt_spread` a median over rounds with its min-max. `goals_table`
renders each goal as one row (pass, FAIL, or not measured when nothing measured it), the measured value as the
caller formats it. `check_runs` refuses the settings every bench of systems over workloads shares, when they cannot
run. `mismatches` finds the greedy outputs that differ from a reference system's, and `print_failures` prints them
with the runs that failed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

VERDICTS = {True: "pass", False: "FAIL", None: "not measured"}
"""A goal's `passed` (None: not measured) as its table says it."""


def mismatches(outputs: dict[str, dict[str, list[str]]], systems: Iterable[str], reference: str | None,
               kinds: Collection[str] | None = None) -> list[dict]:  # fmt: skip
    """outputs[system][kind] = greedy outputs in order: every output of `systems` (other than the reference; of
    `kinds` only, when given) that differs from the reference system's at its place, with its first differing
    character."""
    expected = outputs.get(reference, {})
    found = []
    for system in systems:
        if system == reference:
            continue
        for kind, got_outputs in outputs.get(system, {}).items():
            if kinds is not None and kind not in kinds:
                continue
            for index, (got, want) in enumerate(zip(got_outputs, expected.get(kind, []))):
                if got != want:
                    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                    found.append({"system": system, "reference": reference, "kind": kind, "index": index,
                                  "first_diff_char": at, "got": got, "expected": want})  # fmt: skip
    return found


def print_failures(errors: list[dict], mismatched: list[dict]) -> None:
    """The runs that failed and the outputs that differ from their reference's (`mismatches`), as a bench prints
    them under its table."""
    for error in errors:
        print(f"\nround {error['round']} {error['system']}: ERROR {error['error']}")
    for item in mismatched:
        print(f"\nMISMATCH: round {item['round']} {item['system']} {item['kind']}[{item['index']}] differs from "
              f"{item['reference']} at char {item['first_diff_char']}:\n  got      {item['got']!r}\n"
              f"  expected {item['expected']!r}")  # fmt: skip


@contextmanager
def figure(path: Path, ncols: int = 1, figsize: tuple[float, float] = (7.0, 4.5), **subplots: Any
           ) -> Iterator[tuple[Any, Any]]:  # fmt: skip
    """(figure, axes) of 1 x ncols plots (matplotlib's subplots, `subplots` passed on) saved to `path` at 100 dpi
    when the block ends without error, closed in any case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=figsize, **subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def write_json(path: Path, results: dict) -> Path:
    """results as indented JSON at path (its folder made); NaN and infinities refused."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    return path


def save(results: dict, out: Path, name: str, plot: Callable[[Path, dict], Any]) -> dict:
    """A bench's record, kept: where it goes (results["outputs"]), its figure (plot(out / NAME.png, results)) and
    the record itself (out / NAME.json). Returns results."""
    results["outputs"] = {"json": str(out / f"{name}.json"), "png": str(out / f"{name}.png")}
    plot(out / f"{name}.png", results)
    write_json(out / f"{name}.json", results)
    return results


def fmt(value: float | None, digits: int = 2, suffix: str = "", missing: str = "n/a") -> str:
    """A number for a table, `digits` after the point, or `missing` when there is none."""
    return missing if value is None else f"{value:.{digits}f}{suffix}"


def fmt_spread(entry: dict | None, digits: int = 2, suffix: str = "") -> str:
    """median (min-max) of a spread entry ({"values", "median", "min", "max"}); the median alone for one round."""
    if not entry:
        return "n/a"
    median = fmt(entry["median"], digits, suffix)
    if len(entry["values"]) < 2:
        return median
    return f"{median} ({entry['min']:.{digits}f}-{entry['max']:.{digits}f})"


def goals_table(goals: Iterable[dict], measured: Callable[[dict], str], measured_header: str = "measured"
                ) -> list[str]:  # fmt: skip
    """The goals' markdown table after a blank line: name, target, `measured(goal)`, verdict (VERDICTS)."""
    lines = ["", f"| goal | target | {measured_header} | result |", "|---|---|---:|---|"]
    for goal in goals:
        lines.append(f"| {goal['name']} | {goal['target']} | {measured(goal)} | {VERDICTS[goal['passed']]} |")
    return lines


def check_runs(config: Any, systems: Collection[str], kinds: Collection[str]) -> None:
    """ValueError unless `config`'s systems and kinds are non-empty subsets of these, its rounds >= 1, its
    startup and request time limits > 0 and its dtype one a stack takes."""
    if not config.systems or set(config.systems) - set(systems):
        raise ValueError(f"systems must be a non-empty subset of {tuple(systems)}")
    if not config.kinds or set(config.kinds) - set(kinds):
        raise ValueError(f"kinds must be a non-empty subset of {tuple(kinds)}")
    if config.rounds < 1:
        raise ValueError("rounds must be >= 1")
    if min(config.startup_timeout_s, config.request_timeout_s) <= 0:
        raise ValueError("time limits must be > 0")
    if config.dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported dtype {config.dtype!r}")
