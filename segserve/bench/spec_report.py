"""Numbers, goals, table and plot of `segserve bench spec`; pure except the two writers.

In: per system, per workload kind, a list of request dicts
`{"num_tokens", "wall_s", "text", "spec": {counter deltas} | None}` (see spec.py),
for every round (a whole run with fresh systems) and every model.
Out: per-workload summaries (steady state = requests after the workload's
warm-up), speedups, the median / min / max / values of every number over the
rounds (`spread`), the goals with pass/FAIL (on medians), greedy-equality
mismatches, where each edit output's lines come from (`output_sources`), a
markdown table and a PNG.

Tokens/s of a workload = generated tokens / summed request wall time (prompt
processing included, the same for every system). Accepted tokens per step =
generated tokens / scheduler steps (prefill included); accepted drafts per verify
= accepted draft tokens / steps that verified a tree; draft acceptance = accepted
draft tokens / drafted tokens, also per segment kind. Drafter CPU per Draft call =
the drafter process's CPU time over the workload's steady requests / its Draft
calls in them; drafter bytes per learned token = what its corpora (the suffix
backend: its global tree) hold over the tokens learned into them, at the
workload's end (since the system started).

The peer goals compare full segserve with SuffixDecoding on the same engine
(segserve_suffix: the drafter's suffix backend): PEER_GOALS per workload, never
below PEER_FLOOR on any workload both ran, and no more drafter memory per learned
token (at the end of the system's run).
"""

from __future__ import annotations

from pathlib import Path

from segserve.bench.harness import figure, fmt, fmt_spread, goals_table
from segserve.bench import harness
from segserve.bench.report import check, ratio
from segserve.bench.spec_workloads import EDIT_KINDS, KINDS

PLAIN, LOOKUP, OFF = "hf_plain", "hf_prompt_lookup", "segserve_off"
SEG_LOOKUP, SPEC, SUFFIX = "segserve_lookup", "segserve_spec", "segserve_suffix"
VLLM_PLAIN, VLLM_SUFFIX = "vllm_plain", "vllm_suffix"
SYSTEMS = (PLAIN, LOOKUP, OFF, SEG_LOOKUP, SUFFIX, SPEC, VLLM_PLAIN, VLLM_SUFFIX)
DEFAULT_SYSTEMS = SYSTEMS[:6]
"""vLLM's two (`make vllm`; minutes of compiling at each start) run when named."""
SYSTEM_LABELS = {PLAIN: "HF generate()", LOOKUP: "HF prompt lookup (10)", OFF: "segserve, spec off",
                 SEG_LOOKUP: "segserve, prompt lookup only", SUFFIX: "segserve, SuffixDecoding",
                 SPEC: "segserve, full", VLLM_PLAIN: "vLLM", VLLM_SUFFIX: "vLLM, SuffixDecoding"}  # fmt: skip
# The same engine's plain decoding for each system: speedups within one engine.
PLAIN_OF = {LOOKUP: PLAIN, SEG_LOOKUP: OFF, SUFFIX: OFF, SPEC: OFF, VLLM_SUFFIX: VLLM_PLAIN}
# Against vLLM, the same decoding on each side: segserve's plain over vLLM's, full segserve over vLLM's suffix.
VLLM_PAIRS = {OFF: VLLM_PLAIN, SPEC: VLLM_SUFFIX}
VLLM_GOAL = 1.2
SPEC_COUNTERS = ("num_steps", "num_verified", "num_draft_tokens", "num_accepted_tokens")

# kind -> (minimum x plain, minimum x prompt lookup); "never slower than prompt lookup" = 1.0 at least.
GOALS = {
    "code_edit": (2.5, 1.5),
    "grounded": (3.3, 1.2),
    "structured": (3.0, 1.2),
    "open_ended": (0.97, 1.0),
}
# Edit workloads: full segserve over prompt lookup only on the same engine (the segment corpora's own gain).
EDIT_GOAL = 1.3
# Full segserve over SuffixDecoding on the same engine, in tokens/s and in tokens per step: 1.2x on agent loops,
# structured output (extraction) and mixed traffic; PEER_FLOOR on any other workload both ran.
PEER_GOALS = {"agentic": 1.2, "extraction": 1.2, "mixed": 1.2}
PEER_FLOOR = 1.0


