"""Fused RMSNorm modules compute what transformers' compute (bit for bit on the CPU), row by row
independently of the batch."""

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from tests.support.devices import TEST_DEVICE
from worker.fused_norm import FusedRMSNorm, StackedRMSNorm, fuse_rms_norms, is_known_norm


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-identical on the CPU; on CUDA the fused kernel sums in another order."""
    if TEST_DEVICE == "cpu":
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("model_fixture, num_norms", [("tiny_gemma3_dir", 4 * 6 + 1), ("tiny_llama_dir", None)])
def test_a_fused_model_gives_the_logits_of_the_stock_one(request, model_fixture, num_norms):
    model_dir = request.getfixturevalue(model_fixture)
    stock = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(TEST_DEVICE).eval()
    fused = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(TEST_DEVICE).eval()
    num_stock = sum(is_known_norm(m) for m in stock.modules())
    assert fuse_rms_norms(fused) == num_stock > 0 and num_stock == (num_norms or num_stock)
    assert not any(is_known_norm(m) for m in fused.modules())
    input_ids = torch.randint(3, stock.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = stock(input_ids.to(TEST_DEVICE)).logits
        actual = fused(input_ids.to(TEST_DEVICE)).logits
    _assert_same(actual, expected)


@pytest.mark.parametrize("model_fixture", ["tiny_gemma3_dir", "tiny_llama_dir"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_fused_norm_matches_its_module_and_ignores_the_rest_of_the_batch(request, model_fixture, dtype):
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(model_fixture), dtype=dtype)
    norm = next(m for m in model.modules() if is_known_norm(m))
    with torch.no_grad():
        norm.weight.normal_(generator=torch.Generator().manual_seed(1))  # the checkpoint's are all 0 or 1
    norm = norm.to(TEST_DEVICE)
    fused = FusedRMSNorm(norm)
    x = torch.randn(1, 70, norm.weight.shape[-1], generator=torch.Generator().manual_seed(2)).to(TEST_DEVICE, dtype)
    with torch.inference_mode():
        full = fused(x)
        if dtype == torch.float32:
            _assert_same(full, norm(x))
        else:  # a bf16 result rounds differently where the fused op multiplies in float32
            torch.testing.assert_close(full, norm(x), rtol=2e-2, atol=2e-2)
        for num_rows in (1, 2, 5, 33):
            assert torch.equal(fused(x[:, :num_rows]), full[:, :num_rows])


@pytest.mark.parametrize("model_fixture", ["tiny_gemma3_dir", "tiny_llama_dir"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_fused_first", [True, False])
def test_stacked_norms_give_each_norm_on_its_own_heads(request, model_fixture, dtype, is_fused_first):
    """Two norms of one size over 3 and 2 heads of one tensor: each head's rows as its own norm gives them."""
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(model_fixture), dtype=dtype)
    first, second = [m for m in model.modules() if is_known_norm(m)][:2]
    with torch.no_grad():
        for seed, norm in enumerate((first, second)):  # the checkpoint's are all 0 or 1, and equal
            norm.weight.normal_(generator=torch.Generator().manual_seed(seed))
    first, second = first.to(TEST_DEVICE), second.to(TEST_DEVICE)
    if is_fused_first:
        first, second = FusedRMSNorm(first), FusedRMSNorm(second)
    stacked = StackedRMSNorm([(first, 3), (second, 2)])
    size = first.weight.shape[-1]
    x = torch.randn(1, 7, 5, size, generator=torch.Generator().manual_seed(2)).to(TEST_DEVICE, dtype)
    with torch.inference_mode():
        out = stacked(x)
        one, two = (norm if is_fused_first else FusedRMSNorm(norm) for norm in (first, second))
        assert out.dtype == dtype
        _assert_same(out[:, :, :3], one(x[:, :, :3]))
        _assert_same(out[:, :, 3:], two(x[:, :, 3:]))
        assert torch.equal(stacked(x[:, :2]), out[:, :2])  # rows stay independent


def test_norms_of_other_formulas_or_sizes_are_not_stacked(tiny_gemma3_dir, tiny_llama_dir):
    gemma = next(m for m in AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir).modules() if is_known_norm(m))
    llama = next(m for m in AutoModelForCausalLM.from_pretrained(tiny_llama_dir).modules() if is_known_norm(m))
    with pytest.raises(ValueError, match="one formula"):
        StackedRMSNorm([(gemma, 1), (llama, 1)])


def test_a_namesake_from_outside_transformers_is_left_alone():
    class LlamaRMSNorm(nn.Module):  # same name, another formula
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.weight

    model = nn.Sequential(LlamaRMSNorm())
    assert fuse_rms_norms(model) == 0 and type(model[0]) is LlamaRMSNorm
