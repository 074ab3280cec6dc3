"""The worker with its decoder compiled (WorkerConfig.is_compiled, worker/compiled.py): the same greedy tokens
as the eager runner, rows bit-identical whatever else shares the step (and whatever bucket it pads to), trees
scored like the eager runner scores them."""

from __future__ import annotations

import pytest
import torch

from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from tests.support.devices import TEST_DEVICE
from tests.support.exact import assert_as_exact_as, exact_last_logits
from tests.worker.test_model_runner import (
    BLOCK_SIZE, PROMPT, ROOT_TOKEN, TREE, Decoder, assert_batch_invariant, logits_of, make_runner, node_paths,
    run_together,
)
from worker.compiled import bucket
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def compiled(tiny_gemma3_dir):
    runner = ModelRunner(WorkerConfig(model=str(tiny_gemma3_dir), num_kv_blocks=64, block_size=BLOCK_SIZE,
                                      dtype="float32", device=TEST_DEVICE, is_compiled=True, compile_max_tokens=16))
    runner.warm_up()
    return runner


@pytest.fixture(scope="module")
def eager(tiny_gemma3_dir):
    return make_runner(tiny_gemma3_dir)


def test_a_step_pads_to_the_next_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 100, 256, 257)] == [1, 2, 4, 4, 8, 8, 16, 128, 256, 512]


def test_greedy_tokens_are_the_eager_runners(compiled, eager):
    """Uneven prefill chunks (3, 5 and 3 tokens: padded to 4, 8 and 4), a scattered block table, 20 tokens past
    the sliding window of 8."""
    assert compiled.path.compiled is not None and not compiled.choice.is_lean  # transformers' forward, traced
    blocks = [9, 2, 31, 5, 17, 3, 40, 11]
    got = run_together(compiled, [Decoder("a", PROMPT, blocks, chunks=[3, 5, 3])], 20)
    assert got == run_together(eager, [Decoder("a", PROMPT, blocks, chunks=[3, 5, 3])], 20)


def test_batch_invariance(compiled):
    assert_batch_invariant(compiled)


def _decode_row(runner: ModelRunner, others: int) -> torch.Tensor:
    """The logits of one decode token of PROMPT, computed with `others` other sequences' decode tokens."""
    seqs = [("x", PROMPT, (50, 51, 52))]
    seqs += [(f"o{i}", PROMPT[: 4 + i], (30 + 2 * i, 31 + 2 * i)) for i in range(others)]
    for seq_id, prompt, blocks in seqs:  # one prefill each: buckets of at most 16 tokens, compiled already
        runner.step(StepRequest([ScheduledSequence(seq_id, prompt, 0, blocks)],
                                [NewSequence(seq_id, SamplingParams(), len(prompt))]))
    decode = [ScheduledSequence(s, [5], len(p), b, sample_indices=[0]) for s, p, b in seqs]
    logits = logits_of(runner, StepRequest(decode))
    runner.step(StepRequest(finished_seq_ids=[s for s, _, _ in seqs]))
    return logits[0]


def test_a_row_is_bit_identical_alone_and_padded_among_others(compiled):
    alone = _decode_row(compiled, 0)  # 1 token: no padding
    assert torch.equal(_decode_row(compiled, 2), alone)  # 3 tokens padded to 4
    assert torch.equal(_decode_row(compiled, 4), alone)  # 5 tokens padded to 8


def test_a_tree_scores_like_the_eager_runners(compiled, eager):
    context = PROMPT + [200, 201, 202, 203]
    blocks = (20, 3, 44, 9, 30, 1)

    def tree_logits(runner: ModelRunner) -> torch.Tensor:
        runner.step(StepRequest([ScheduledSequence("t", context, 0, blocks)],
                                [NewSequence("t", SamplingParams(), len(context))]))
        logits = logits_of(runner, StepRequest([ScheduledSequence("t", (ROOT_TOKEN,), len(context), blocks,
                                                                  draft=TREE)]))
        runner.step(StepRequest(finished_seq_ids=["t"]))
        return logits

    got, expected = tree_logits(compiled), tree_logits(eager)
    rows = [context + path for path in node_paths(TREE)]
    assert_as_exact_as(got, expected, exact_last_logits(eager.config.model, rows))


def test_two_compiled_runners_in_one_process_each_run_their_own_weights(tiny_gemma3_dir, tmp_path):
    """A compiled bucket runs with only the guards that tell the compiled graphs apart; two runners of one model
    class with other weights (frozen into their graphs as constants) must still each get their own graph."""
    from tests.support.tiny_models import build_tiny_gemma3

    other_dir = build_tiny_gemma3(tmp_path / "other", seed=1)
    runners = {name: ModelRunner(WorkerConfig(model=str(path), num_kv_blocks=8, block_size=BLOCK_SIZE,
                                              dtype="float32", device=TEST_DEVICE, is_compiled=True,
                                              compile_max_tokens=4))
               for name, path in (("a", tiny_gemma3_dir), ("b", other_dir))}
    eagers = {"a": make_runner(tiny_gemma3_dir), "b": make_runner(other_dir)}
    for runner in runners.values():
        runner.warm_up()

    def decode_logits(runner: ModelRunner) -> torch.Tensor:
        prompt = PROMPT[:3]  # prefill in the bucket of 4, decode in the bucket of 1: both compiled in the warm-up
        runner.step(StepRequest([ScheduledSequence("s", prompt, 0, (1, 2))],
                                [NewSequence("s", SamplingParams(), len(prompt))]))
        logits = logits_of(runner, StepRequest([ScheduledSequence("s", [5], len(prompt), (1, 2),
                                                                  sample_indices=[0])]))
        runner.step(StepRequest(finished_seq_ids=["s"]))
        return logits[0]

    expected = {name: decode_logits(eager) for name, eager in eagers.items()}
    assert not torch.allclose(expected["a"], expected["b"], atol=1e-2)
    exact = {name: exact_last_logits(eager.config.model, [PROMPT[:3] + [5]]) for name, eager in eagers.items()}
    for name in ("a", "b", "a", "b"):  # each bucket called again, alternating runners
        assert_as_exact_as(decode_logits(runners[name])[None], expected[name][None], exact[name])


def test_packed_linears_compile_to_the_eager_runners_tokens(tiny_gemma3_dir, monkeypatch):
    """With every weight packed for oneDNN (as gemma-3-270m's are: the tiny model's are too small to be, by
    default), the compiled decoder traces the packed products and gives the eager runner's greedy tokens."""
    from worker import packed_linear

    monkeypatch.setattr(packed_linear, "PACKING_MIN_WEIGHTS", 0)
    compiled = ModelRunner(WorkerConfig(model=str(tiny_gemma3_dir), num_kv_blocks=16, block_size=BLOCK_SIZE,
                                        dtype="float32", device=TEST_DEVICE, is_compiled=True, compile_max_tokens=4))
    compiled.warm_up()
    eager = make_runner(tiny_gemma3_dir, num_kv_blocks=16)
    layer = compiled.model.model.layers[0]
    is_packing = packed_linear.is_packing_supported(torch.device(TEST_DEVICE), torch.float32)
    assert isinstance(layer.mlp.down_proj, packed_linear.PackedLinear) == is_packing
    blocks = [3, 1, 7, 5]
    got = run_together(compiled, [Decoder("a", PROMPT[:4], blocks)], 12)
    assert got == run_together(eager, [Decoder("a", PROMPT[:4], blocks)], 12)