def summarize(requests: list[dict], num_warmup: int) -> dict:
    """Steady-state (after `num_warmup`) and all-request rates, plus speculation counters if present."""
    steady = requests[num_warmup:]
    summary = {"num_requests": len(requests), "num_warmup": num_warmup,
               "tokens_per_s": _rate(steady), "tokens_per_s_all": _rate(requests)}  # fmt: skip
    if any(r.get("spec") for r in steady):
        totals = {name: sum((r.get("spec") or {}).get(name, 0) for r in steady) for name in SPEC_COUNTERS}
        num_tokens = sum(r["num_tokens"] for r in steady)
        summary["spec"] = totals
        summary["tokens_per_step"] = ratio(num_tokens, totals["num_steps"])
        summary["accepted_per_verify"] = ratio(totals["num_accepted_tokens"], totals["num_verified"])
        summary["draft_acceptance"] = ratio(totals["num_accepted_tokens"], totals["num_draft_tokens"])
        summary["acceptance_by_segment"] = _acceptance_by_segment(steady)
    drafter = [r["spec"]["drafter"] for r in steady if (r.get("spec") or {}).get("drafter")]
    if drafter:
        cpu_s, calls = sum(d["cpu_seconds"] for d in drafter), sum(d["num_draft_calls"] for d in drafter)
        summary["drafter_cpu_ms_per_call"] = ratio(1000 * cpu_s, calls)
        memory = drafter[-1]["memory"]
        summary["drafter_bytes_per_learned_token"] = ratio(memory["num_bytes"], memory["num_learned_tokens"])
        summary["drafter_learned_tokens"] = memory["num_learned_tokens"]
        judged: dict[str, list[int]] = {}
        for d in drafter:
            for key, (num_judged, num_matched) in d.get("sources", {}).items():
                counts = judged.setdefault(key, [0, 0])
                counts[0] += num_judged
                counts[1] += num_matched
        if judged:  # segment kind/source -> the share of its judged tokens that matched what the model wrote
            summary["source_acceptance"] = {key: ratio(m, j) for key, (j, m) in sorted(judged.items()) if j}
    return summary


def _acceptance_by_segment(requests: list[dict]) -> dict[str, float | None]:
    """Segment kind -> accepted / drafted tokens over the requests."""
    drafted, accepted = {}, {}
    for request in requests:
        for segment, counters in (request.get("spec") or {}).get("segments", {}).items():
            drafted[segment] = drafted.get(segment, 0) + counters.get("num_draft_tokens", 0)
            accepted[segment] = accepted.get(segment, 0) + counters.get("num_accepted_tokens", 0)
    return {segment or "unknown": ratio(accepted[segment], drafted[segment]) for segment in drafted
            if drafted[segment]}  # fmt: skip


def _rate(requests: list[dict]) -> float | None:
    wall_s = sum(r["wall_s"] for r in requests)
    return ratio(sum(r["num_tokens"] for r in requests), wall_s)


def speedups(summaries: dict[str, dict[str, dict]]) -> dict[str, dict[str, float | None]]:
    """summaries[system][kind] -> per kind: each system's steady tokens/s over HF plain, over its own engine's
    plain decoding (`<system>_vs_own_plain`), full segserve over HF prompt lookup and over prompt lookup only, and
    the latter in tokens per step too (`..._tokens_per_step`: what the drafts save, whatever the machine's load)."""
    measured = {kind for per_kind in summaries.values() for kind in per_kind}
    table = {}
    for kind in sorted(measured, key=lambda k: (KINDS.index(k) if k in KINDS else len(KINDS), k)):
        rate = {system: (per_kind.get(kind) or {}).get("tokens_per_s") for system, per_kind in summaries.items()}
        row = {}
        for system in (SPEC, SUFFIX, SEG_LOOKUP, OFF, LOOKUP):
            row[f"{system}_vs_plain"] = ratio(rate.get(system), rate.get(PLAIN))
        for system, plain in PLAIN_OF.items():
            row[f"{system}_vs_own_plain"] = ratio(rate.get(system), rate.get(plain))
        row[f"{SPEC}_vs_lookup"] = ratio(rate.get(SPEC), rate.get(LOOKUP))
        row[f"{SPEC}_vs_{SEG_LOOKUP}"] = ratio(rate.get(SPEC), rate.get(SEG_LOOKUP))
        row[f"{SPEC}_vs_{SUFFIX}"] = ratio(rate.get(SPEC), rate.get(SUFFIX))
        for ours, theirs in VLLM_PAIRS.items():
            row[f"{ours}_vs_{theirs}"] = ratio(rate.get(ours), rate.get(theirs))
        per_step = {system: (summaries.get(system, {}).get(kind) or {}).get("tokens_per_step")
                    for system in (SPEC, SEG_LOOKUP, SUFFIX)}  # fmt: skip
        row[f"{SPEC}_vs_{SEG_LOOKUP}_tokens_per_step"] = ratio(per_step[SPEC], per_step[SEG_LOOKUP])
        row[f"{SPEC}_vs_{SUFFIX}_tokens_per_step"] = ratio(per_step[SPEC], per_step[SUFFIX])
        table[kind] = row
    return table


