"""One stream's decode rate against HF `generate()`, in alternated rounds (`segserve bench throughput
--decode-rounds N`).

The level rows measure `generate()` once, before the stack starts, and segserve a minute later. On a shared machine
whose speed drifts by a tenth or more within a minute, their ratio is the drift as much as the systems: three runs
of one build on the 2-core CPU gave 1.05x, 0.77x and 0.93x, with `generate()` itself at 441, 540 and 459 tok/s.
A round here measures both back to back, at the same token count: one `generate()` of the bench's first prompt in
the benchmark process (the stack idle meanwhile) and one stream of requests through the router (the HF model idle),
on the bench's prompts in turn, the order swapped every round, so that drift falls on both sides alike. A round's
ratio is segserve's median decode rate (a request's tokens after the first over their span) to `generate()`'s; the
report gives the rounds' median and spread.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from statistics import median

from segserve.bench import peers, report

GenerateRate = Callable[[], "float | None"]
"""One generate()'s decode tokens per second (None when it cannot be told)."""
NAME = "1-stream decode vs plain generate(), alternated rounds (median)"
TARGET = 0.9
"""The engine speed issue's goal for one stream: at least 0.9x `generate()`'s decode rate."""


def generate_rate(model, tokenizer, prompt: str, max_new_tokens: int) -> float | None:
    """One plain generate()'s decode rate, as the baseline row measures it (peers.measure_plain_generate)."""
    return peers.measure_plain_generate(model, tokenizer, prompt, max_new_tokens, runs=1)["decode_tokens_per_s"]


def run(num_rounds: int, generate_rate: GenerateRate, segserve_level: Callable[[], dict]) -> list[dict]:
    """num_rounds rounds of `generate_rate()` (one generate(): its decode tokens per second) and `segserve_level()`
    (one stream's requests through the router: a level summary, report.summarize), back to back, the order swapped
    every round."""
    rounds = []
    for number in range(num_rounds):
        if number % 2 == 0:
            baseline = generate_rate()
            summary = segserve_level()
        else:
            summary = segserve_level()
            baseline = generate_rate()
        ours = summary["decode_tokens_per_s_median"]
        ratio = report.ratio(ours, baseline)
        rounds.append({"round": number, "generate_decode_tokens_per_s": baseline,
                       "segserve_decode_tokens_per_s": ours, "ratio": ratio, "num_errors": summary["num_errors"]})
        print(f"[bench] decode round {number + 1}/{num_rounds}: segserve {ours or 0:.1f}, generate() "
              f"{baseline or 0:.1f} decode tok/s ({ratio or 0:.2f}x)", file=sys.stderr, flush=True)
    return rounds


def summarize(rounds: list[dict]) -> dict | None:
    """The rounds' ratios, with their median, min and max; None when no round has one."""
    ratios = [item["ratio"] for item in rounds if item["ratio"] is not None]
    if not ratios:
        return None
    return {"ratios": ratios, "median": median(ratios), "min": min(ratios), "max": max(ratios),
            "num_errors": sum(item["num_errors"] for item in rounds)}


def goal(summary: dict | None) -> dict:
    """The goal row (report.evaluate_goals' form) for the rounds' median ratio."""
    return report.check(NAME, f">= {TARGET}x", None if summary is None else summary["median"], TARGET)
