"""Lossless speculation for every tree algorithm, every draft source and both drafter backends.

The real scheduler Engine, the real worker (ModelRunner) and the real drafter
talk over in-process gRPC; the policy is fixed (every step speculates with the
segment's full budget). For each algorithm, drafts come from a lookup corpus
(plus the request's own history), from a draft model alone, or from both; with
the suffix backend, from SuffixDecoding's trees (chains or trees). Greedy output
must equal `model.generate(do_sample=False)` token for token, on a tiny random
model and on the real default model. The corpus (the suffix backend's global
tree) holds the right continuation of some prompts and wrong ones of others, so
drafts are accepted in full, in part and not at all. Seeded sampled output must
equal the same seed's output without speculation, for both backends: one uniform
per output token, drawn in order, so equal tokens are the same draw of the target
distribution (tests/worker/test_verify_sampling.py checks the distribution itself).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from drafter.config import DrafterConfig
from drafter.segments import DEFAULT_SEGMENT, parse_segments
from drafter.server import build_servicer, load_draft_models
from drafter.server import start_server as start_drafter
from drafter.trees import BUILDERS
from protos.segserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from protos.segserve.v1.generate import FinishReason, GenerateComplete
from scheduler.config import SchedulerConfig
from scheduler.servicer import start_server as start_scheduler
from scheduler.servicer import stop_server as stop_scheduler
from tests.support.devices import TEST_DEVICE
from tests.scheduler.test_service import collect, generate_request, wait_until
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner
from worker.server import WorkerServicer
from worker.server import start_server as start_worker

ALGORITHMS = sorted(BUILDERS)
SOURCES = ["corpus", "draft_model", "both"]
SUFFIX_SOURCES = ["suffix_tree", "suffix_chain"]
"""The suffix backend, with trees or with chains."""
TINY_PROMPTS = ["def add(a, b):", "The quick brown fox", '{"name": "Ada", "age"', "for i in range(10):"]
REAL_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


def reference(model_dir, prompts: list[str], max_tokens: int) -> dict[str, tuple[list[int], list[int]]]:
    """prompt -> (prompt ids, plain greedy continuation ids), on the test device as the runners (another device
    rounds otherwise and may break a near tie the other way)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(TEST_DEVICE).eval()
    out = {}
    for prompt in prompts:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids.to(TEST_DEVICE)
        with torch.inference_mode():
            generated = model.generate(input_ids, do_sample=False, max_new_tokens=max_tokens)
        out[prompt] = (input_ids[0].tolist(), generated[0, input_ids.shape[1]:].tolist())
    return out


def segments_for(algorithm: str, source: str, num_layers: int):
    """One default segment with the algorithm; a self-speculative draft model unless corpus only.

    Alone, the draft model is the target's every layer (its drafts are right);
    combined with the corpus it is the first layer only (its drafts are mostly wrong).
    """
    table = {"algorithm": algorithm, "max_nodes": 8, "max_depth": 5, "max_candidates": 4}
    if source == "draft_model":
        table["draft_model"] = {"kind": "self_speculative", "num_layers": num_layers, "mode": "replace"}
    elif source == "both":
        table["draft_model"] = {"kind": "self_speculative", "num_layers": 1, "mode": "combine"}
    return parse_segments({"default": table})


@contextlib.asynccontextmanager
async def speculative_stack(runner: ModelRunner, model_dir, algorithm: str, source: str, corpus_texts):
    """Scheduler stub over the runner and a drafter configured for (algorithm, source)."""
    num_layers = AutoConfig.from_pretrained(model_dir).get_text_config().num_hidden_layers
    if source in SUFFIX_SOURCES:
        segments = segments_for(algorithm, "corpus", num_layers)
        config = DrafterConfig(port=0, backend="suffix", is_suffix_tree_spec=source == "suffix_tree")
        drafter = build_servicer(config, segments)
    else:
        segments = segments_for(algorithm, source, num_layers)
        drafter = build_servicer(DrafterConfig(port=0), segments, load_draft_models(segments, str(model_dir)))
    if source != "draft_model":
        for token_ids in corpus_texts:
            drafter.planner.learn(DEFAULT_SEGMENT, token_ids)
    worker_server, worker_port = await start_worker(WorkerServicer(runner), "127.0.0.1", 0)
    drafter_server, drafter_port = await start_drafter(drafter, "127.0.0.1", 0)
    drafters = [f"127.0.0.1:{drafter_port}"] if source != "none" else []
    config = SchedulerConfig(worker_address=f"127.0.0.1:{worker_port}", port=0, is_spec_adaptive=False,
                             drafter_addresses=drafters, draft_timeout_ms=60_000)
    server, engine = await start_scheduler(config)
    try:
        import grpc

        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.bound_port}") as channel:
            await wait_until(lambda: engine.is_connected, timeout_s=30)
            yield scheduler_pb2_grpc.SchedulerStub(channel)
    finally:
        await stop_scheduler(server, engine)
        await drafter_server.stop(None)
        await worker_server.stop(None)


