"""Tuned linear layers compute what nn.Linear computes, whichever layout they pick."""

import pytest
import torch
from torch import nn

from worker.tuned_linear import LINEAR, TUNED_ROWS, WEIGHT_MAJOR, TunedLinear, install_tuned_linears, tune_all


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("strategy", [LINEAR, WEIGHT_MAJOR])
@pytest.mark.parametrize("num_rows", [0, 1, 2, 3, 16, 70])
def test_every_layout_matches_linear(strategy, num_rows, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 1000, bias=bias)
    layer = TunedLinear(linear)
    layer.strategy = {rows: strategy for rows in TUNED_ROWS}
    x = torch.randn(1, num_rows, 48)  # [B, M, K] as a causal LM hands it over
    out = layer(x)
    assert out.shape == (1, num_rows, 1000)
    torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)


def test_tuning_covers_every_bucket_and_shares_choices_by_shape():
    model = nn.Sequential(nn.Linear(32, 256, bias=False), nn.ReLU(), nn.Linear(256, 32), nn.Linear(32, 256))
    layers = install_tuned_linears(model, min_bytes=0)
    assert len(layers) == 3 and all(isinstance(m, TunedLinear) for m in (model[0], model[2], model[3]))
    choices = tune_all(layers)
    assert set(choices) == {(256, 32), (32, 256)}
    for choice in choices.values():
        assert set(choice) == set(TUNED_ROWS) and set(choice.values()) <= {LINEAR, WEIGHT_MAJOR}
    assert model[0].strategy == model[3].strategy == choices[(256, 32)]


def test_only_large_weights_are_tuned_by_default():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(4096, 4096, device="meta"))
    model[1].to_empty(device="cpu")  # 64 MiB of fp32
    layers = install_tuned_linears(model)
    assert layers == [model[1]] and type(model[0]) is nn.Linear


def test_install_keeps_tied_weights_tied_and_outputs_equal(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    model = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=16, tie_word_embeddings=True))
    install_tuned_linears(model, min_bytes=0)
    assert isinstance(model.get_output_embeddings(), TunedLinear)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight

    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tuned = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    tune_all(install_tuned_linears(tuned, min_bytes=0))
    input_ids = torch.arange(3, 40).unsqueeze(0)
    with torch.inference_mode():
        torch.testing.assert_close(tuned(input_ids).logits, reference(input_ids).logits, rtol=1e-4, atol=1e-4)
