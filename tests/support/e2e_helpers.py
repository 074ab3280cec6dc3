"""Shared by the end-to-end tiers: a real stack on a tiny model, the scheduler's stats, greedy references."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from drafter.config import DrafterConfig
from router.config import RouterConfig
from scheduler.config import SchedulerConfig
from segserve.launcher import Stack, StackConfig
from tests.support.devices import TEST_DEVICE
from worker.config import WorkerConfig


def tiny_stack(model_dir: Path, log_dir: Path, *, is_speculative: bool = True, max_num_seqs: int = 16,
               scheduler: dict | None = None, num_drafters: int = 1, num_workers: int = 1,
               is_ray_workers: bool = False, drafter: dict | None = None, shared: dict | None = None,
               **worker_overrides) -> Stack:
    """The one stack the end-to-end tests run: worker, drafter, scheduler and router on free ports, not yet
    started (use it as a context manager, or call start()). `scheduler` and `drafter` override SchedulerConfig
    and DrafterConfig fields; `shared` sets fields every service's config has (tracing's, as `serve` does)."""
    shared = shared or {}
    config = StackConfig(
        worker=WorkerConfig(**{"model": str(model_dir), "port": 0, "device": TEST_DEVICE, **shared,
                               **worker_overrides}),
        scheduler=SchedulerConfig(**{"port": 0, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": 128,
                                     **shared, **(scheduler or {})}),
        router=RouterConfig(port=0, grpc_port=0, **shared),
        drafter=DrafterConfig(**{"port": 0, **shared, **(drafter or {})}),
        is_speculative=is_speculative,
        num_drafters=num_drafters,
        num_workers=num_workers,
        is_ray_workers=is_ray_workers,
        log_dir=str(log_dir),
    )
    return Stack(config)


def start_stack(model_dir: Path, log_dir: Path, max_num_seqs: int = 16, **worker_overrides) -> Stack:
    """`tiny_stack`, started."""
    stack = tiny_stack(model_dir, log_dir, max_num_seqs=max_num_seqs, **worker_overrides)
    stack.start()
    return stack


def served_model_name(stack: Stack) -> str:
    """The model name the stack's router serves, from GET /v1/models."""
    import httpx

    return httpx.get(stack.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def scheduler_stats(stack: Stack):
    """The scheduler's SchedulerStats (num_running, num_waiting, num_used_kv_blocks, ...), over gRPC GetStats."""
    import grpc

    from protos.segserve.v1 import scheduler_pb2, scheduler_pb2_grpc

    with grpc.insecure_channel(stack.config.router.scheduler_address) as channel:
        return scheduler_pb2_grpc.SchedulerStub(channel).GetStats(scheduler_pb2.StatsRequest(), timeout=10)


def wait_until_idle(stack: Stack, timeout_s: float = 5.0):
    """Poll until the scheduler runs, queues and holds nothing; return the last stats (idle or not)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = scheduler_stats(stack)
        is_idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.num_used_kv_blocks == 0
        if is_idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


class GreedyReference:
    """Plain transformers greedy decoding in fp32: the text segserve must reproduce."""

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def _generate(self, prompt_ids: list[int], max_new_tokens: int) -> str:
        input_ids = torch.tensor([prompt_ids])  # [1, prompt_len]
        with torch.inference_mode():
            out = self.model.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens)
        return self.tokenizer.decode(out[0, len(prompt_ids):].tolist(), skip_special_tokens=True)

    def completion(self, prompt: str, max_new_tokens: int) -> str:
        """/v1/completions and /v2 tokenize the prompt with the tokenizer's default special tokens."""
        return self._generate(self.tokenizer(prompt).input_ids, max_new_tokens)

    def chat(self, content: str, max_new_tokens: int) -> str:
        """One user message through the chat template, as the router renders it."""
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                  add_generation_prompt=True, tokenize=False)
        return self._generate(self.tokenizer(text, add_special_tokens=False).input_ids, max_new_tokens)
