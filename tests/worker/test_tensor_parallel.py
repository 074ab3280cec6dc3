"""Tensor parallelism (worker/tensor_parallel.py, worker/ranks.py): a worker of two ranks, gloo between two CPU
processes, against the same model on one.

For every architecture with a lean decoder (the tiny models split their two key-value heads; gemma-3-270m's one is
given to both ranks): logits in fp32 on prefills, decodes and trees as close to the float64 forward as one device's
(tests/support/exact.py: a sum split over two ranks rounds differently from one device's, by an amount that
depends on the CPU's kernels, so no absolute tolerance is right on every machine), with the same greedy token on
every row; and greedy output with speculation identical to transformers' `generate` through the scheduler, the
drafter and the worker. Bad configurations fail before any rank starts, naming what does not divide."""

from __future__ import annotations

import gc

import pytest
import torch

from protos.segserve.v1.step import StepRequest
from tests.e2e.test_spec_lossless import TINY_PROMPTS, check_lossless, reference
from tests.support.devices import TEST_DEVICE
from tests.support.exact import assert_as_exact_as, exact_logits
from tests.worker.test_lean_decoder import PROMPTS, steps
from tests.worker.test_model_runner import ARCHITECTURES, BLOCK_SIZE
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner
from worker.ranks import rank_device
from worker import sharded_load
from worker.sharded_load import check_shardable
from worker.tensor_parallel import HeadLayout, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead

pytestmark = pytest.mark.skipif(TEST_DEVICE == "cuda" and torch.cuda.device_count() < 2,
                                reason="two ranks on CUDA need two devices")


def runner_of(model_dir, tensor_parallel_size: int, **fields) -> ModelRunner:
    config = WorkerConfig(model=str(model_dir), num_kv_blocks=256, block_size=BLOCK_SIZE, dtype="float32",
                          device=TEST_DEVICE, tensor_parallel_size=tensor_parallel_size, **fields)
    runner = ModelRunner(config)
    runner.warm_up()
    return runner


@pytest.fixture(scope="module", params=ARCHITECTURES)
def architecture(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(architecture, request):
    return request.getfixturevalue(f"tiny_{architecture}_dir")


@pytest.fixture(scope="module")
def exact(model_dir):
    """The float64 forward's logits for each step of `steps()`."""
    return exact_logits(model_dir, steps())


@pytest.fixture(scope="module")
def runners(model_dir):
    """(one device, two ranks) on the same tiny model."""
    two = runner_of(model_dir, 2)
    yield runner_of(model_dir, 1), two
    two.close()


def assert_as_exact_as_one_device(one: ModelRunner, two: ModelRunner, requests: list[StepRequest],
                                  exact: list[torch.Tensor]) -> None:
    """Two ranks' logits over all the steps no further from the float64 forward than one device's."""
    assert_as_exact(logits_of(two, requests), logits_of(one, requests), exact)


def assert_as_exact(actual: list[torch.Tensor], expected: list[torch.Tensor], exact: list[torch.Tensor]) -> None:
    assert [rows.shape for rows in actual] == [rows.shape for rows in expected]
    assert_as_exact_as(torch.cat(actual), torch.cat(expected), torch.cat(exact))


def logits_of(runner: ModelRunner, requests: list[StepRequest]) -> list[torch.Tensor]:
    """The runner's logits of each step; its sequences are finished after."""
    logits = [runner.forward(request) for request in requests]
    runner.step(StepRequest(finished_seq_ids=list(PROMPTS)))
    return logits


def test_two_ranks_are_as_exact_as_one_device(runners, exact):
    one, two = runners
    assert_as_exact_as_one_device(one, two, steps(), exact)


def test_each_rank_holds_its_share_of_the_weights_and_the_kv_cache(runners):
    one, two = runners
    text = one.model.config.get_text_config()
    assert two.kv_cache.shape.num_kv_heads == text.num_key_value_heads // 2
    assert two.info().vocab_size == one.info().vocab_size
    attn, mlp = two.model.model.layers[0].self_attn, two.model.model.layers[0].mlp
    assert isinstance(attn.o_proj, RowParallelLinear) and isinstance(mlp.down_proj, RowParallelLinear)
    assert isinstance(two.model.get_input_embeddings(), VocabParallelEmbedding)
    assert isinstance(two.model.get_output_embeddings(), VocabParallelHead)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    # the tiny models' weights are too small to pack (worker/packed_linear.py): each keeps its own Linear
    assert attn.q_proj.weight.shape[0] == text.num_attention_heads * head_dim // 2
    assert mlp.down_proj.linear.weight.shape[1] == text.intermediate_size // 2
    # every rank's parameters are about half the model's: the norms are whole, everything else split
    halves = sum(p.numel() for p in two.model.parameters()) / sum(p.numel() for p in one.model.parameters())
    assert 0.5 <= halves < 0.55


async def test_greedy_speculation_through_the_stack_is_transformers_generate(runners, model_dir):
    _, two = runners
    references = reference(model_dir, TINY_PROMPTS, 16)
    await check_lossless(two, model_dir, references, "best_first", "both", 16)


def test_the_fast_paths_run_on_two_ranks(tiny_gemma3_dir):
    """Decode steps on the graphs' static buffers (on the CPU: the same padded steps, eager) and the layers
    compiled around their attention, the all-reduces inside the compiled code: as exact as one device's plain eager
    runner."""
    one = runner_of(tiny_gemma3_dir, 1)
    two = runner_of(tiny_gemma3_dir, 2, is_cuda_graphs=True, is_compiled_layers=True)
    try:
        assert two.path.graphs is not None and two.choice.is_compiled_layers
        lean = two.path.decode
        for region in (lean.before_attention, lean.after_attention):  # compiled, all-reduces and all
            assert region._is_compiled and region._compiled is not region._fn, region.name
        assert_as_exact_as_one_device(one, two, steps(), exact_logits(tiny_gemma3_dir, steps()))
    finally:
        two.close()


@pytest.mark.real_model
def test_the_default_model_on_two_ranks_is_as_exact_as_one_device(default_model_dir):
    """gemma-3-270m has one key-value head: both ranks hold it, each with two of the four query heads.

    Its logits (up to ~76) carry fp32 rounding of ~4e-4 whatever adds them up: transformers' own fp32 forward and
    the one-device runner differ by 7e-4. Two ranks are held to the float64 forward as the tiny models are.

    One model at a time: the float64 one, the one device's, then the two ranks' (held together, with the float64
    model loading, they made this the suite's largest process, 7.6 GB)."""
    exact = exact_logits(default_model_dir, steps())
    one = runner_of(default_model_dir, 1)
    expected = logits_of(one, steps())
    del one
    gc.collect()
    two = runner_of(default_model_dir, 2)
    try:
        assert two.kv_cache.shape.num_kv_heads == 1
        assert_as_exact(logits_of(two, steps()), expected, exact)
    finally:
        two.close()


@pytest.mark.real_model
async def test_the_default_model_on_two_ranks_is_lossless(default_model_dir):
    references = reference(default_model_dir, ["The capital of France is", "def fibonacci(n):\n    "], 12)
    two = runner_of(default_model_dir, 2)  # after transformers' model is gone
    try:
        await check_lossless(two, default_model_dir, references, "best_first", "corpus", 12)
    finally:
        two.close()


def test_sizes_that_do_not_divide_fail_before_any_rank_starts(tiny_gemma3_dir):
    with pytest.raises(ValueError, match="does not divide its 4 attention heads"):
        ModelRunner(WorkerConfig(model=str(tiny_gemma3_dir), num_kv_blocks=16, device="cpu", tensor_parallel_size=3))
    with pytest.raises(ValueError, match="key-value heads"):
        HeadLayout(num_heads=8, num_kv_heads=3, head_dim=4, size=2).check(64, "llama")
    with pytest.raises(ValueError, match="MLP's 100 columns"):
        HeadLayout(num_heads=8, num_kv_heads=8, head_dim=4, size=8).check(100, "llama")
    HeadLayout(num_heads=4, num_kv_heads=1, head_dim=4, size=4).check(64, "gemma3")  # one head given to all


def test_a_layout_gives_each_rank_its_own_heads_or_the_one_it_reads():
    split = HeadLayout(num_heads=8, num_kv_heads=4, head_dim=2, size=2)
    assert [(s.start, s.stop) for s in map(split.query_rows, range(2))] == [(0, 8), (8, 16)]
    assert [(s.start, s.stop) for s in map(split.kv_rows, range(2))] == [(0, 4), (4, 8)]
    shared = HeadLayout(num_heads=8, num_kv_heads=2, head_dim=2, size=4)  # two query heads per rank, one kv head
    assert [(s.start, s.stop) for s in map(shared.kv_rows, range(4))] == [(0, 2), (0, 2), (2, 4), (2, 4)]


def test_an_architecture_without_a_lean_decoder_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="tensor parallelism serves .* is GPT2LMHeadModel"):
        check_shardable(tmp_path, 2)


