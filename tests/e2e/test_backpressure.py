"""Back-pressure through the real stack: a full queue answers 429 with Retry-After at once,
before any work, while the requests already admitted run to their end unharmed."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from segserve.launcher import Stack
from tests.support.e2e_helpers import scheduler_stats, tiny_stack, wait_until_idle

pytestmark = pytest.mark.e2e

MAX_TOKENS = 400


async def _complete(http: httpx.AsyncClient, prompt: str) -> httpx.Response:
    return await http.post("/v1/completions", json={"model": "tiny-gemma3", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0, "ignore_eos": True})


def test_a_full_queue_answers_429_at_once_while_admitted_requests_finish(tiny_gemma3_dir, tmp_path):
    stack = tiny_stack(tiny_gemma3_dir, tmp_path, is_speculative=False, max_num_seqs=2,
                       scheduler={"max_num_waiting": 2, "max_num_batched_tokens": 64}, served_model_name="tiny-gemma3")

    async def scenario(stack: Stack) -> None:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
            prompts = [f"Request number {i} says" for i in range(4)]
            admitted = []
            for prompt in prompts:  # one at a time: requests arriving together all wait at first
                admitted.append(asyncio.create_task(_complete(http, prompt)))
                deadline = time.monotonic() + 30
                while True:
                    stats = scheduler_stats(stack)
                    num = len(admitted)
                    if (stats.num_running, stats.num_waiting) == (min(num, 2), max(num - 2, 0)):
                        break
                    assert time.monotonic() < deadline and not any(t.done() for t in admitted), [
                        t.result().text for t in admitted if t.done()]
                    await asyncio.sleep(0.01)
            stats = scheduler_stats(stack)
            assert (stats.num_running, stats.num_waiting) == (2, 2)
            started = time.monotonic()
            refused = await asyncio.gather(*(_complete(http, "One request too many") for _ in range(3)))
            refusal_s = time.monotonic() - started
            for response in refused:
                assert response.status_code == 429, response.text
                assert int(response.headers["Retry-After"]) >= 1
                assert response.json()["error"]["type"]
            assert refusal_s < 2.0  # at once, not after the admitted requests
            done = await asyncio.gather(*admitted)
            assert all(r.status_code == 200 for r in done)
            assert all(r.json()["usage"]["completion_tokens"] == MAX_TOKENS for r in done)
            # An admitted request's greedy text equals the same request run alone afterwards.
            alone = await _complete(http, prompts[-1])
            assert alone.json()["choices"][0]["text"] == done[-1].json()["choices"][0]["text"]
        stats = wait_until_idle(stack)
        assert (stats.num_running, stats.num_waiting, stats.num_used_kv_blocks) == (0, 0, 0)

    with stack:
        asyncio.run(scenario(stack))
