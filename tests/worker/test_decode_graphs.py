"""Decode steps on static buffers (worker/decode_graphs.py): a runner with cuda_graphs gives the eager runner's
logits, tokens and KV, whatever its batches are padded to, and runs every other step as before.

On the CPU the padded static steps run eagerly; with SEGSERVE_TEST_DEVICE=cuda the same tests capture and replay
the graphs."""

from __future__ import annotations

import dataclasses
import numpy as np
import pytest
import torch

from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from protos.segserve.v1.tree import CandidateTree
from tests.support.devices import TEST_DEVICE
from tests.worker.test_model_runner import (
    ARCHITECTURES, PROMPT, Decoder, assert_batch_invariant, logits_of, make_runner, reference_greedy,
    run_together,
)
from worker.attention_plan import graph_bucket_keys
from worker.config import WorkerConfig
from worker.decode_graphs import CAPTURE_SIZES
from worker.model_runner import ModelRunner

NUM_BLOCKS = 320


@pytest.fixture(scope="module", params=ARCHITECTURES)
def runners(request):
    """An eager runner and a runner with decode graphs of the same tiny model."""
    model_dir = request.getfixturevalue(f"tiny_{request.param}_dir")
    return eager_runner(model_dir, NUM_BLOCKS), make_runner(model_dir, NUM_BLOCKS, is_cuda_graphs=True)


def eager_runner(model_dir, num_kv_blocks: int, **fields) -> ModelRunner:
    """A runner without graphs (on CUDA too, where they are the default) whose steps pad key lengths as a runner
    with graphs does (GraphPath's key_bucket): the reference for its logits, bit for bit."""
    runner = make_runner(model_dir, num_kv_blocks, is_cuda_graphs=False, **fields)
    runner.path = dataclasses.replace(runner.path, key_bucket=graph_bucket_keys)
    return runner


@pytest.fixture
def counted(monkeypatch):
    """Counts the steps each runner's DecodeGraphs ran: runner -> [steps]."""
    counts: dict[int, list[int]] = {}

    def watch(runner):
        real = runner.path.graphs.run
        calls = counts.setdefault(id(runner), [0])

        def run(*args):
            calls[0] += 1
            return real(*args)

        monkeypatch.setattr(runner.path.graphs, "run", run)
        return calls

    return watch


def prompts(num: int) -> list[list[int]]:
    """num prompts of 1 to 24 tokens (contexts on both sides of the tiny models' window of 8 keys)."""
    rng = np.random.default_rng(num)
    return [rng.integers(1, 300, size=int(rng.integers(1, 25))).tolist() for _ in range(num)]


def logits_of_each_step(runner, prompt_list: list[list[int]], num_steps: int) -> list[torch.Tensor]:
    """Prefill every prompt in one step, then decode them together num_steps times, each sequence with the token
    id 7 + step; the logits [B, V] of each decode step (all sequences in one step)."""
    blocks_each = NUM_BLOCKS // len(prompt_list)
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(prompt_list))]
    ids = [f"s{i}" for i in range(len(prompt_list))]
    works = [ScheduledSequence(i, p, 0, t, sample_indices=[len(p) - 1]) for i, p, t in zip(ids, prompt_list, tables)]
    logits_of(runner, StepRequest(works, [NewSequence(i, SamplingParams(), len(p)) for i, p in
                                          zip(ids, prompt_list)]))
    steps = []
    for step in range(num_steps):
        works = [ScheduledSequence(i, [7 + step], len(p) + step, t, sample_indices=[0])
                 for i, p, t in zip(ids, prompt_list, tables)]
        steps.append(logits_of(runner, StepRequest(works)).cpu())
    runner.step(StepRequest(finished_seq_ids=ids))
    return steps


@pytest.mark.parametrize("num_sequences", [1, 3, 5, 13, 33])
def test_padded_decode_steps_give_the_eager_logits(runners, counted, num_sequences):
    """Batches padded to 1, 4, 8, 16 and 48 rows: every row's logits are the eager step's, bit for bit, and the
    decode steps ran on the static buffers."""
    eager, graphs = runners
    calls = counted(graphs)
    batch = prompts(num_sequences)
    expected = logits_of_each_step(eager, batch, 12)
    got = logits_of_each_step(graphs, batch, 12)
    assert calls[0] == 12
    for step, (want, have) in enumerate(zip(expected, got)):
        assert torch.equal(want, have), f"decode step {step}"