def evaluate_goals(speedup_table: dict[str, dict], mismatches: list[dict] | None = None) -> list[dict]:
    """The goals for every measured kind (pass iff the number is at least the target; None when it is
    missing), and greedy token-identity when `mismatches` is given."""
    goals = []
    for kind, (vs_plain, vs_lookup) in GOALS.items():
        if kind not in speedup_table:
            continue
        row = speedup_table[kind]
        goals.append(check(f"{kind}: spec on vs plain", f">= {vs_plain}x", row.get(f"{SPEC}_vs_plain"), vs_plain))
        goals.append(check(f"{kind}: spec on vs prompt lookup", f">= {vs_lookup}x",
                            row.get(f"{SPEC}_vs_lookup"), vs_lookup))  # fmt: skip
    for kind in EDIT_KINDS:
        if kind in speedup_table:
            goals.append(check(f"{kind}: full segserve vs prompt lookup only", f">= {EDIT_GOAL}x",
                                speedup_table[kind].get(f"{SPEC}_vs_{SEG_LOOKUP}"), EDIT_GOAL))  # fmt: skip
    for kind, row in speedup_table.items():
        threshold = PEER_GOALS.get(kind, PEER_FLOOR)
        for measure, suffix in (("tok/s", ""), ("tokens/step", "_tokens_per_step")):
            measured = row.get(f"{SPEC}_vs_{SUFFIX}{suffix}")
            if measured is not None:
                goals.append(check(f"{kind}: full segserve vs SuffixDecoding, {measure}", f">= {threshold}x",
                                   measured, threshold))  # fmt: skip
    for kind, row in speedup_table.items():
        for ours, theirs in VLLM_PAIRS.items():
            measured = row.get(f"{ours}_vs_{theirs}")
            if measured is not None:
                goals.append(check(f"{kind}: {SYSTEM_LABELS[ours]} vs {SYSTEM_LABELS[theirs]}", f">= {VLLM_GOAL}x",
                                   measured, VLLM_GOAL))
    if mismatches is not None:
        goals.append({"name": "greedy outputs equal plain decoding's", "target": "0 mismatches",
                      "measured": float(len(mismatches)), "passed": not mismatches})  # fmt: skip
    return goals


def memory_goal(summaries: dict[str, dict[str, dict]]) -> dict | None:
    """SuffixDecoding's drafter bytes per learned token over full segserve's, each at the end of its run (its last
    workload); None unless both ran."""
    last = {}
    for system in (SPEC, SUFFIX):
        values = [summary.get("drafter_bytes_per_learned_token") for summary in summaries.get(system, {}).values()]
        values = [value for value in values if value]
        if not values:
            return None
        last[system] = values[-1]
    return check("drafter memory per learned token: SuffixDecoding / full segserve", ">= 1.0x",
                 ratio(last[SUFFIX], last[SPEC]), 1.0)


def mismatches(texts: dict[str, dict[str, list[str]]], greedy_kinds: tuple[str, ...] | None = None,
               reference: str | None = None) -> list[dict]:  # fmt: skip
    """texts[system][kind] = outputs in order; every output of a greedy kind (all kinds when None) that differs
    from the reference's: HF plain generate(), else segserve's plain decoding."""
    reference = reference or (PLAIN if PLAIN in texts else OFF)
    return harness.mismatches(texts, (OFF, SEG_LOOKUP, SUFFIX, SPEC, LOOKUP), reference, greedy_kinds)


def output_sources(prompts: list[str], outputs: list[str]) -> dict:
    """Where each output's lines come from, by characters: lines of its own prompt (prompt lookup can draft
    them), lines only of earlier outputs of the workload (only a learned corpus can), and new lines. Per
    request, and over the requests after the first."""
    rows = []
    for index, (prompt, output) in enumerate(zip(prompts, outputs)):
        prompt_lines = {line.strip() for line in prompt.splitlines()}
        earlier = {line.strip() for out in outputs[:index] for line in out.splitlines()}
        counts = {"in_prompt": 0, "in_earlier_outputs_only": 0, "new": 0}
        for line in output.splitlines():
            key = line.strip()
            if not key:
                continue
            source = "in_prompt" if key in prompt_lines else "in_earlier_outputs_only" if key in earlier else "new"
            counts[source] += len(key)
        total = sum(counts.values())
        rows.append({name: (count / total if total else None) for name, count in counts.items()})
    later = [row for row in rows[1:] if row["new"] is not None]
    mean = {name: (sum(row[name] for row in later) / len(later) if later else None) for name in rows[0]} if rows else {}
    return {"per_request": rows, "after_first": mean}


