"""Bounded load on loopback: many concurrent streams, some of whose clients hang up, through a real stack.

64 streaming requests over /v1/completions, /v1/chat/completions and /v2 generate_stream
contend for 8 sequence slots and a small KV cache while a third of the clients close
their connection at seeded random points (before the first token or mid-stream).
Every stream that is read to the end must carry exactly the greedy reference text,
and afterwards the scheduler must be idle: nothing running or waiting, no KV block held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass

import httpx
import pytest

from tests.support.e2e_helpers import GreedyReference, scheduler_stats, served_model_name, tiny_stack, wait_until_idle

pytestmark = pytest.mark.e2e

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    '{"name": "Ada", "age"',
    "User: what is the capital of France? Assistant:",
    "for i in range(10):\n    print(i",
    "Übermäßig schöne Grüße! 東京",
]
KINDS = ("completion", "chat", "v2")
MAX_TOKENS = 40
NUM_REQUESTS = 64
MAX_NUM_SEQS = 8
# 32 blocks of 16 tokens: 8 running sequences of up to ~80 tokens (prompt, output and drafts) need more,
# so requests wait for slots and for blocks.
NUM_KV_BLOCKS = 32


@pytest.fixture(scope="module")
def stack(tiny_gemma3_dir, tmp_path_factory):
    with tiny_stack(tiny_gemma3_dir, tmp_path_factory.mktemp("logs"), max_num_seqs=MAX_NUM_SEQS,
                    num_kv_blocks=NUM_KV_BLOCKS, block_size=16) as stack:
        yield stack


@pytest.fixture(scope="module")
def model_name(stack) -> str:
    return served_model_name(stack)


@pytest.fixture(scope="module")
def references(tiny_gemma3_dir) -> dict[tuple[str, str], str]:
    reference = GreedyReference(tiny_gemma3_dir)
    out = {}
    for prompt in PROMPTS:
        out["completion", prompt] = out["v2", prompt] = reference.completion(prompt, MAX_TOKENS)
        out["chat", prompt] = reference.chat(prompt, MAX_TOKENS)
    return out


def request_for(kind: str, model: str, prompt: str, max_tokens: int) -> tuple[str, dict]:
    """(path, body) of one greedy streaming request."""
    if kind == "completion":
        return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                   "stream": True}
    if kind == "chat":
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": prompt}],
                                        "max_tokens": max_tokens, "temperature": 0, "stream": True}
    return f"/v2/models/{model}/generate_stream", {"text_input": prompt,
                                                   "parameters": {"max_new_tokens": max_tokens}}


def event_text(kind: str, event: dict) -> tuple[str, bool]:
    """(text, is_last) of one SSE event's JSON."""
    if kind == "v2":
        return event["text_output"], "finish_reason" in event
    if kind == "chat":
        return "".join(c["delta"].get("content") or "" for c in event["choices"]), False
    return "".join(c["text"] for c in event["choices"]), False


@dataclass
class StreamResult:
    text: str = ""
    num_events: int = 0
    is_started: bool = False
    """The response headers arrived (the router sends them with the first token)."""
    is_finished: bool = False
    """The stream ended as it should: `[DONE]`, or for /v2 the event with finish_reason."""


async def stream(base_url: str, kind: str, path: str, body: dict, result: StreamResult,
                 hang_up_after_events: int | None = None) -> StreamResult:
    """Run one streaming request into `result`; close the connection after `hang_up_after_events` text events."""
    # One client (one connection) per request: leaving it closes the socket, as a departing user does.
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        async with client.stream("POST", path, json=body) as response:
            result.is_started = True
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    result.is_finished = True
                    break
                event = json.loads(payload)
                assert "error" not in event, event
                text, is_last = event_text(kind, event)
                result.text += text
                result.num_events += bool(text)
                if is_last:
                    result.is_finished = True
                    break
                if hang_up_after_events is not None and result.num_events >= hang_up_after_events:
                    return result
    return result


