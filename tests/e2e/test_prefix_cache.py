"""Prefix caching end to end on the tiny model: real processes, real HTTP, the official openai client.

A 3-turn conversation (each turn's prompt = the previous prompt + its answer + a new message) and
repeated prompts must give exactly plain transformers greedy text with the cache on (speculation on,
and a KV cache so small that requests preempt each other) and off; cached turns report their
cached prompt tokens in the usage and in /metrics; prompt-logprob requests get no hit; once
every request has ended no KV block is in use.
"""

from __future__ import annotations

import concurrent.futures as futures

import httpx
import pytest
from openai import OpenAI

from tests.support.e2e_helpers import GreedyReference, scheduler_stats, tiny_stack, wait_until_idle

pytestmark = pytest.mark.e2e

SYSTEM = ("You are a careful assistant. Answer briefly, show your reasoning as a numbered list, and never "
          "invent facts. The user is working on a small Python project about counting words.\n")
MESSAGES = ["User: how do I count words in a line?\nAssistant:", "\nUser: and in a whole file?\nAssistant:",
            "\nUser: now sort them by count.\nAssistant:"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def greedy(tiny_gemma3_dir):
    return GreedyReference(tiny_gemma3_dir)


def _client(stack) -> OpenAI:
    return OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(stack, greedy: GreedyReference) -> list:
    """Three turns, each prompt extending the last one by its answer; returns the completions."""
    client, prompt, replies = _client(stack), SYSTEM, []
    model = client.models.list().data[0].id
    for message in MESSAGES:
        prompt += message
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert reply.choices[0].text == greedy.completion(prompt, MAX_TOKENS)
        replies.append(reply)
        prompt += reply.choices[0].text
    return replies


def _cached_tokens(reply) -> int:
    details = reply.usage.prompt_tokens_details
    return 0 if details is None else details.cached_tokens


def _metric(stack, name: str) -> float:
    text = httpx.get(stack.base_url + "/metrics", timeout=10).text
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.parametrize("is_speculative", [True, False], ids=["speculative", "plain"])
def test_chat_turns_reuse_the_cache_and_stay_greedy_exact(tiny_gemma3_dir, greedy, tmp_path, is_speculative):
    with tiny_stack(tiny_gemma3_dir, tmp_path, is_speculative=is_speculative) as stack:
        replies = _chat(stack, greedy)
        assert _cached_tokens(replies[0]) == 0
        for reply in replies[1:]:  # everything the previous turn computed, in full 16-token blocks
            assert 16 <= _cached_tokens(reply) < reply.usage.prompt_tokens
        stats = wait_until_idle(stack)
        assert stats.num_used_kv_blocks == 0
        assert stats.num_prefix_cache_hits == sum(_cached_tokens(r) for r in replies)
        assert _metric(stack, "vllm:prefix_cache_hits_total") == stats.num_prefix_cache_hits
        assert _metric(stack, "vllm:prefix_cache_queries_total") == stats.num_prefix_cache_queries > 0
        # Prompt log-probabilities need every position's logits: the same prompt again gets no hit.
        client = _client(stack)
        model = client.models.list().data[0].id
        echoed = client.completions.create(model=model, prompt=SYSTEM + MESSAGES[0], max_tokens=4, temperature=0,
                                           echo=True, logprobs=1)
        assert _cached_tokens(echoed) == 0
        assert echoed.choices[0].logprobs.token_logprobs[1] is not None
        assert wait_until_idle(stack).num_prefix_cache_hits == stats.num_prefix_cache_hits


def test_preemption_with_shared_prefixes_and_the_cache_off_stay_greedy_exact(tiny_gemma3_dir, greedy, tmp_path):
    prompts = [SYSTEM + MESSAGES[0] + f" Example {i}:" for i in range(6)]
    expected = [greedy.completion(p, MAX_TOKENS) for p in prompts]

    def run_all(stack) -> list[str]:
        client = _client(stack)
        model = client.models.list().data[0].id
        with futures.ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(lambda p: client.completions.create(
                model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0), prompts))
        return [r.choices[0].text for r in replies]

    # ~16 blocks of 16 tokens: far less than 6 requests of ~120 tokens each need without sharing.
    with tiny_stack(tiny_gemma3_dir, tmp_path / "small", is_speculative=False, num_kv_blocks=16,
                    block_size=16) as stack:
        assert run_all(stack) == expected
        assert run_all(stack) == expected  # the second round mostly from the cache
        stats = wait_until_idle(stack)
        assert stats.num_used_kv_blocks == 0 and stats.num_preemptions > 0 and stats.num_prefix_cache_hits > 0
    with tiny_stack(tiny_gemma3_dir, tmp_path / "off", is_speculative=False,
                    scheduler={"is_prefix_caching": False}) as stack:
        assert run_all(stack) == expected
        stats = scheduler_stats(stack)
        assert stats.num_prefix_cache_queries == 0 and stats.num_prefix_cache_hits == 0
