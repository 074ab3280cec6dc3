"""`segserve bench prefix`: time to first token of a multi-turn chat with prefix caching on and off.

One invocation starts two fresh local stacks in turn (speculation off, so that
only the prefill differs): the scheduler with prefix caching, then with
`--no-prefix-caching`. On each, after one warm-up request, every repetition is
one fresh conversation through /v1/chat/completions (streamed, greedy): turn 1
asks about a document of about --history-tokens tokens, and each later turn
sends the whole conversation so far plus a new question, so with the cache only
the previous answer and the new question need computing. A repetition starts
with its own number, so no repetition finds another's blocks.
TTFT = request sent -> first SSE chunk carrying text. Outputs under --out:
prefix.json (every raw number, the command, the machine), prefix.png, the
services' logs; the markdown table and the goal (turn-3 TTFT off / on >= 8x)
are printed, and any difference between the two systems' greedy answers loudly.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from statistics import median

from segserve.bench.harness import figure, save, write_json

ON, OFF = "prefix_cache_on", "prefix_cache_off"
GOAL_RATIO = 8.0
QUESTIONS = ("Which functions in the document above read files? Answer in one sentence.",
             "Which of them sort their results?", "Summarize the whole document in two sentences.")
Chat = Callable[[list[dict]], dict]


@dataclass
class PrefixBenchConfig:
    model: str | None = None
    """A catalog name (qwen2.5-coder-0.5b-instruct, gemma-3-270m) or a transformers model directory; None = the default
    model."""
    history_tokens: int = 1500
    """Tokens of the document every conversation starts with (the shared history)."""
    num_turns: int = 3
    """Turns per conversation; the goal compares the last one."""
    max_tokens: int = 32
    """Tokens per answer."""
    num_repetitions: int = 5
    """Conversations per system."""
    dtype: str = "auto"
    """Weights dtype: auto = bfloat16 on cuda, float32 on cpu."""
    startup_timeout_s: float = 300.0
    """Longest a stack may take to become ready."""
    request_timeout_s: float = 600.0
    """Longest one request may take."""
    out: str = "bench-results/prefix"
    """Directory for prefix.json, prefix.png and the services' logs."""

    def __post_init__(self) -> None:
        if min(self.history_tokens, self.max_tokens, self.num_repetitions) < 1 or self.num_turns < 2:
            raise ValueError("history_tokens, max_tokens and num_repetitions must be >= 1, num_turns >= 2")
        if self.num_turns > len(QUESTIONS):
            raise ValueError(f"num_turns must be <= {len(QUESTIONS)}")
        if min(self.startup_timeout_s, self.request_timeout_s) <= 0:
            raise ValueError("time limits must be > 0")


