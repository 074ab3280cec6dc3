"""Multi-head latent attention served from its latent: DeepSeek-V3's KV cache holds each token's latent, not every
head's key and value.

transformers' DeepseekV3Attention compresses each token into a latent c (kv_lora_rank wide, normed) and a rotary key
k_rot (qk_rope_head_dim wide, shared by the heads), then expands both with kv_b_proj into every head's key
[k_nope; k_rot] and value, and attends. Cached expanded, a token takes H (qk_nope + qk_rope + v) numbers per layer
(DeepSeek-V3: 128 x 320 = 40,960). So each such layer's forward is replaced (`attach`): kv_b_proj's key half W_UK is
absorbed into the query (q_nope W_UK, a query in the latent's space), the paged cache holds one KV head per token,
key [c; k_rot] and value c, every query head attends to it (grouped-query attention with a single KV head), and the
value half W_UV takes each head's output from the latent's width to its value's before o_proj. The scores and
outputs are the expanded attention's, reassociated: q_nope . (W_UK c) = (q_nope W_UK) . c, and the weighted sum of
W_UV c is W_UV times the weighted sum of c. The cache keeps c twice (keys and values are separate tensors):
kv_lora_rank * 2 + qk_rope_head_dim numbers per token and layer, 1,088 for DeepSeek-V3, 38 times fewer.

Called without the worker's batch (the self-check's reference), a layer runs transformers' own forward.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch

from worker.attention import paged_attention_forward
from worker.kv_cache import KVCacheShape

LATENT_MODULES = frozenset({"DeepseekV3Attention"})
"""transformers' classes whose forward `attach` replaces."""


@dataclass(frozen=True)
class Latent:
    """The latent's widths: what the paged cache holds per token and layer."""

    rank: int
    """kv_lora_rank: the compressed keys and values."""
    rope_dim: int
    """qk_rope_head_dim: the rotary key, shared by every head."""

    def cache_shape(self, num_layers: int) -> KVCacheShape:
        return KVCacheShape(num_layers, num_kv_heads=1, head_dim=self.rank + self.rope_dim, value_head_dim=self.rank)


def attach(model: torch.nn.Module) -> Latent | None:
    """Give each of the model's latent attentions a forward that caches the latent (call it before the worker
    packs the linears: it keeps kv_b_proj's weight as loaded); None when the model has none."""
    modules = [module for module in model.modules() if type(module).__name__ in LATENT_MODULES]
    if not modules:
        return None
    rotary = sys.modules[type(modules[0]).__module__]  # the modeling module's rotary functions
    apply_rotary = (rotary.apply_rotary_pos_emb_interleave if modules[0].config.rope_interleave
                    else rotary.apply_rotary_pos_emb)
    for module in modules:
        heads = module.num_heads
        weight = module.kv_b_proj.weight.detach().view(heads, module.qk_nope_head_dim + module.v_head_dim,
                                                        module.kv_lora_rank)
        key_up, value_up = weight.split([module.qk_nope_head_dim, module.v_head_dim], dim=1)  # [H, n, r], [H, v, r]
        module.forward = functools.partial(_forward, module, module.forward, apply_rotary, key_up,
                                           value_up.transpose(1, 2))
    return Latent(modules[0].kv_lora_rank, modules[0].qk_rope_head_dim)


def _forward(self, transformers_forward, apply_rotary, key_up: torch.Tensor, value_up: torch.Tensor,
             hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
             attention_mask: torch.Tensor | None = None, segserve_batch=None, **kwargs):
    """DeepseekV3Attention's forward on a packed step [1, T, D] over the latent cache. key_up: W_UK [H, n, r];
    value_up: W_UV transposed, [H, r, v]."""
    if segserve_batch is None:
        return transformers_forward(hidden_states, position_embeddings, attention_mask, **kwargs)
    kwargs.pop("cache", None)
    num_tokens = hidden_states.shape[1]
    if self.q_lora_rank is None:
        query = self.q_proj(hidden_states)
    else:
        query = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    query = query.view(1, num_tokens, -1, self.qk_head_dim).transpose(1, 2)  # [1, H, T, n + rope]
    query_nope, query_rot = query.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
    latent, key_rot = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
    latent = self.kv_a_layernorm(latent).view(1, 1, num_tokens, self.kv_lora_rank)
    cos, sin = position_embeddings
    query_rot, key_rot = apply_rotary(query_rot, key_rot.view(1, 1, num_tokens, self.qk_rope_head_dim), cos, sin)
    query = torch.cat([torch.matmul(query_nope, key_up), query_rot], dim=-1)  # [1, H, T, r + rope]
    key = torch.cat([latent, key_rot], dim=-1)  # [1, 1, T, r + rope]
    output, _ = paged_attention_forward(self, query, key, latent, None, scaling=self.scaling,
                                        segserve_batch=segserve_batch, **kwargs)  # [1, T, H, r]
    output = torch.matmul(output.transpose(1, 2), value_up)  # [1, H, T, v]
    return self.o_proj(output.transpose(1, 2).reshape(1, num_tokens, -1)), None