def test_more_ranks_than_cuda_devices_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert rank_device(torch.device("cuda"), 0) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="this machine has 1 CUDA devices"):
        rank_device(torch.device("cuda"), 1)
    assert rank_device(torch.device("cpu"), 3) == torch.device("cpu")


def test_the_config_refuses_what_two_ranks_cannot_run():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        WorkerConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="runs the lean decoder"):
        WorkerConfig(tensor_parallel_size=2, is_compiled=True)


class _Ranks:
    """A RankGroup's place without its collectives: what loading a shard reads."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size


def test_a_rank_reads_only_its_slice_of_each_tensor(tiny_gemma3_dir, tmp_path, monkeypatch):
    """Across checkpoint files (an index of several), in the dtype asked for: the bytes a rank reads are its half
    of the split tensors plus the whole small ones (norms), and both ranks' shards together are the model."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir).save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    whole = {}
    for path in tmp_path.glob("*.safetensors"):
        whole.update(load_file(path))
    whole_bytes = sum(t.numel() * t.element_size() for t in whole.values())
    read = []
    original = sharded_load.Checkpoint.read

    def counting(self, key, shard, dtype, device):
        tensor = original(self, key, shard, dtype, device)
        read.append((key, tensor))
        return tensor

    monkeypatch.setattr(sharded_load.Checkpoint, "read", counting)
    halves = [sharded_load.load_shard(tmp_path, torch.bfloat16, torch.device("cpu"), _Ranks(rank, 2))
              for rank in range(2)]
    for model in halves:
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # the elements each rank read, at the checkpoint's float32 bytes: about half the checkpoint
    per_rank = sum(t.numel() for _, t in read) / 2 * 4
    assert 0.5 * whole_bytes <= per_rank < 0.55 * whole_bytes
    key = "model.layers.0.self_attn.q_proj.weight"
    q = [model.model.layers[0].self_attn.q_proj.weight for model in halves]
    torch.testing.assert_close(torch.cat(q).float(), whole[key].to(torch.bfloat16).float(), rtol=0, atol=0)
    down = [model.model.layers[0].mlp.down_proj.linear.weight for model in halves]
    torch.testing.assert_close(torch.cat(down, dim=1), whole["model.layers.0.mlp.down_proj.weight"].bfloat16())
