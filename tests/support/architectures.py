"""Tiny random checkpoints of many transformers architectures, each with the tests' tokenizer: the served ones and
the ones the worker refuses (tests/worker/test_architectures.py)."""

from __future__ import annotations

from pathlib import Path

from segserve.bench.random_models import save_random
from tests.support.tiny_models import (
    LLAMA_KIN, build_tiny_gemma3, build_tiny_llama, build_tiny_llama_kin, build_tokenizer,
)

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=False)
"""What most of the tiny configs share (wide init: varied greedy choices)."""
GQA = dict(num_key_value_heads=2)

ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "phi3": ("Phi3", GQA),
    "gemma2": ("Gemma2", dict(**GQA, head_dim=16, sliding_window=8, query_pre_attn_scalar=16)),
    "olmo": ("Olmo", GQA),
    "granite": ("Granite", GQA),
    "qwen3_moe": ("Qwen3Moe", dict(**GQA, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "gpt_oss": ("GptOss", dict(**GQA, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"])),
    "gpt2": ("GPT2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, initializer_range=0.3)),
    "gpt_neox": ("GPTNeoX", dict(rotary_pct=0.5, use_parallel_residual=True)),
    "bloom": ("Bloom", dict(n_embd=64, n_layer=2, n_head=4, initializer_range=0.3, max_position_embeddings=None)),
    "lfm2": ("Lfm2", dict(**GQA, layer_types=["conv", "full_attention"], block_dim=64, block_ff_dim=128,
                          conv_L_cache=3)),
    "deepseek_v2": ("DeepseekV2", dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                                       qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                       n_group=1, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32)),
    "deepseek_v3": ("DeepseekV3", dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                                       qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                       topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32)),
    "falcon_h1": ("FalconH1", dict(**GQA, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                                   mamba_n_groups=1, mamba_chunk_size=8, head_dim=16)),
    "jamba": ("Jamba", dict(**GQA, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
                            expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
                            mamba_expand=2)),
    "qwen3_next": ("Qwen3Next", dict(**GQA, head_dim=16, layer_types=["linear_attention", "full_attention"],
                                     linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                                     linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "bamba": ("Bamba", dict(**GQA, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                            mamba_chunk_size=8, mamba_expand=1, attn_layer_indices=[1])),
    "granitemoehybrid": ("GraniteMoeHybrid", dict(**GQA, layer_types=["mamba", "attention"], mamba_n_heads=4,
                                                  mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                                                  mamba_chunk_size=8, mamba_expand=1, num_local_experts=0,
                                                  shared_intermediate_size=128)),
}
"""name -> (transformers class prefix, config overrides on COMMON)."""


LEAN = ("gemma3", "llama", *LLAMA_KIN)
"""The architectures with a lean decoder (worker/lean_decoder.py), built as the other tests build them."""


def build_architecture(name: str, out_dir: Path, seed: int = 0) -> Path:
    """The tiny `name` model (LEAN or ARCHITECTURES) with random weights and the tests' tokenizer in out_dir."""
    import transformers

    if name in LEAN:
        return (build_tiny_gemma3(out_dir, seed) if name == "gemma3" else build_tiny_llama(out_dir, seed)
                if name == "llama" else build_tiny_llama_kin(out_dir, name, seed))

    prefix, overrides = ARCHITECTURES[name]
    tokenizer = build_tokenizer(out_dir)
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForCausalLM", None) or getattr(transformers, f"{prefix}LMHeadModel")
    config = config_cls(**{**COMMON, **overrides}, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return save_random(model_cls, config, out_dir, seed)


DISPLAY_NAMES = {"gemma3": "Gemma 3", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
                 "phi3": "Phi-3", "gemma2": "Gemma 2", "olmo": "OLMo", "granite": "Granite", "qwen3_moe": "Qwen3-MoE",
                 "gpt_oss": "GPT-OSS", "gpt2": "GPT-2", "gpt_neox": "GPT-NeoX", "bloom": "Bloom", "lfm2": "LFM2",
                 "falcon_h1": "Falcon-H1", "deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3", "jamba": "Jamba",
                 "qwen3_next": "Qwen3-Next", "bamba": "Bamba", "granitemoehybrid": "Granite 4.0 (GraniteMoeHybrid)"}
"""How the docs name each architecture."""