def test_padding_rows_leave_every_sequences_kv_alone(runners):
    """After the same steps, every block the scheduler can give out holds the eager runner's keys and values;
    the padding rows wrote only to the scratch block past them."""
    eager, graphs = runners
    batch = prompts(5)  # padded to 8 rows
    logits_of_each_step(eager, batch, 6)
    logits_of_each_step(graphs, batch, 6)
    num_blocks = eager.kv_cache.num_blocks
    assert graphs.kv_cache.num_blocks == num_blocks + 1
    assert graphs.info().num_kv_blocks == eager.info().num_kv_blocks == num_blocks
    for layer in range(len(eager.kv_cache.keys)):
        assert torch.equal(eager.kv_cache.keys[layer], graphs.kv_cache.keys[layer][:num_blocks])
        assert torch.equal(eager.kv_cache.values[layer], graphs.kv_cache.values[layer][:num_blocks])


def test_greedy_decode_matches_generate(runners):
    _, graphs = runners
    blocks = [9, 2, 31, 5, 17, 3, 40, 11]
    got = run_together(graphs, [Decoder("a", PROMPT, blocks, chunks=[3, 5, 3])], 20)["a"]
    assert got == reference_greedy(graphs.model, PROMPT, 20)


def test_batch_invariance(runners):
    assert_batch_invariant(runners[1])


def test_other_steps_run_eagerly(runners, counted):
    """A prefill, a one-token chunk that samples nothing, and a tree beside a chunk: none runs on the static buffers,
    and each gives the eager runner's logits."""
    eager, graphs = runners
    calls = counted(graphs)
    requests = [
        StepRequest([ScheduledSequence("a", PROMPT, 0, [0, 1, 2], sample_indices=[len(PROMPT) - 1])],
                    [NewSequence("a", SamplingParams(), len(PROMPT))]),
        StepRequest([ScheduledSequence("b", PROMPT[:1], 0, [3, 4], sample_indices=[])],
                    [NewSequence("b", SamplingParams(), 3)]),
        StepRequest([ScheduledSequence("a", [9], len(PROMPT), [0, 1, 2, 5], draft=CandidateTree((5, 6, 7), (-1, 0, 0))),
                     ScheduledSequence("b", PROMPT[1:3], 1, [3, 4], sample_indices=[1])]),
    ]
    for request in requests:
        assert torch.equal(logits_of(eager, request).cpu(), logits_of(graphs, request).cpu())
    assert calls[0] == 0
    for runner in (eager, graphs):
        runner.step(StepRequest(finished_seq_ids=["a", "b"]))


def test_more_sequences_than_the_largest_capture_size_run_eagerly(tiny_gemma3_dir, counted):
    largest = CAPTURE_SIZES[-1]
    runner = make_runner(tiny_gemma3_dir, largest + 1, block_size=4, is_cuda_graphs=True)
    calls = counted(runner)
    for num in (largest + 1, largest):
        ids = [f"s{i}" for i in range(num)]
        works = [ScheduledSequence(i, [3], 0, [b], sample_indices=[0]) for b, i in enumerate(ids)]
        runner.step(StepRequest(works, [NewSequence(i, SamplingParams(), 1) for i in ids]))
        runner.step(StepRequest([ScheduledSequence(i, [4], 1, [b], sample_indices=[0]) for b, i in enumerate(ids)]))
        runner.step(StepRequest(finished_seq_ids=ids))
    # one-token prefills are decode-shaped too: the 256 sequences' two steps ran on the buffers, the 257's did not
    assert calls[0] == 2