def spread(items: list):
    """The rounds' values of one number -> {"values", "median", "min", "max"}; of nested dicts -> the same
    structure with every number spread (keys missing or None in a round are left out of its values; text and
    other leaves are dropped)."""
    present = [item for item in items if item is not None]
    if not present:
        return None
    if all(isinstance(item, (int, float)) and not isinstance(item, bool) for item in present):
        values = sorted(present)
        middle = len(values) // 2
        median = values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2
        return {"values": present, "median": median, "min": values[0], "max": values[-1]}
    if all(isinstance(item, dict) for item in present):
        keys = list(dict.fromkeys(key for item in present for key in item))
        spread_of = {key: spread([item.get(key) for item in present]) for key in keys}
        return {key: value for key, value in spread_of.items() if value is not None}
    return None


def medians(spread_table):
    """The same structure as a `spread` result, with every number's median."""
    if isinstance(spread_table, dict) and "median" in spread_table and "values" in spread_table:
        return spread_table["median"]
    if isinstance(spread_table, dict):
        return {key: medians(value) for key, value in spread_table.items()}
    return spread_table


def markdown_table(block: dict) -> str:
    """One model's rows, one per workload: median (min-max over the rounds) tokens/s per system, the speedups
    of the ablation, draft acceptance and tokens per step (which a loaded machine does not move); then the goals
    (on medians)."""
    summaries, table = block["summaries"], block["speedups"]
    systems = [s for s in SYSTEMS if s in summaries]
    header = ["workload", *(f"{SYSTEM_LABELS[s]} tok/s" for s in systems), "full vs lookup only",
              "full vs spec off", "lookup only vs spec off", "full vs HF PL", "acceptance lookup only / full",
              "tokens/step lookup only / full"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for kind, row in table.items():
        acceptance = [summaries.get(s, {}).get(kind, {}).get("draft_acceptance") for s in (SEG_LOOKUP, SPEC)]
        per_step = [summaries.get(s, {}).get(kind, {}).get("tokens_per_step") for s in (SEG_LOOKUP, SPEC)]
        cells = [kind, *(fmt_spread(summaries[s].get(kind, {}).get("tokens_per_s"), 1) for s in systems),
                 fmt_spread(row.get(f"{SPEC}_vs_{SEG_LOOKUP}"), suffix="x"),
                 fmt_spread(row.get(f"{SPEC}_vs_own_plain"), suffix="x"),
                 fmt_spread(row.get(f"{SEG_LOOKUP}_vs_own_plain"), suffix="x"),
                 fmt_spread(row.get(f"{SPEC}_vs_lookup"), suffix="x"),
                 " / ".join(fmt_spread(a) for a in acceptance),
                 " / ".join(fmt_spread(n) for n in per_step)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines += goals_table(block["goals"], lambda goal: fmt(goal["measured"]), "measured (median)")
    return "\n".join(lines)


def peer_table(block: dict) -> str:
    """Full segserve against SuffixDecoding on the same engine, one row per workload: median (min-max over the
    rounds) of tokens/s, tokens per step and their ratios, draft acceptance per segment kind, drafter CPU per Draft
    call and drafter bytes per learned token; "" unless both ran."""
    summaries, table = block["summaries"], block["speedups"]
    if SPEC not in summaries or SUFFIX not in summaries:
        return ""
    header = ["workload", "tok/s suffix / full", "full vs suffix tok/s", "tokens/step suffix / full",
              "full vs suffix tokens/step", "acceptance per segment: suffix / full",
              "drafter CPU ms/call suffix / full", "drafter bytes/learned token suffix / full"]
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for kind, row in table.items():
        both = [summaries[system].get(kind, {}) for system in (SUFFIX, SPEC)]
        if not all(both):
            continue

        def pair(name: str, digits: int = 2) -> str:
            return " / ".join(fmt_spread(summary.get(name), digits) for summary in both)

        acceptance = " / ".join(", ".join(f"{segment} {fmt_spread(value)}"
                                          for segment, value in summary.get("acceptance_by_segment", {}).items())
                                or "n/a" for summary in both)  # fmt: skip
        cells = [kind, pair("tokens_per_s", 1), fmt_spread(row.get(f"{SPEC}_vs_{SUFFIX}"), suffix="x"),
                 pair("tokens_per_step"), fmt_spread(row.get(f"{SPEC}_vs_{SUFFIX}_tokens_per_step"), suffix="x"),
                 acceptance, pair("drafter_cpu_ms_per_call"), pair("drafter_bytes_per_learned_token", 0)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _bars(axes, groups: list[str], series: list[tuple[str, list[dict | None]]]) -> None:
    """Grouped bars: each series' median per group, min-max whiskers and a dot per round."""
    width = 0.8 / max(1, len(series))
    for offset, (label, entries) in enumerate(series):
        for i, entry in enumerate(entries):
            if not entry:
                continue
            x = i + offset * width
            axes.bar(x, entry["median"], width, color=f"C{offset}", label=label if label else None)
            label = ""  # one legend entry per series
            whiskers = [[entry["median"] - entry["min"]], [entry["max"] - entry["median"]]]
            axes.errorbar(x, entry["median"], yerr=whiskers, color="black", capsize=4)
            axes.scatter([x] * len(entry["values"]), entry["values"], color="black", s=10, zorder=3)
    axes.set_xticks([i + (len(series) - 1) * width / 2 for i in range(len(groups))], groups, rotation=20,
                    ha="right", fontsize=8)  # fmt: skip
    axes.axhline(1.0, color="gray", linewidth=1, linestyle="--")
    axes.grid(True, axis="y", alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=8)


def plot(path: Path, results: dict) -> Path:
    """Left: each speculative system's speedup over its own engine's plain decoding per workload (first
    model). Then, for what was run: full segserve over prompt lookup only on the same engine, per workload and
    model; full segserve over SuffixDecoding on the same engine, per workload (first model)."""
    models = results["models"]
    first = next(iter(models.values()))
    kinds = list(first["speedups"])
    measures = (("tokens/s", ""), ("tokens per step", "_tokens_per_step"))

    def measured(block: dict, key: str) -> bool:
        return any(block["speedups"].get(k, {}).get(key) for k in kinds)

    has_ablation = any(measured(block, f"{SPEC}_vs_{SEG_LOOKUP}") for block in models.values())
    has_peer = measured(first, f"{SPEC}_vs_{SUFFIX}")
    num_panels = 1 + has_ablation + has_peer
    with figure(path, num_panels, (7 * num_panels, 5), squeeze=False) as (fig, panels):
        left, *others = panels[0]
        _bars(left, kinds, [(f"{SYSTEM_LABELS[s]} vs {SYSTEM_LABELS[PLAIN_OF[s]]}",
                             [first["speedups"][k].get(f"{s}_vs_own_plain") for k in kinds])
                            for s in (LOOKUP, SEG_LOOKUP, SUFFIX, SPEC)
                            if measured(first, f"{s}_vs_own_plain")])  # fmt: skip
        left.set_ylabel("speedup over the same engine's plain decoding (x)")
        left.set_title(f"{Path(first.get('model', '')).name}: median, min-max and each round", fontsize=10)
        if has_ablation:
            axes = others.pop(0)
            _bars(axes, kinds, [(f"{label}: {Path(block.get('model', '')).name}, {measure}",
                                 [block["speedups"].get(k, {}).get(f"{SPEC}_vs_{SEG_LOOKUP}{suffix}") for k in kinds])
                                for label, block in models.items() for measure, suffix in measures])  # fmt: skip
            axes.axhline(EDIT_GOAL, color="red", linewidth=1, linestyle=":")
            axes.set_ylabel("full segserve / prompt lookup only (x)")
            axes.set_title(f"segment corpora's own gain (goal on edit workloads: {EDIT_GOAL}x)", fontsize=10)
        if has_peer:
            axes = others.pop(0)
            _bars(axes, kinds, [(f"{Path(first.get('model', '')).name}, {measure}",
                                 [first["speedups"][k].get(f"{SPEC}_vs_{SUFFIX}{suffix}") for k in kinds])
                                for measure, suffix in measures])  # fmt: skip
            axes.axhline(PEER_FLOOR, color="red", linewidth=1, linestyle=":")
            axes.set_ylabel("full segserve / SuffixDecoding, same engine (x)")
            axes.set_title("against SuffixDecoding (goals 1.2x agentic, extraction and mixed, 1.0x floor)",
                           fontsize=10)
        num_rounds = results.get("config", {}).get("rounds", "")
        fig.suptitle(f"segserve bench spec, single stream, {num_rounds} rounds")
    return path
