"""Models with random weights that `segserve bench engine` builds on the fly: the tests' tiny Gemma3 (--tiny),
gemma-3-270m's exact shape (--random-weights) for a machine without the default model's package, and
Llama-3.1-8B's (--random-weights --random-shape llama-3.1-8b) for the GPU path at 8B scale. A forward costs what the
real model's costs; the text means nothing."""

from __future__ import annotations

from pathlib import Path

GEMMA3_270M = dict(
    vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3, max_position_embeddings=32_768,
    rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
    bos_token_id=2, eos_token_id=1, pad_token_id=0,
)
"""gemma-3-270m's text config (the converted default model's config.json, less what a forward does not read)."""


TINY_GEMMA3 = dict(
    vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    max_position_embeddings=4096,
    # Wide init and an untied head give varied, well-separated greedy choices
    # (the default init makes a tiny random model repeat one token).
    initializer_range=0.3,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
"""The tests' tiny Gemma3 (tests/support/tiny_models.py builds it beside its tokenizer): a sliding window of 8 that
tests cross; ids 0-2 are the tokenizer's pad, bos and eos."""


def save_random(model_cls, config, out_dir: Path, seed: int = 0, device=None, dtype=None) -> Path:
    """model_cls(config) with seeded random weights (initialized on `device`, cast to `dtype` where given), saved
    to out_dir with its config's eos_token_id as the generation config's."""
    import torch

    torch.manual_seed(seed)
    with torch.device(device or "cpu"):
        model = model_cls(config)
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(out_dir)
    return out_dir


def build_tiny_gemma3(out_dir: Path, seed: int = 0) -> Path:
    """The tests' tiny Gemma3 with random weights, without a tokenizer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return save_random(Gemma3ForCausalLM, Gemma3TextConfig(**TINY_GEMMA3), out_dir, seed)


def build_random_gemma3_270m(out_dir: Path, seed: int = 0, device: str = "auto", dtype: str = "auto") -> Path:
    """gemma-3-270m's shape with random weights (initialized on `device`, saved in `dtype`: auto = bfloat16 on
    cuda, float32 on cpu), without a tokenizer."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from worker.config import WorkerConfig
    from worker.loading import resolve_device_dtype

    torch_device, torch_dtype = resolve_device_dtype(WorkerConfig(device=device, dtype=dtype))
    return save_random(Gemma3ForCausalLM, Gemma3TextConfig(**GEMMA3_270M), out_dir, seed, torch_device, torch_dtype)


LLAMA_31_8B = dict(
    vocab_size=128_256, hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=131_072, rms_norm_eps=1e-5, hidden_act="silu",
    rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bos_token_id=128_000, eos_token_id=128_001,
)
"""Llama-3.1-8B's config (meta-llama/Llama-3.1-8B's config.json): 8.03B parameters, 16 GB in bfloat16."""


def build_random_llama_31_8b(out_dir: Path, seed: int = 0, device: str = "auto", dtype: str = "auto") -> Path:
    """Llama-3.1-8B's shape with random weights, as build_random_gemma3_270m builds its shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from worker.config import WorkerConfig
    from worker.loading import resolve_device_dtype

    torch_device, torch_dtype = resolve_device_dtype(WorkerConfig(device=device, dtype=dtype))
    return save_random(LlamaForCausalLM, LlamaConfig(**LLAMA_31_8B), out_dir, seed, torch_device, torch_dtype)


RANDOM_SHAPES = {"gemma-3-270m": build_random_gemma3_270m, "llama-3.1-8b": build_random_llama_31_8b}
"""--random-shape -> the builder of that shape with random weights."""