def test_the_block_tables_growing_does_not_leave_the_steps_reading_the_old_ones(tiny_gemma3_dir):
    """70 live sequences outgrow the block tables' first 64 rows; their decode steps still give the eager
    logits (on CUDA the graphs captured before are dropped)."""
    eager = eager_runner(tiny_gemma3_dir, 2 * 70, block_size=4)
    graphs = make_runner(tiny_gemma3_dir, 2 * 70, block_size=4, is_cuda_graphs=True)
    first = graphs.block_tables.device_table
    logits = {}
    for runner in (eager, graphs):
        steps, computed = logits.setdefault(id(runner), []), {}
        for group in (range(0, 40), range(40, 70)):  # the first 40 decode alone before the others arrive
            ids = [f"s{i}" for i in group]
            works = [ScheduledSequence(f"s{i}", [3, i % 50 + 1], 0, [2 * i, 2 * i + 1], sample_indices=[1])
                     for i in group]
            runner.step(StepRequest(works, [NewSequence(i, SamplingParams(), 2) for i in ids]))
            computed.update((i, 2) for i in group)
            for step in range(3):
                works = [ScheduledSequence(f"s{i}", [5 + step], computed[i], [2 * i, 2 * i + 1], sample_indices=[0])
                         for i in computed]
                steps.append(logits_of(runner, StepRequest(works)).cpu())
                computed = {i: n + 1 for i, n in computed.items()}
    assert graphs.block_tables.device_table is not first
    for want, have in zip(logits[id(eager)], logits[id(graphs)], strict=True):
        assert torch.equal(want, have)


def test_a_growing_context_passes_few_graph_keys(tiny_gemma3_dir):
    """One sequence decoding from 21 to 170 tokens needs the graphs of three key lengths (64, 128 and 256 keys),
    the first of which the warm-up took."""
    runner = make_runner(tiny_gemma3_dir, 64, block_size=4, is_cuda_graphs=True)
    rows = runner.path.graphs.lean.min_tokens  # 1, or 2 with compiled layers (the default on CUDA)
    assert [key[:2] for key in runner.path.graphs.keys] == [(rows, 64)]
    logits_of_each_step(runner, [list(range(1, 21))], 150)
    assert [key[:2] for key in runner.path.graphs.keys] == [(rows, 64), (rows, 128), (rows, 256)]


@pytest.mark.parametrize("is_self_check", [False, True])
def test_the_warm_up_runs_a_step_on_the_graphs(tiny_gemma3_dir, counted, is_self_check):
    """So that on a GPU a capture that cannot work fails the worker's start, not a request; the self-check's two
    decode steps run on them too (worker/self_check.py), checked against transformers'."""
    runner = ModelRunner(WorkerConfig(model=str(tiny_gemma3_dir), num_kv_blocks=8, block_size=4, dtype="float32",
                                      device=TEST_DEVICE, is_cuda_graphs=True, is_self_check=is_self_check))
    calls = counted(runner)
    runner.warm_up()
    assert calls[0] == (3 if is_self_check else 1) and runner.is_ready


def test_graphs_are_on_by_default_on_a_gpu_with_a_lean_decoder(tiny_gemma3_dir):
    is_gpu = torch.device(TEST_DEVICE).type == "cuda"
    assert (make_runner(tiny_gemma3_dir, 16).path.graphs is not None) == is_gpu
    assert make_runner(tiny_gemma3_dir, 16, is_lean_decoder=False).path.graphs is None
    assert make_runner(tiny_gemma3_dir, 16, is_cuda_graphs=False).path.graphs is None
    # the default resolved for either device, whichever this machine has
    assert WorkerConfig().uses_cuda_graphs("cuda", True) and not WorkerConfig().uses_cuda_graphs("cpu", True)
    assert not WorkerConfig().uses_cuda_graphs("cuda", False)
    assert not WorkerConfig(is_cuda_graphs=False).uses_cuda_graphs("cuda", True)
    assert WorkerConfig(is_cuda_graphs=True).uses_cuda_graphs("cpu", True)  # the tests' padded eager steps


@pytest.mark.parametrize("fields", [dict(is_compiled=True), dict(is_lean_decoder=False)])
def test_cuda_graphs_need_the_lean_decoder(fields):
    with pytest.raises(ValueError, match="lean decoder"):
        WorkerConfig(is_cuda_graphs=True, **fields)
