"""Numbers, goals, table and plot of `segserve bench structured`; pure except the plot.

In: per system, per workload kind, the request records in the order they were
sent: `{"num_tokens", "wall_s", "text", "calls", "finish_reason", "spec":
{counter deltas} | None, "group", "index", "is_finished", "is_valid"}`
(structured.py), for every round (a whole run with fresh systems).
Out: per-workload summaries, the ratios between systems, the spread of every
number over the rounds (spec_report.spread), the goals with pass/FAIL, greedy
mismatches, a markdown table and a PNG.

- A request is finished when it ended on its own: finish_reason "stop" (schema)
  or "tool_calls" (a forced call), not "length". It is valid when it is finished
  and its JSON is strict JSON (RFC 8259: no raw control characters in strings)
  that `jsonschema` accepts against its schema (a call: exactly one, of an
  allowed tool, its arguments against that tool's parameters).
  validity = valid / requests; finished_validity = valid / finished.
- tok/s = completion tokens / summed request wall time; tokens per step =
  completion tokens / scheduler steps; draft acceptance = accepted / drafted
  tokens; accepted per verify = accepted / steps that verified a tree
  (spec_report.summarize). The `later` numbers leave out the first request of
  each schema or chat, which had nothing earlier of its kind to draft from.
- Greedy outputs (a schema's JSON text, a turn's calls) of the segserve systems
  must be identical to each other (`mismatches`); HF + xgrammar against segserve
  with speculation off is reported too, for information (their float paths may
  differ).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from segserve.bench.harness import figure, fmt, fmt_spread, goals_table
from segserve.bench import harness
from segserve.bench.report import check, ratio
from segserve.bench.spec_report import summarize as rate_summary
from segserve.bench.structured_workloads import KINDS

HF, OFF, NO_GRAMMAR, SPEC = "hf_xgrammar", "segserve_off", "segserve_no_grammar_drafts", "segserve_spec"
SYSTEMS = (HF, OFF, NO_GRAMMAR, SPEC)
SEGSERVE_SYSTEMS = (OFF, NO_GRAMMAR, SPEC)
SYSTEM_LABELS = {HF: "HF generate + xgrammar", OFF: "segserve, spec off",
                 NO_GRAMMAR: "segserve, no grammar drafts", SPEC: "segserve, full"}  # fmt: skip
FINISHED = {"schema": "stop", "tool_loop": "tool_calls"}
"""The finish_reason of a request of each kind that ended on its own."""

# Goals, on the medians over the rounds, for the schema workload.
GRAMMAR_DRAFTS_GOAL = 1.5
"""Full segserve's tokens per step over the same stack without the grammar's forced-span drafts."""
HF_GOAL = 2.0
"""Full segserve's tok/s over HF generate() with xgrammar's logits processor."""


def judge_json(text: str, schema: dict) -> bool:
    """Whether `text` is strict JSON (what `json.loads` and any RFC 8259 client accept) valid for `schema`."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def judge_calls(calls: list[dict], schemas: dict[str, dict]) -> bool:
    """Whether `calls` is exactly one call of a tool in `schemas` (name -> parameters), its arguments valid."""
    return len(calls) == 1 and calls[0]["name"] in schemas and judge_json(calls[0]["arguments"],
                                                                          schemas[calls[0]["name"]])  # fmt: skip


def judge(record: dict, kind: str, schemas: dict) -> tuple[bool, bool]:
    """(is_finished, is_valid) of one request: `schemas` is the response format's schema (schema) or the
    parameters of the tools the turn may call, by name (tool_loop)."""
    is_finished = record["finish_reason"] == FINISHED[kind]
    if kind == "schema":
        is_valid = judge_json(record["text"], schemas)
    else:
        is_valid = judge_calls(record["calls"], schemas)
    return is_finished, is_finished and is_valid


def output_of(record: dict) -> str:
    """What greedy equality compares: the calls (names and argument text) when there are any, else the text."""
    if record.get("calls"):
        return json.dumps([[call["name"], call["arguments"]] for call in record["calls"]], ensure_ascii=False)
    return record["text"]