async def hang_up_after(delay_s: float, coro, result: StreamResult) -> StreamResult:
    """Run `coro`, cancelling it (which closes its connection) after `delay_s` unless it ended before."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=delay_s)
    if not done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return result
    return task.result()


async def watch_stats(stack, peak: dict[str, int], stop: asyncio.Event) -> None:
    while not stop.is_set():
        stats = await asyncio.to_thread(scheduler_stats, stack)
        for name in ("num_running", "num_waiting", "num_used_kv_blocks"):
            peak[name] = max(peak.get(name, 0), getattr(stats, name))
        await asyncio.sleep(0.02)


async def test_concurrent_streams_with_hang_ups_complete_and_leave_the_scheduler_idle(stack, model_name,
                                                                                         references):
    rng = random.Random(1234)
    plans = []
    for index in range(NUM_REQUESTS):
        kind, prompt = rng.choice(KINDS), rng.choice(PROMPTS)
        # A third hang up: half of those after a short delay (most are still queued, no token yet),
        # half after reading one to three text events.
        plan = "keep" if index % 3 else rng.choice(["early", "mid"])
        plans.append((kind, prompt, plan, rng.uniform(0.0, 0.15), rng.randint(1, 3)))

    peak: dict[str, int] = {}
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(watch_stats(stack, peak, stop))
    results = [StreamResult() for _ in plans]
    coros = []
    for (kind, prompt, plan, delay_s, num_events), result in zip(plans, results):
        path, body = request_for(kind, model_name, prompt, MAX_TOKENS)
        if plan == "early":
            coros.append(hang_up_after(delay_s, stream(stack.base_url, kind, path, body, result), result))
        else:
            coros.append(stream(stack.base_url, kind, path, body, result,
                                hang_up_after_events=num_events if plan == "mid" else None))
    try:
        await asyncio.wait_for(asyncio.gather(*coros), timeout=120)
    finally:
        stop.set()
        await watcher

    kept = [(plan, result) for plan, result in zip(plans, results) if plan[2] == "keep"]
    for (kind, prompt, *_), result in kept:
        assert result.is_finished, (kind, prompt)
        assert result.text == references[kind, prompt], (kind, prompt)
    # The hang-ups really happened at both points: some before any token came, some mid-stream.
    early = [r for p, r in zip(plans, results) if p[2] == "early"]
    mid = [r for p, r in zip(plans, results) if p[2] == "mid"]
    assert any(not r.is_started for r in early)
    assert any(r.num_events > 0 and not r.is_finished for r in mid)
    # What a mid-stream leaver read was the beginning of the right text.
    for (kind, prompt, plan, *_), result in zip(plans, results):
        if plan == "mid":
            assert references[kind, prompt].startswith(result.text), (kind, prompt)
    # The load really contended: requests queued behind a full running set.
    assert peak["num_running"] <= MAX_NUM_SEQS
    assert peak["num_waiting"] > 0, peak

    stats = wait_until_idle(stack, timeout_s=5.0)
    assert (stats.num_running, stats.num_waiting, stats.num_used_kv_blocks) == (0, 0, 0)
    assert stats.num_total_kv_blocks == NUM_KV_BLOCKS


async def test_a_client_that_hangs_up_frees_its_slot_within_a_step_or_so(stack, model_name):
    assert wait_until_idle(stack).num_running == 0
    max_tokens = 400  # some seconds of decoding if nobody stopped it
    path, body = request_for("completion", model_name, "The quick brown fox", max_tokens)
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        async with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            # Held in a name: an abandoned line iterator is finalized at once, and that closes the connection.
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data: ") and event_text("completion", json.loads(line[6:]))[0]:
                    break
            running = await asyncio.to_thread(scheduler_stats, stack)
            assert running.num_running == 1
            await lines.aclose()
        # Leaving both blocks closed the connection.
    hung_up_s = time.monotonic()
    steps_at_hang_up = running.num_steps
    stats = await asyncio.to_thread(wait_until_idle, stack, 2.0)
    freed_after_s = time.monotonic() - hung_up_s
    assert (stats.num_running, stats.num_waiting, stats.num_used_kv_blocks) == (0, 0, 0)
    assert freed_after_s < 1.0
    # The request stopped long before its budget: it ran a handful of steps after the hang-up, not hundreds.
    # (The cancel crosses HTTP, the router and gRPC while the scheduler steps on; 5 allows a loaded machine.)
    assert stats.num_steps - steps_at_hang_up <= 5, (steps_at_hang_up, stats.num_steps)