def add_prefix_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `segserve bench prefix`, one per PrefixBenchConfig field."""
    defaults = PrefixBenchConfig()
    parser.add_argument("--model", default=defaults.model,
                        help="catalog name or transformers model directory (default model if unset)")
    for name in ("history_tokens", "num_turns", "max_tokens", "num_repetitions"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default=defaults.dtype)
    parser.add_argument("--startup-timeout-s", type=float, default=defaults.startup_timeout_s)
    parser.add_argument("--request-timeout-s", type=float, default=defaults.request_timeout_s)
    parser.add_argument("--out", default=defaults.out, help="output directory (default: bench-results/prefix)")


def build_history(tokenizer, num_tokens: int) -> str:
    """A deterministic made-up document of at least num_tokens tokens."""
    lines, text, i = [], "", 0
    while len(tokenizer(text, add_special_tokens=False).input_ids) < num_tokens:
        verb = ("reads a file and counts its words", "sorts the counts by frequency", "writes a CSV report")[i % 3]
        lines.append(f"{i + 1}. The function step_{i}(path, limit={i % 7 + 1}) {verb}, then logs item {i * 13}.")
        text, i = "\n".join(lines) + "\n", i + 1
    return text


@contextmanager
def segserve_chat(model_dir: Path, config: PrefixBenchConfig, is_prefix_caching: bool, log_dir: Path) -> Iterator[Chat]:
    """A fresh local stack without speculation; yields chat(messages) -> one measured turn."""
    import httpx

    from router.config import RouterConfig
    from scheduler.config import SchedulerConfig
    from segserve.launcher import Stack, StackConfig
    from worker.config import WorkerConfig

    stack_config = StackConfig(
        worker=WorkerConfig(model=str(model_dir), dtype=config.dtype, port=0),
        scheduler=SchedulerConfig(port=0, is_prefix_caching=is_prefix_caching),
        router=RouterConfig(port=0, grpc_port=0), is_speculative=False,  # 0: the launcher picks
        startup_timeout_s=config.startup_timeout_s, log_dir=str(log_dir))
    with Stack(stack_config) as stack:
        # trust_env=False: a proxy configured for package registries must never see loopback traffic.
        with httpx.Client(base_url=stack.base_url, timeout=config.request_timeout_s, trust_env=False) as client:
            yield lambda messages: chat_turn(client, messages, config.max_tokens)


def chat_turn(client, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat completion: TTFT, wall time, the answer and the usage."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    text, ttft_s, usage = "", None, {}
    started = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"segserve answered HTTP {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                content = choice.get("delta", {}).get("content") or ""
                if content and ttft_s is None:
                    ttft_s = time.perf_counter() - started
                text += content
    wall_s = time.perf_counter() - started
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft_s": wall_s if ttft_s is None else ttft_s, "wall_s": wall_s, "text": text,
            "prompt_tokens": usage.get("prompt_tokens", 0), "cached_tokens": cached,
            "completion_tokens": usage.get("completion_tokens", 0)}


def run_system(chat: Chat, history: str, config: PrefixBenchConfig) -> list[list[dict]]:
    """One warm-up turn, then num_repetitions fresh conversations: [repetition][turn] -> turn record."""
    chat([{"role": "user", "content": "Say hello."}])
    conversations = []
    for repetition in range(config.num_repetitions):
        messages: list[dict] = []
        turns = []
        for turn, question in enumerate(QUESTIONS[:config.num_turns]):
            # The repetition's number comes first, so its first KV block differs from every other's.
            opening = f"[{repetition + 1}] Here is a document:\n{history}\n" if turn == 0 else ""
            messages.append({"role": "user", "content": opening + question})
            record = chat(messages)
            messages.append({"role": "assistant", "content": record["text"]})
            turns.append(record)
        conversations.append(turns)
    return conversations


def summarize(conversations: list[list[dict]]) -> list[dict]:
    """Per turn: TTFT median / min / max in ms, median prompt and cached tokens."""
    out = []
    for turn in range(len(conversations[0])):
        ttfts = [c[turn]["ttft_s"] * 1e3 for c in conversations]
        out.append({"turn": turn + 1, "ttft_ms_median": median(ttfts), "ttft_ms_min": min(ttfts),
                    "ttft_ms_max": max(ttfts), "prompt_tokens": median(c[turn]["prompt_tokens"] for c in conversations),
                    "cached_tokens": median(c[turn]["cached_tokens"] for c in conversations)})
    return out


def run_benchmark(config: PrefixBenchConfig, factories: dict[str, Callable[[], AbstractContextManager]], history: str,
                  out: Path, header: dict | None = None) -> dict:
    """Both systems, summaries, the turn-N ratio and goal, answer mismatches; writes JSON + PNG."""
    results = {"benchmark": "prefix", **(header or {}), "config": asdict(config), "systems": {}}
    for name, factory in factories.items():
        print(f"[bench prefix] {name} ...", file=sys.stderr, flush=True)
        with factory() as chat:
            results["systems"][name] = {"conversations": run_system(chat, history, config)}
        results["systems"][name]["summary"] = summarize(results["systems"][name]["conversations"])
    on, off = (results["systems"][name]["summary"][-1]["ttft_ms_median"] for name in (ON, OFF))
    ratio = off / on if on > 0 else None
    results["last_turn_ttft_ratio"] = ratio
    results["goal"] = {"name": f"turn-{config.num_turns} TTFT without / with the cache >= {GOAL_RATIO:g}x",
                       "value": ratio, "is_met": ratio is not None and ratio >= GOAL_RATIO}
    answers = {name: [[t["text"] for t in c] for c in system["conversations"]]
               for name, system in results["systems"].items()}
    results["mismatches"] = [{"repetition": r, "turn": t + 1} for r, conversation in enumerate(answers[ON])
                             for t, text in enumerate(conversation) if answers[OFF][r][t] != text]
    return save(results, out, "prefix", plot)


def markdown_table(results: dict) -> str:
    on, off = (results["systems"][name]["summary"] for name in (ON, OFF))
    rows = ["| turn | prompt tokens | cached tokens (on) | TTFT on, median [min-max] ms | "
            "TTFT off, median [min-max] ms | off / on |", "|---|---|---|---|---|---|"]
    for a, b in zip(on, off):
        rows.append(f"| {a['turn']} | {a['prompt_tokens']:.0f} | {a['cached_tokens']:.0f} | "
                    f"{a['ttft_ms_median']:.0f} [{a['ttft_ms_min']:.0f}-{a['ttft_ms_max']:.0f}] | "
                    f"{b['ttft_ms_median']:.0f} [{b['ttft_ms_min']:.0f}-{b['ttft_ms_max']:.0f}] | "
                    f"{b['ttft_ms_median'] / a['ttft_ms_median']:.1f}x |")
    goal = results["goal"]
    rows.append(f"\ngoal: {goal['name']}: {goal['value']:.1f}x -> {'MET' if goal['is_met'] else 'NOT MET'}")
    return "\n".join(rows)


def plot(path: Path, results: dict) -> Path:
    """TTFT median per turn with min-max bars, cache on vs off (Agg backend)."""
    with figure(path) as (fig, ax):
        for offset, name in ((-0.2, ON), (0.2, OFF)):
            summary = results["systems"][name]["summary"]
            turns = [s["turn"] + offset for s in summary]
            medians = [s["ttft_ms_median"] for s in summary]
            spread = [[m - s["ttft_ms_min"] for m, s in zip(medians, summary)],
                      [s["ttft_ms_max"] - m for m, s in zip(medians, summary)]]
            ax.bar(turns, medians, width=0.4, yerr=spread, capsize=4, label=name)
        ax.set(xlabel="turn", ylabel="TTFT (ms), median with min-max", title="Multi-turn chat: prefix caching")
        ax.set_xticks([s["turn"] for s in results["systems"][ON]["summary"]])
        ax.legend()
    return path


def run_prefix(args: argparse.Namespace) -> dict:
    """Run the whole benchmark; write prefix.json + prefix.png under --out, print the table, return the results."""
    from transformers import AutoTokenizer

    from segserve.bench.peers import resolve_dtype
    from segserve.bench.machine import machine_info
    from common.checkpoint import resolve_model

    config = PrefixBenchConfig(**{f.name: getattr(args, f.name) for f in fields(PrefixBenchConfig)})
    config.dtype = resolve_dtype(config.dtype)
    out = Path(config.out)
    model_dir = resolve_model(config.model)
    history = build_history(AutoTokenizer.from_pretrained(model_dir), config.history_tokens)
    factories = {name: (lambda is_on=is_on, name=name: segserve_chat(model_dir, config, is_on, out / f"logs-{name}"))
                 for name, is_on in ((ON, True), (OFF, False))}
    header = {"command": shlex.join(sys.argv), "model": str(model_dir), "machine": machine_info()}
    results = run_benchmark(config, factories, history, out, header)
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    write_json(out / "prefix.json", results)
    print(markdown_table(results))
    if results["mismatches"]:
        print(f"\nMISMATCH: greedy answers differ with the cache on and off at {results['mismatches']}")
    else:
        print("\ngreedy answers: identical with the cache on and off")
    return results
