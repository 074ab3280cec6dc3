"""The decoders of Gemma3, Llama, Mistral, Qwen2 and Qwen3, run without transformers' per-call machinery.

transformers' forward wraps the model, each layer and each attention call in decorators and keyword plumbing
(deprecated-argument checks, output capturing, config defaults, the gradient-checkpointing layer) and builds the
causal masks, which the paged attention never reads, on every call. An eager forward of a small model spends much
of its time there: the tests' tiny Gemma3 at one token, one thread, took 1.07-1.18 ms per forward against
1.28-1.41 through transformers' forward (README, "A lean decoder").

A lean decoder calls the model's own modules (embeddings, norms, linears, MLPs, rotary embeddings) on the same
tensors in the same order as transformers' forward of that class, and the worker's paged attention as that class's
attention calls it, so its logits are bit-identical (tests/test_lean_decoder.py compares them on prefills, decodes
and trees). A transformers release that changes one of these forwards fails that test rather than going
unnoticed. Other architectures and the compiled decoder (worker/compiled.py) keep transformers' forward.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from worker.attention import AttentionBatch, paged_attention_forward

Rotary = tuple[torch.Tensor, torch.Tensor]


def lean_decoder(model: nn.Module) -> LeanDecoder | None:
    """The lean forward of `model`, or None when its class has none (it then runs transformers' forward)."""
    lean = LEAN_DECODERS.get(type(model).__name__)
    return lean(model) if lean is not None else None


class LeanDecoder:
    """model(input_ids=..., position_ids=..., logits_to_keep=..., segserve_batch=...).logits as a function of the same
    arguments, for a causal LM whose attention is the worker's paged attention."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.text = model.model
        self.layers = list(self.text.layers[: self.text.config.num_hidden_layers])

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor,
                 segserve_batch: AttentionBatch) -> torch.Tensor:
        """input_ids, position_ids: [1, T]; logits_to_keep: [N] the rows to compute logits for. Returns [1, N, V]."""
        hidden = self.text.embed_tokens(input_ids)
        for layer, rotary in zip(self.layers, self.rotary(hidden, position_ids)):
            hidden = self.layer(layer, hidden, rotary, segserve_batch)
        return self.head(self.text.norm(hidden)[:, logits_to_keep, :])

    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list[Rotary]:
        """Each layer's rotary cos and sin."""
        raise NotImplementedError

    def layer(self, layer: nn.Module, hidden: torch.Tensor, rotary: Rotary, batch: AttentionBatch) -> torch.Tensor:
        raise NotImplementedError

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)


def _projections(attn: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value [1, heads, T, head_dim], as both architectures' attention computes them."""
    heads_shape = (*hidden.shape[:-1], -1, attn.head_dim)
    return tuple(proj(hidden).view(heads_shape).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))


def _output(attn: nn.Module, output: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    return attn.o_proj(output.reshape(*hidden.shape[:-1], -1).contiguous())


class LeanGemma3(LeanDecoder):
    """Gemma3ForCausalLM (text): four norms per layer, normed queries and keys, rotary per layer type."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.layer_types = list(self.text.config.layer_types)
        self.final_softcap = self.text.config.final_logit_softcapping

    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list[Rotary]:
        by_type = {kind: self.text.rotary_emb(hidden, position_ids, kind) for kind in set(self.layer_types)}
        return [by_type[kind] for kind in self.layer_types]

    def layer(self, layer: nn.Module, hidden: torch.Tensor, rotary: Rotary, batch: AttentionBatch) -> torch.Tensor:
        attn, normed = layer.self_attn, layer.input_layernorm(hidden)
        query, key, value = _projections(attn, normed)
        query, key = modeling_gemma3.apply_rotary_pos_emb(attn.q_norm(query), attn.k_norm(key), *rotary)
        # as Gemma3's attention calls it: no softcap
        output, _ = paged_attention_forward(attn, query, key, value, None, scaling=attn.scaling,
                                            sliding_window=attn.sliding_window, segserve_batch=batch)
        hidden = hidden + layer.post_attention_layernorm(_output(attn, output, normed))
        return hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class LeanLlama(LeanDecoder):
    """LlamaForCausalLM: two norms per layer, one rotary embedding, no sliding window. Its kin below differ only in
    the window their attention passes and, for Qwen3, normed queries and keys."""

    modeling = modeling_llama
    """The transformers module whose apply_rotary_pos_emb the class's attention calls."""

    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list[Rotary]:
        return [self.text.rotary_emb(hidden, position_ids=position_ids)] * len(self.layers)

    def projections(self, attn: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _projections(attn, hidden)

    def window(self, attn: nn.Module) -> dict:
        """The sliding-window keyword the class's attention passes to its attention function (Llama's: none)."""
        return {}

    def layer(self, layer: nn.Module, hidden: torch.Tensor, rotary: Rotary, batch: AttentionBatch) -> torch.Tensor:
        attn, normed = layer.self_attn, layer.input_layernorm(hidden)
        query, key, value = self.projections(attn, normed)
        query, key = self.modeling.apply_rotary_pos_emb(query, key, *rotary)
        output, _ = paged_attention_forward(attn, query, key, value, None, scaling=attn.scaling,
                                            segserve_batch=batch, **self.window(attn))
        hidden = hidden + _output(attn, output, normed)
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


class LeanMistral(LeanLlama):
    """MistralForCausalLM: Llama's layers, every one windowed by the config's sliding_window (None: none)."""

    modeling = modeling_mistral

    def window(self, attn: nn.Module) -> dict:
        return {"sliding_window": getattr(self.text.config, "sliding_window", None)}


class LeanQwen2(LeanLlama):
    """Qwen2ForCausalLM: Llama's layers with biased projections (inside the modules), the window per layer type."""

    modeling = modeling_qwen2

    def window(self, attn: nn.Module) -> dict:
        return {"sliding_window": attn.sliding_window}


class LeanQwen3(LeanQwen2):
    """Qwen3ForCausalLM: Qwen2's layers, queries and keys normed per head before they are transposed."""

    modeling = modeling_qwen3

    def projections(self, attn: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        heads_shape = (*hidden.shape[:-1], -1, attn.head_dim)
        return (attn.q_norm(attn.q_proj(hidden).view(heads_shape)).transpose(1, 2),
                attn.k_norm(attn.k_proj(hidden).view(heads_shape)).transpose(1, 2),
                attn.v_proj(hidden).view(heads_shape).transpose(1, 2))


LEAN_DECODERS: dict[str, type[LeanDecoder]] = {
    "Gemma3ForCausalLM": LeanGemma3, "LlamaForCausalLM": LeanLlama, "MistralForCausalLM": LeanMistral,
    "Qwen2ForCausalLM": LeanQwen2, "Qwen3ForCausalLM": LeanQwen3,
}
"""Model class name -> its lean decoder."""
