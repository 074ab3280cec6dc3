"""The decoders of Gemma3, Llama, Mistral, Qwen2 and Qwen3, run without transformers' per-call machinery.

transformers' forward wraps the model, each layer and each attention call in decorators and keyword plumbing
(deprecated-argument checks, output capturing, config defaults, the gradient-checkpointing layer) and builds the
causal masks, which the paged attention never reads, on every call. An eager forward of a small model spends much
of its time there: the tests' tiny Gemma3 at one token, one thread, took 1.07-1.18 ms per forward against
1.28-1.41 through transformers' forward (README, "A lean decoder").

A lean decoder calls the model's own modules (embeddings, norms, linears, MLPs, rotary embeddings) on the same
tensors in the same order as transformers' forward of that class (with a layer's queries and keys through one
rotary embedding and one norm: LeanDecoder), and the worker's paged attention as that class's attention calls it,
so its logits are bit-identical on the CPU (tests/test_lean_decoder.py compares them on prefills, decodes
and trees). A transformers release that changes one of these forwards fails that test rather than going
unnoticed. Other architectures and the compiled decoder (worker/compiled.py) keep transformers' forward.

A lean decoder calls each module's forward method, looked up once per layer (LayerCalls), rather than the module:
nn.Module.__call__ checks for hooks on every call, and each attribute reaches a submodule through
nn.Module.__getattr__. That is about 60 module calls per forward of the tiny Gemma3; without that machinery its
one-token steps took 13-21% less time (README, "A lean decoder"). The worker registers no hooks on the model's
modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3

from worker.attention import AttentionBatch, paged_attention_forward
from worker.fused_norm import StackedRMSNorm

Rotary = tuple[torch.Tensor, torch.Tensor]
"""A layer's rotary cos and sin, [1, 1, T, D]: broadcast over the heads."""


def _over_heads(cos_sin: Rotary) -> Rotary:
    """A rotary embedding's (cos, sin) [1, T, D] as apply_rotary_pos_emb unsqueezes them for the heads, once per
    forward rather than once per layer."""
    return cos_sin[0].unsqueeze(1), cos_sin[1].unsqueeze(1)