def summarize(records: list[dict]) -> dict:
    """Validity counts, rates and speculation numbers of one workload's requests, and the same rates over the
    requests after the first of each group (`later`)."""
    num_finished = sum(r["is_finished"] for r in records)
    num_valid = sum(r["is_valid"] for r in records)
    summary = {**rate_summary(records, 0), "num_finished": num_finished, "num_valid": num_valid,
               "num_tokens": sum(r["num_tokens"] for r in records),
               "validity": ratio(num_valid, len(records)) if num_valid else 0.0,
               "finished_validity": (num_valid / num_finished) if num_finished else None}  # fmt: skip
    for key in ("num_warmup", "tokens_per_s_all"):  # no warm-up inside a workload
        summary.pop(key)
    later = [r for r in records if r["index"] > 0]
    if later:
        summary["later"] = {key: value for key, value in rate_summary(later, 0).items()
                            if key in ("tokens_per_s", "tokens_per_step", "draft_acceptance")}  # fmt: skip
    return summary


RATIOS = {
    f"{SPEC}_vs_{NO_GRAMMAR}_tokens_per_step": (SPEC, NO_GRAMMAR, "tokens_per_step",
                                                "full / no grammar drafts, tokens/step"),
    f"{SPEC}_vs_{OFF}_tokens_per_step": (SPEC, OFF, "tokens_per_step", "full / spec off, tokens/step"),
    f"{SPEC}_vs_{NO_GRAMMAR}": (SPEC, NO_GRAMMAR, "tokens_per_s", "full / no grammar drafts, tok/s"),
    f"{SPEC}_vs_{OFF}": (SPEC, OFF, "tokens_per_s", "full / spec off, tok/s"),
    f"{SPEC}_vs_{HF}": (SPEC, HF, "tokens_per_s", "full / HF + xgrammar, tok/s"),
    f"{OFF}_vs_{HF}": (OFF, HF, "tokens_per_s", "spec off / HF + xgrammar, tok/s"),
}  # fmt: skip
"""name -> (system, the system it is divided by, the number, its label)."""


def _number(summaries: dict, system: str, kind: str, key: str) -> float | None:
    return (summaries.get(system, {}).get(kind) or {}).get(key)


def ratios(summaries: dict[str, dict[str, dict]]) -> dict[str, dict[str, float | None]]:
    """summaries[system][kind] -> per kind, every RATIOS entry (None where a system or number is missing)."""
    measured = {kind for per_kind in summaries.values() for kind in per_kind}
    return {kind: {name: ratio(_number(summaries, top, kind, key), _number(summaries, bottom, kind, key))
                   for name, (top, bottom, key, _) in RATIOS.items()}
            for kind in KINDS if kind in measured}  # fmt: skip


def mismatches(outputs: dict[str, dict[str, list[str]]], systems: tuple[str, ...] = SEGSERVE_SYSTEMS,
               reference: str | None = None) -> list[dict]:  # fmt: skip
    """outputs[system][kind] = greedy outputs in order; every output of `systems` that differs from the
    reference's (segserve with speculation off, else the first of `systems` that ran), with its first
    differing character."""
    present = [s for s in systems if s in outputs]
    reference = reference or (OFF if OFF in outputs else present[0] if present else None)
    return harness.mismatches(outputs, present, reference)


def evaluate_goals(summaries: dict, ratio_medians: dict, mismatch_list: list[dict]) -> list[dict]:
    """The goals: on the schema workload full segserve's tokens per step over no grammar drafts and its tok/s
    over HF (medians over the rounds); every finished output of every segserve system valid, in every round
    (the lowest round's finished_validity); no greedy mismatch among the segserve systems. A goal whose
    numbers are missing is listed with passed None."""
    schema = ratio_medians.get("schema", {})
    goals = [
        check("schema: full tokens/step vs no grammar drafts", f">= {GRAMMAR_DRAFTS_GOAL}x",
              schema.get(f"{SPEC}_vs_{NO_GRAMMAR}_tokens_per_step"), GRAMMAR_DRAFTS_GOAL),
        check("schema: full tok/s vs HF + xgrammar", f">= {HF_GOAL}x", schema.get(f"{SPEC}_vs_{HF}"), HF_GOAL),
    ]  # fmt: skip
    for system in SEGSERVE_SYSTEMS:
        for kind, summary in summaries.get(system, {}).items():
            lowest = (summary.get("finished_validity") or {}).get("min")
            goals.append(check(f"{kind}: {SYSTEM_LABELS[system]} finished outputs valid", "100% (every round)",
                               lowest, 1.0))  # fmt: skip
    ran = [s for s in SEGSERVE_SYSTEMS if s in summaries]
    goals.append({"name": "greedy outputs equal among segserve systems", "target": "0 mismatches",
                  "measured": float(len(mismatch_list)) if len(ran) > 1 else None,
                  "passed": not mismatch_list if len(ran) > 1 else None})  # fmt: skip
    return goals