def corpus_texts(references) -> list[list[int]]:
    """The right continuation of every other prompt; of the rest, one that goes wrong (shifted
    ids) after three tokens, so its drafts are accepted in part."""
    texts = []
    for i, (prompt_ids, continuation) in enumerate(references.values()):
        wrong = continuation[:3] + [t + 1 for t in continuation[3:]]
        texts.append(prompt_ids + (continuation if i % 2 == 0 else wrong))
    return texts


async def check_lossless(runner, model_dir, references, algorithm, source, max_tokens):
    async with speculative_stack(runner, model_dir, algorithm, source, corpus_texts(references)) as stub:
        requests = [generate_request(f"r{i}", prompt_ids, max_tokens=max_tokens)
                    for i, (prompt_ids, _) in enumerate(references.values())]
        results = await asyncio.gather(*(collect(stub, r) for r in requests))
        stats = (await stub.GetStats(scheduler_pb2.StatsRequest())).spec
    for (tokens, last), (prompt, (_, expected)) in zip(results, references.items()):
        assert isinstance(last, GenerateComplete) and last.finish_reason is not FinishReason.ERROR, last
        assert tokens == expected, (algorithm, source, prompt)
    assert stats.num_verified > 0 and stats.num_draft_tokens >= stats.num_accepted_tokens > 0
    if source != "draft_model":  # wrong corpus continuations (and a one-layer draft) were rejected too
        assert stats.num_draft_tokens > stats.num_accepted_tokens
    return stats


@pytest.fixture(scope="module")
def tiny_runner(tiny_gemma3_dir):
    runner = ModelRunner(WorkerConfig(model=str(tiny_gemma3_dir), num_kv_blocks=256, block_size=4, dtype="float32",
                                      device=TEST_DEVICE))
    runner.warm_up()
    return runner


@pytest.fixture(scope="module")
def tiny_references(tiny_gemma3_dir):
    return reference(tiny_gemma3_dir, TINY_PROMPTS, 24)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
async def test_tiny_model_greedy_is_lossless(algorithm, source, tiny_runner, tiny_gemma3_dir, tiny_references):
    await check_lossless(tiny_runner, tiny_gemma3_dir, tiny_references, algorithm, source, 24)


@pytest.mark.parametrize("source", SUFFIX_SOURCES)
async def test_tiny_model_greedy_is_lossless_with_suffix_decoding(source, tiny_runner, tiny_gemma3_dir,
                                                                  tiny_references):
    await check_lossless(tiny_runner, tiny_gemma3_dir, tiny_references, "best_first", source, 24)


@pytest.mark.parametrize("source", ["corpus", "suffix_tree"])
async def test_seeded_sampling_is_lossless_with_either_backend(source, tiny_runner, tiny_gemma3_dir, tiny_references):
    """Each prompt sampled with its own seed: the speculative stack's tokens are the plain stack's. The drafter
    learned the plain outputs (every other one going wrong after three tokens), so drafts are accepted in full and
    in part."""
    requests = [generate_request(f"s{i}", prompt_ids, max_tokens=24, do_sample=True, temperature=0.8, top_k=40,
                                 seed=100 + i)
                for i, (prompt_ids, _) in enumerate(tiny_references.values())]  # fmt: skip
    async with speculative_stack(tiny_runner, tiny_gemma3_dir, "best_first", "none", []) as stub:
        plain = [await collect(stub, request) for request in requests]
    learned = {prompt: (prompt_ids, tokens)
               for (prompt, (prompt_ids, _)), (tokens, _) in zip(tiny_references.items(), plain)}  # fmt: skip
    async with speculative_stack(tiny_runner, tiny_gemma3_dir, "best_first", source, corpus_texts(learned)) as stub:
        speculative = [await collect(stub, request) for request in requests]
        stats = (await stub.GetStats(scheduler_pb2.StatsRequest())).spec
    assert all(len(tokens) == 24 for tokens, _ in plain)
    assert [tokens for tokens, _ in speculative] == [tokens for tokens, _ in plain]
    assert stats.num_verified > 0 and stats.num_draft_tokens > stats.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def real_runner(default_model_dir):
    runner = ModelRunner(WorkerConfig(model=str(default_model_dir), num_kv_blocks=64, dtype="float32", device=TEST_DEVICE))
    runner.warm_up()
    return runner


@pytest.fixture(scope="module")
def real_references(default_model_dir):
    return reference(default_model_dir, REAL_PROMPTS, 12)


@pytest.mark.real_model
@pytest.mark.parametrize(("algorithm", "source"),
                         [(algorithm, source) for algorithm in ALGORITHMS for source in SOURCES]
                         + [("best_first", source) for source in SUFFIX_SOURCES])  # fmt: skip
async def test_real_model_greedy_is_lossless(algorithm, source, real_runner, default_model_dir, real_references):
    await check_lossless(real_runner, default_model_dir, real_references, algorithm, source, 12)