GATED_MLPS = frozenset({"Gemma3MLP", "LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
"""transformers' MLP classes whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)): LayerCalls makes the
same calls itself."""


@dataclass(frozen=True, slots=True)
class LayerCalls:
    """The forward methods of one decoder layer's modules (None where the class has no such module)."""

    q_proj: Callable
    k_proj: Callable
    v_proj: Callable
    o_proj: Callable
    query_key_norm: Callable | None
    input_norm: Callable
    post_attention_norm: Callable
    pre_feedforward_norm: Callable | None
    post_feedforward_norm: Callable | None
    mlp: Callable

    @classmethod
    def of(cls, layer: nn.Module, query_key_norm: nn.Module | None) -> LayerCalls:
        attn = layer.self_attn

        def forward(module: nn.Module | None) -> Callable | None:
            return None if module is None else module.forward

        return cls(attn.q_proj.forward, attn.k_proj.forward, attn.v_proj.forward, attn.o_proj.forward,
                   forward(query_key_norm), layer.input_layernorm.forward, layer.post_attention_layernorm.forward,
                   forward(getattr(layer, "pre_feedforward_layernorm", None)),
                   forward(getattr(layer, "post_feedforward_layernorm", None)), _mlp_forward(layer.mlp))


def _mlp_forward(mlp: nn.Module) -> Callable:
    """mlp's forward as a function of x: the same calls on its linears' and activation's forward methods."""
    if type(mlp).__name__ not in GATED_MLPS:
        return mlp.forward
    gate, up, down, act = mlp.gate_proj.forward, mlp.up_proj.forward, mlp.down_proj.forward, mlp.act_fn.forward
    return lambda x: down(act(gate(x)) * up(x))


def lean_decoder(model: nn.Module) -> LeanDecoder | None:
    """The lean forward of `model`, or None when its class has none (it then runs transformers' forward)."""
    lean = LEAN_DECODERS.get(type(model).__name__)
    return lean(model) if lean is not None else None


class LeanDecoder:
    """model(input_ids=..., position_ids=..., logits_to_keep=..., segserve_batch=...).logits as a function of the same
    arguments, for a causal LM whose attention is the worker's paged attention.

    Two ops are merged where the result is the same bit for bit: a layer's queries and keys go through the rotary
    embedding as one tensor (element-wise ops, so each element is computed as on its own), and a class that norms
    them per head does so in one call (StackedRMSNorm, tested against each norm on its own heads). That halves the
    rotary ops and the query and key norm calls of every layer."""

    modeling = modeling_llama
    """The transformers module of the class (its rotate_half)."""
    has_query_key_norms = False
    """Whether the class's attention norms its queries and keys per head (q_norm, k_norm)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.text = model.model
        config = self.text.config
        self.layers = list(self.text.layers[: config.num_hidden_layers])
        self.num_heads = config.num_attention_heads
        heads = (self.num_heads, config.num_key_value_heads)
        query_key_norms = [StackedRMSNorm(list(zip((layer.self_attn.q_norm, layer.self_attn.k_norm), heads)))
                           if self.has_query_key_norms else None for layer in self.layers]
        self.calls = [LayerCalls.of(layer, norms) for layer, norms in zip(self.layers, query_key_norms)]

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor,
                 segserve_batch: AttentionBatch) -> torch.Tensor:
        """input_ids, position_ids: [1, T]; logits_to_keep: [N] the rows to compute logits for. Returns [1, N, V]."""
        hidden = self.text.embed_tokens(input_ids)
        for index, (layer, rotary) in enumerate(zip(self.layers, self.rotary(hidden, position_ids))):
            hidden = self.layer(index, layer, hidden, rotary, segserve_batch)
        return self.head(self.text.norm(hidden)[:, logits_to_keep, :])

    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list[Rotary]:
        """Each layer's rotary cos and sin (_over_heads)."""
        raise NotImplementedError

    def window(self, attn: nn.Module) -> dict:
        """The sliding-window keyword the class's attention passes to its attention function (Llama's: none)."""
        return {}

    def sliding_windows(self) -> set[int]:
        """The windows of the model's sliding-window layers (empty: every layer attends to every key)."""
        return {self.window(layer.self_attn).get("sliding_window") for layer in self.layers} - {None}

    def layer(self, index: int, layer: nn.Module, hidden: torch.Tensor, rotary: Rotary, batch: AttentionBatch
              ) -> torch.Tensor:
        raise NotImplementedError

    def attention(self, index: int, attn: nn.Module, hidden: torch.Tensor, rotary: Rotary, batch: AttentionBatch,
                  **window) -> torch.Tensor:
        """The attention block's output before its residual: projections, query and key norms (where the class has
        them), rotary embedding, the paged attention called as the class's attention calls it (`window`: the
        sliding-window keyword the class passes, if any), output projection."""
        calls = self.calls[index]
        heads_shape = (*hidden.shape[:-1], -1, attn.head_dim)
        query_key = torch.cat((calls.q_proj(hidden).view(heads_shape), calls.k_proj(hidden).view(heads_shape)), dim=-2)
        if calls.query_key_norm is not None:
            query_key = calls.query_key_norm(query_key)
        query_key = query_key.transpose(1, 2)  # [1, H + KVH, T, D]
        value = calls.v_proj(hidden).view(heads_shape).transpose(1, 2)
        cos, sin = rotary
        query_key = (query_key * cos) + (self.modeling.rotate_half(query_key) * sin)  # apply_rotary_pos_emb's
        query, key = query_key[:, : self.num_heads], query_key[:, self.num_heads :]
        output, _ = paged_attention_forward(attn, query, key, value, None, scaling=attn.scaling, segserve_batch=batch,
                                            **window)
        return calls.o_proj(output.reshape(*hidden.shape[:-1], -1).contiguous())

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)


class LeanGemma3(LeanDecoder):
    """Gemma3ForCausalLM (text): four norms per layer, normed queries and keys, rotary per layer type."""

    modeling = modeling_gemma3
    has_query_key_norms = True

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.layer_types = list(self.text.config.layer_types)
        self.final_softcap = self.text.config.final_logit_softcapping

    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list[Rotary]:
        by_type = {kind: _over_heads(self.text.rotary_emb(hidden, position_ids, kind))
                   for kind in set(self.layer_types)}
        return [by_type[kind] for kind in self.layer_types]

    def window(self, attn: nn.Module) -> dict:
        return {"sliding_window": attn.sliding_window}

    def layer(self, index: int, layer: nn.Module, hidden: torch.Tensor, rotary: Rotary, batch: AttentionBatch
              ) -> torch.Tensor:
        # as Gemma3's attention calls it: no softcap
        calls = self.calls[index]
        output = self.attention(index, layer.self_attn, calls.input_norm(hidden), rotary, batch,
                                **self.window(layer.self_attn))
        hidden = hidden + calls.post_attention_norm(output)
        return hidden + calls.post_feedforward_norm(calls.mlp(calls.pre_feedforward_norm(hidden)))

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


class LeanLlama(LeanDecoder):
    """LlamaForCausalLM: two norms per layer, one rotary embedding, no sliding window. Its kin below differ only in
    the window their attention passes and, for Qwen3, normed queries and keys."""

    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list[Rotary]:
        return [_over_heads(self.text.rotary_emb(hidden, position_ids=position_ids))] * len(self.layers)

    def layer(self, index: int, layer: nn.Module, hidden: torch.Tensor, rotary: Rotary, batch: AttentionBatch
              ) -> torch.Tensor:
        attn, calls = layer.self_attn, self.calls[index]
        hidden = hidden + self.attention(index, attn, calls.input_norm(hidden), rotary, batch, **self.window(attn))
        return hidden + calls.mlp(calls.post_attention_norm(hidden))


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
    """Qwen3ForCausalLM: Qwen2's layers, queries and keys normed per head."""

    modeling = modeling_qwen3
    has_query_key_norms = True


LEAN_DECODERS: dict[str, type[LeanDecoder]] = {
    "Gemma3ForCausalLM": LeanGemma3, "LlamaForCausalLM": LeanLlama, "MistralForCausalLM": LeanMistral,
    "Qwen2ForCausalLM": LeanQwen2, "Qwen3ForCausalLM": LeanQwen3,
}
"""Model class name -> its lean decoder."""
