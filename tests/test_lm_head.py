"""The tuned output head computes what nn.Linear computes, whichever layout it picks."""

import pytest
import torch
from torch import nn

from worker.lm_head import LINEAR, TUNED_ROWS, WEIGHT_MAJOR, TunedLinear, install_tuned_head


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("strategy", [LINEAR, WEIGHT_MAJOR])
@pytest.mark.parametrize("num_rows", [0, 1, 2, 3, 16, 70])
def test_every_layout_matches_linear(strategy, num_rows, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 1000, bias=bias)
    head = TunedLinear(linear)
    head.strategy = {rows: strategy for rows in TUNED_ROWS}
    x = torch.randn(1, num_rows, 48)  # [B, M, K] as a causal LM hands it over
    out = head(x)
    assert out.shape == (1, num_rows, 1000)
    torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)


def test_tune_chooses_a_layout_for_every_bucket():
    head = TunedLinear(nn.Linear(32, 256, bias=False))
    choice = head.tune(repeats=1)
    assert set(choice) == set(TUNED_ROWS)
    assert set(choice.values()) <= {LINEAR, WEIGHT_MAJOR}


def test_install_keeps_tied_weights_tied(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    model = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=16, tie_word_embeddings=True))
    tuned = install_tuned_head(model)
    assert model.get_output_embeddings() is tuned
    assert tuned.weight is model.get_input_embeddings().weight
    untied = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    weight = untied.get_output_embeddings().weight
    assert install_tuned_head(untied).weight is weight
