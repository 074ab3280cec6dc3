"""End to end: real processes (worker, Ray-actor scheduler, router), real HTTP, the official openai client.

Greedy output through the whole stack must be token-identical to
`model.generate(do_sample=False)` in fp32, alone, among concurrent requests, and
when the KV cache is too small to hold every request at once: with speculation
from segserve's drafter, from its SuffixDecoding backend, and without.
"""

from __future__ import annotations

import concurrent.futures as futures
import os
from pathlib import Path

import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from segserve.launcher import Stack, local_cpu_sets
from tests.support.e2e_helpers import scheduler_stats, tiny_stack

pytestmark = pytest.mark.e2e

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    '{"name": "Ada", "age"',
    "User: what is the capital of France? Assistant:",
    "for i in range(10):\n    print(i",
    "Übermäßig schöne Grüße! 東京",
    "The",
    "``` code fence ``` <think> reasoning </think> and then the quick brown fox jumps over",
]


def spec_stats(stack: Stack):
    """The scheduler's speculation counters, over its gRPC GetStats."""
    import grpc

    from protos.segserve.v1 import scheduler_pb2, scheduler_pb2_grpc

    with grpc.insecure_channel(stack.config.router.scheduler_address) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.StatsRequest(), timeout=10).spec


def reference_completion(model_dir, prompt: str, max_new_tokens: int) -> list[int]:
    """Plain transformers greedy decoding: the output segserve must reproduce."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, input_ids.shape[1]:].tolist()


def complete(client: OpenAI, model: str, prompt: str, max_tokens: int, stream: bool = False) -> str:
    if not stream:
        return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text
    events = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(event.choices[0].text for event in events if event.choices)


@pytest.fixture(scope="module", params=["speculative", "suffix", "plain"])
def running_stack(request, tiny_gemma3_dir, tmp_path_factory):
    backend = {"backend": "suffix"} if request.param == "suffix" else {}
    with tiny_stack(tiny_gemma3_dir, tmp_path_factory.mktemp("logs"), is_speculative=request.param != "plain",
                    drafter=backend) as stack:
        yield stack


@pytest.fixture(scope="module")
def tiny_references(tiny_gemma3_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_gemma3_dir)
    return {p: tokenizer.decode(reference_completion(tiny_gemma3_dir, p, 40), skip_special_tokens=True)
            for p in PROMPTS}


def _client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_greedy_matches_generate_streamed_and_not(running_stack, tiny_references):
    client = _client(running_stack)
    model = client.models.list().data[0].id
    for prompt in PROMPTS[:3]:
        assert complete(client, model, prompt, 40) == tiny_references[prompt]
        assert complete(client, model, prompt, 40, stream=True) == tiny_references[prompt]
    if running_stack.config.is_speculative:  # the configured backend drafted, and learned the outputs
        (drafter,) = scheduler_stats(running_stack).drafters
        assert drafter.stats.backend == running_stack.config.drafter.backend and drafter.stats.num_draft_calls > 0
        assert sum(segment.num_learned_tokens for segment in drafter.stats.segments) > 0


def test_the_worker_has_its_own_cpus(running_stack):
    """CPU pinning: the worker's compute thread (its main thread, which runs the steps) on the CPUs its torch threads
    use and its gRPC threads on every CPU, the router and the scheduler (with its Ray processes) on the CPU kept for
    them (on a machine of fewer than four CPUs, on every CPU, as the worker's compute); a machine with one CPU pins
    nothing."""
    processes = running_stack.processes
    affinity = {name: os.sched_getaffinity(processes[name].pid) for name in ("worker", "router", "scheduler")}
    worker_tasks = Path(f"/proc/{processes['worker'].pid}/task")
    grpc_threads = [int(task.name) for task in worker_tasks.iterdir()
                    if (task / "comm").read_text().strip() in ("event_engine", "grpc_global_tim")]
    assert grpc_threads
    everywhere = os.sched_getaffinity(0)
    assert all(os.sched_getaffinity(thread) == everywhere for thread in grpc_threads)
    cpu_sets = local_cpu_sets(1)
    if cpu_sets is None:
        assert all(cpus == everywhere for cpus in affinity.values())
    else:
        (worker_cpus,), service_cpus = cpu_sets
        assert affinity == {"worker": worker_cpus, "router": service_cpus, "scheduler": service_cpus}


def test_batch_invariance_among_concurrent_requests(running_stack, tiny_references):
    client = _client(running_stack)
    model = client.models.list().data[0].id
    with futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        outputs = list(pool.map(lambda p: complete(client, model, p, 40, stream=True), PROMPTS))
    assert outputs == [tiny_references[p] for p in PROMPTS]


def test_more_requests_than_the_kv_cache_holds(tiny_gemma3_dir, tiny_references, tmp_path):
    # 8 blocks of 16 tokens hold 128 tokens; 8 requests of up to ~60 tokens each need far more.
    with tiny_stack(tiny_gemma3_dir, tmp_path, num_kv_blocks=8, block_size=16) as stack:
        client = _client(stack)
        model = client.models.list().data[0].id
        with futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            outputs = list(pool.map(lambda p: complete(client, model, p, 40, stream=True), PROMPTS))
    assert outputs == [tiny_references[p] for p in PROMPTS]


@pytest.mark.parametrize("num_drafters", [1, 2])
def test_killing_a_drafter_mid_stream_fails_no_request(tiny_gemma3_dir, tiny_references, tmp_path, num_drafters):
    """SIGKILL of the only drafter: decoding goes on without speculation. Of one of two: its requests move to
    the other one. 16 concurrent greedy streams either way, every output equal to its solo reference."""
    import threading
    import time

    prompts = PROMPTS * 2
    # drafting never turned off by the cost gate, so that the survivor's drafts can be counted
    with tiny_stack(tiny_gemma3_dir, tmp_path, num_drafters=num_drafters, scheduler={"is_spec_adaptive": False}) as stack:
        client = _client(stack)
        model = client.models.list().data[0].id
        drafter = stack.processes["drafter"]
        killer = threading.Timer(0.3, drafter.kill)
        killer.start()
        with futures.ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(lambda p: complete(client, model, p, 40, stream=True), prompts))
        killer.join()
        time.sleep(0.1)
        assert drafter.poll() is not None, "the drafter was not killed during the test"
        assert outputs == [tiny_references[p] for p in prompts]
        drafted = spec_stats(stack).num_draft_tokens
        # The survivor drafts for the requests after the kill. A Draft call past its deadline on a loaded machine
        # backs the replica off for a second or more, so each round waits for a live replica, and up to three
        # rounds are given to show drafts.
        for _ in range(3):
            if num_drafters == 2:
                _wait_for_a_live_drafter(stack, timeout_s=30)
            with futures.ThreadPoolExecutor(4) as pool:
                again = list(pool.map(lambda p: complete(client, model, p, 40), PROMPTS[:4]))
            assert again == [tiny_references[p] for p in PROMPTS[:4]]
            if num_drafters == 1 or spec_stats(stack).num_draft_tokens > drafted:
                break
        if num_drafters == 2:
            assert stack.processes["drafter-1"].poll() is None
            assert spec_stats(stack).num_draft_tokens > drafted


def _wait_for_a_live_drafter(stack, timeout_s: float) -> None:
    """Poll the scheduler's GetStats until one of its drafter replicas is live (not backing off)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not any(replica.is_live for replica in scheduler_stats(stack).drafters):
        assert time.monotonic() < deadline, "no drafter replica came back from backing off"
        time.sleep(0.1)


REAL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here is a list of fruits: apple, banana,",
]


@pytest.mark.real_model
def test_default_model_greedy_and_chat_through_the_stack(default_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    expected = [tokenizer.decode(reference_completion(default_model_dir, p, 16), skip_special_tokens=True)
                for p in REAL_PROMPTS]
    quoting = ("Fruits: apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango.\n"
               "The same fruits again: apple, banana, cherry,")
    expected_quote = tokenizer.decode(reference_completion(default_model_dir, quoting, 24), skip_special_tokens=True)
    with tiny_stack(default_model_dir, tmp_path) as stack:
        client = _client(stack)
        model = client.models.list().data[0].id
        assert model == "gemma-3-270m"
        assert [complete(client, model, p, 16, stream=True) for p in REAL_PROMPTS] == expected
        # A continuation that copies its prompt: drafts from the request's own history get accepted.
        for _ in range(3):
            assert complete(client, model, quoting, 24, stream=True) == expected_quote
        stats = spec_stats(stack)
        assert stats.num_verified > 0 and stats.num_accepted_tokens > 0
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8, stream=True,
            stream_options={"include_usage": True},
        )
        events = list(stream)
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text.strip()
    assert events[-1].usage is not None and 0 < events[-1].usage.completion_tokens <= 8
