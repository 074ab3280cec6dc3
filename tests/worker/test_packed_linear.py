"""Packed linear layers compute what nn.Linear computes (their batch invariance, on row blocks: tests/worker/test_row_blocks.py)."""

import pytest
import torch
from torch import nn

from tests.support.exact import assert_as_exact_as, assert_linear_within_rounding
from worker.packed_linear import (PACKING_MIN_WEIGHTS, MergedLinearPart, PackedLinear, is_packing_supported,
                                  pack_linears)

pytestmark = pytest.mark.skipif(not is_packing_supported(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [0, 1, 2, 3, 16, 70])
def test_matches_linear(num_rows, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 1000, bias=bias)
    x = torch.randn(1, num_rows, 48)  # [B, M, K] as a causal LM hands it over
    with torch.inference_mode():
        out = PackedLinear(linear)(x)
        assert out.shape == (1, num_rows, 1000)
        assert_linear_within_rounding(out, x, linear.weight, linear.bias)


def test_bfloat16_matches_linear_where_supported():
    if not is_packing_supported(torch.device("cpu"), torch.bfloat16):
        pytest.skip("this CPU has no bf16 oneDNN path")
    linear = nn.Linear(64, 128).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert_linear_within_rounding(PackedLinear(linear)(x), x, linear.weight, linear.bias)


def test_unsupported_devices_and_dtypes_are_left_alone():
    model = nn.Sequential(nn.Linear(8, 8).half(), nn.Linear(8, 8, device="meta"))
    assert pack_linears(model) == 0
    assert type(model[0]) is nn.Linear and type(model[1]) is nn.Linear


def test_packing_a_model_keeps_tied_weights_tied_and_outputs_equal(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    model = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=16, tie_word_embeddings=True))
    assert pack_linears(model, min_weights=0) == 8  # q, k, v, o, gate, up, down, head
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(isinstance(m, MergedLinearPart) for m in (attention.q_proj, attention.k_proj, attention.v_proj,
                                                         mlp.gate_proj, mlp.up_proj))
    assert isinstance(attention.o_proj, PackedLinear) and isinstance(mlp.down_proj, PackedLinear)
    assert isinstance(model.get_output_embeddings(), PackedLinear)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight

    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    packed = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    assert pack_linears(packed, min_weights=0) > 0
    input_ids = torch.arange(3, 40).unsqueeze(0)
    exact = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float64).eval()
    with torch.inference_mode():
        assert_as_exact_as(packed(input_ids).logits[0], reference(input_ids).logits[0], exact(input_ids).logits[0])


class Siblings(nn.Module):
    """Three linears on one input size, as an attention module's q, k and v projections."""

    def __init__(self, bias: bool):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(48, n, bias=bias) for n in (64, 32, 32))


@pytest.mark.parametrize("bias", [False, True])
def test_merged_siblings_each_return_their_own_linear_of_their_own_input(bias):
    torch.manual_seed(0)
    siblings = Siblings(bias)
    reference = {name: PackedLinear(getattr(siblings, name)) for name in ("q_proj", "k_proj", "v_proj")}  # apart
    assert pack_linears(siblings, min_weights=0) == 3
    parts = {name: getattr(siblings, name) for name in reference}
    assert all(isinstance(part, MergedLinearPart) for part in parts.values())
    x, y = torch.randn(1, 5, 48), torch.randn(1, 5, 48)
    with torch.inference_mode():
        for calls in ([("q_proj", x), ("k_proj", x), ("v_proj", x)],  # the model's order: one product
                      [("v_proj", x), ("q_proj", x), ("k_proj", x)],  # any order
                      [("q_proj", x), ("k_proj", y), ("v_proj", x)],  # another input in between
                      [("q_proj", x), ("q_proj", x), ("k_proj", x)],  # one part twice, one never
                      [("k_proj", y)]):
            for name, inputs in calls:
                part = parts[name]
                assert_linear_within_rounding(part(inputs), inputs, part.weight, part.bias)
                assert_linear_within_rounding(reference[name](inputs), inputs, part.weight, part.bias)


def test_a_merged_part_row_does_not_depend_on_the_rest_of_the_batch():
    torch.manual_seed(0)
    siblings = Siblings(bias=False)
    pack_linears(siblings, min_weights=0)
    x = torch.randn(64, 48)
    with torch.inference_mode():
        full = [siblings.q_proj(x), siblings.k_proj(x), siblings.v_proj(x)]
        for num_rows in (1, 2, 5, 16, 33):
            rows = x[:num_rows].clone()
            assert torch.equal(siblings.q_proj(rows), full[0][:num_rows])
            assert torch.equal(siblings.k_proj(rows), full[1][:num_rows])
            assert torch.equal(siblings.v_proj(rows), full[2][:num_rows])


def test_siblings_that_differ_are_packed_apart():
    siblings = Siblings(bias=False)
    siblings.v_proj = nn.Linear(48, 32, bias=True)  # a bias where the others have none
    assert pack_linears(siblings, min_weights=0) == 3
    assert all(isinstance(getattr(siblings, name), PackedLinear) for name in ("q_proj", "k_proj", "v_proj"))


def test_small_weights_stay_torchs_and_small_siblings_merge_on_torchs_linear():
    torch.manual_seed(0)
    side = int(PACKING_MIN_WEIGHTS ** 0.5)
    model = nn.Module()
    model.small, model.large = nn.Linear(side, side - 1), nn.Linear(side, side)
    model.attention = Siblings(bias=True)  # 48 x (64 + 32 + 32): merged, not packed
    x = torch.randn(1, 3, side)
    assert pack_linears(model) == 1 + 3
    assert type(model.small) is nn.Linear and isinstance(model.large, PackedLinear)
    parts = [model.attention.q_proj, model.attention.k_proj, model.attention.v_proj]
    assert all(isinstance(part, MergedLinearPart) for part in parts)
    assert not parts[0]._product.is_packed
    y = torch.randn(2, 48)
    with torch.inference_mode():
        assert_linear_within_rounding(model.large(x), x, model.large.weight, model.large.bias)
        for part in parts:
            assert_linear_within_rounding(part(y), y, part.weight, part.bias)