def markdown_table(results: dict) -> str:
    """One row per workload and system (median, min-max over the rounds), the ratios, then the goals."""
    summaries, table = results["summaries"], results["ratios"]
    header = ["workload", "system", "valid", "valid of finished", "tok/s", "tokens/step", "draft acceptance",
              "accepted/verify", "tokens/step after the first"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|---|---" + "|---:" * (len(header) - 2) + "|"]
    for kind in [k for k in KINDS if any(k in per for per in summaries.values())]:
        for system in [s for s in SYSTEMS if kind in summaries.get(s, {})]:
            row = summaries[system][kind]
            cells = [kind, SYSTEM_LABELS[system], fmt_spread(row.get("validity")),
                     fmt_spread(row.get("finished_validity")), fmt_spread(row.get("tokens_per_s"), 1),
                     fmt_spread(row.get("tokens_per_step")), fmt_spread(row.get("draft_acceptance")),
                     fmt_spread(row.get("accepted_per_verify")),
                     fmt_spread((row.get("later") or {}).get("tokens_per_step"))]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    kinds = list(table)
    lines += ["", "| ratio | " + " | ".join(kinds) + " |", "|---" + "|---:" * len(kinds) + "|"]
    for key, (*_, label) in RATIOS.items():
        lines.append(f"| {label} | " + " | ".join(fmt_spread(table[k].get(key), suffix="x") for k in kinds) + " |")
    lines += goals_table(results["goals"], lambda goal: fmt(goal["measured"]))
    return "\n".join(lines)


def _bars(axes, kinds: list[str], summaries: dict, key: str) -> None:
    """One bar per system per workload: the median, min-max whiskers and a dot per round."""
    systems = [s for s in SYSTEMS if s in summaries]
    width = 0.8 / max(1, len(systems))
    for offset, system in enumerate(systems):
        for i, kind in enumerate(kinds):
            entry = (summaries[system].get(kind) or {}).get(key)
            if not entry:
                continue
            x = i + offset * width
            axes.bar(x, entry["median"], width, color=f"C{offset}", label=SYSTEM_LABELS[system] if i == 0 else None)
            whiskers = [[entry["median"] - entry["min"]], [entry["max"] - entry["median"]]]
            axes.errorbar(x, entry["median"], yerr=whiskers, color="black", capsize=4)
            axes.scatter([x] * len(entry["values"]), entry["values"], color="black", s=10, zorder=3)
    axes.set_xticks([i + (len(systems) - 1) * width / 2 for i in range(len(kinds))], kinds)
    axes.grid(True, axis="y", alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=8)


def plot(path: Path, results: dict) -> Path:
    """Left: tok/s per system per workload; right: tokens per step (median, min-max and each round)."""
    summaries = results["summaries"]
    kinds = [k for k in KINDS if any(k in per for per in summaries.values())]
    with figure(path, 2, (13, 5)) as (fig, (left, right)):
        _bars(left, kinds, summaries, "tokens_per_s")
        left.set_ylabel("completion tokens / s")
        _bars(right, kinds, summaries, "tokens_per_step")
        right.axhline(1.0, color="gray", linewidth=1, linestyle="--")  # plain decoding: one token per step
        right.set_ylabel("completion tokens per scheduler step")
        model, num_rounds = Path(results.get("model", "")).name, results.get("config", {}).get("rounds", 0)
        fig.suptitle(f"segserve bench structured, {model}, {num_rounds} round{'' if num_rounds == 1 else 's'}: "
                     "median, min-max and each round")  # fmt: skip
    return path
