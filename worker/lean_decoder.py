"""The decoders of Gemma3, Llama, Mistral, Qwen2 and Qwen3, run without transformers' per-call machinery.

transformers' forward wraps the model, each layer and each attention call in decorators and keyword plumbing
(deprecated-argument checks, output capturing, config defaults, the gradient-checkpointing layer) and builds the
causal masks, which the paged attention never reads, on every call. An eager forward of a small model spends much
of its time there: the tests' tiny Gemma3 at one token, one thread, took 1.07-1.18 ms per forward against
1.28-1.41 through transformers' forward (docs/engine.md, "Lean decoder").

A lean decoder calls the model's own modules (embeddings, norms, linears, MLPs, rotary embeddings) on the same
tensors in the same order as transformers' forward of that class (with a layer's queries and keys through one
rotary embedding and one norm: LeanDecoder), and the worker's paged attention as that class's attention calls it,
so its logits are bit-identical on the CPU (tests/worker/test_lean_decoder.py compares them on prefills, decodes
and trees). A transformers release that changes one of these forwards fails that test rather than going
unnoticed. Other architectures and the compiled decoder (worker/compiled.py) keep transformers' forward.

A lean decoder calls each module's forward method, looked up once per layer (LayerCalls), rather than the module:
nn.Module.__call__ checks for hooks on every call, and each attribute reaches a submodule through
nn.Module.__getattr__. That is about 60 module calls per forward of the tiny Gemma3; without that machinery its
one-token steps took 13-21% less time (docs/engine.md, "Lean decoder"). The worker registers no hooks on the model's
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
    """The forward methods of one decoder layer's modules (None where the class has no such module), and what the
    layer's regions need besides."""

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
    rotate_half: Callable
    """The class's rotate_half (its transformers module's)."""
    num_heads: int
    head_dim: int

    @classmethod
    def of(cls, layer: nn.Module, query_key_norm: nn.Module | None, rotate_half: Callable, num_heads: int
           ) -> LayerCalls:
        attn = layer.self_attn

        def forward(module: nn.Module | None) -> Callable | None:
            return None if module is None else module.forward

        return cls(attn.q_proj.forward, attn.k_proj.forward, attn.v_proj.forward, attn.o_proj.forward,
                   forward(query_key_norm), layer.input_layernorm.forward, layer.post_attention_layernorm.forward,
                   forward(getattr(layer, "pre_feedforward_layernorm", None)),
                   forward(getattr(layer, "post_feedforward_layernorm", None)), _mlp_forward(layer.mlp),
                   rotate_half, num_heads, attn.head_dim)


def _mlp_forward(mlp: nn.Module) -> Callable:
    """mlp's forward as a function of x: the same calls on its linears' and activation's forward methods."""
    if type(mlp).__name__ not in GATED_MLPS:
        return mlp.forward
    gate, up, down, act = mlp.gate_proj.forward, mlp.up_proj.forward, mlp.down_proj.forward, mlp.act_fn.forward
    return lambda x: down(act(gate(x)) * up(x))


Regions = Callable[[Callable, Callable], tuple[Callable, Callable]]
"""What replaces a lean decoder's two regions (before_attention, after_attention), given them."""


def lean_decoder(model: nn.Module, regions: Regions | None = None) -> LeanDecoder | None:
    """The lean forward of `model`, its regions replaced by `regions` if given, or None when its class has none (it
    then runs transformers' forward)."""
    lean = LEAN_DECODERS.get(type(model).__name__)
    return lean(model, regions) if lean is not None else None


class LeanDecoder:
    """model(input_ids=..., position_ids=..., logits_to_keep=..., segserve_batch=...).logits as a function of the same
    arguments, for a causal LM whose attention is the worker's paged attention.

    Two ops are merged where the result is the same bit for bit: a layer's queries and keys go through the rotary
    embedding as one tensor (element-wise ops, so each element is computed as on its own), and a class that norms
    them per head does so in one call (StackedRMSNorm, tested against each norm on its own heads). That halves the
    rotary ops and the query and key norm calls of every layer.

    A layer runs as two regions around its paged attention: before_attention (input norm, projections, query and
    key norms, rotary embedding) and the class's after_attention (output projection, norms, residuals, MLP). They
    take a layer's LayerCalls, so one function serves every layer; `regions` may replace both
    (worker/compiled_layers.py compiles them)."""

    modeling = modeling_llama
    """The transformers module of the class (its rotate_half)."""
    has_query_key_norms = False
    """Whether the class's attention norms its queries and keys per head (q_norm, k_norm)."""

    def __init__(self, model: nn.Module, regions: Regions | None = None):
        self.model = model
        self.text = model.model
        config = self.text.config
        self.layers = list(self.text.layers[: config.num_hidden_layers])
        self.num_heads = config.num_attention_heads
        heads = (self.num_heads, config.num_key_value_heads)
        query_key_norms = [StackedRMSNorm(list(zip((layer.self_attn.q_norm, layer.self_attn.k_norm), heads)))
                           if self.has_query_key_norms else None for layer in self.layers]
        self.calls = [LayerCalls.of(layer, norms, self.modeling.rotate_half, self.num_heads)
                      for layer, norms in zip(self.layers, query_key_norms)]
        self.attention_kwargs = [{"scaling": layer.self_attn.scaling, **self.window(layer.self_attn)}
                                 for layer in self.layers]
        """Per layer, what the class's attention passes to its attention function besides the tensors."""
        self.before_attention, self.after_attention = before_attention, self.after_attention
        if regions is not None:
            self.before_attention, self.after_attention = regions(before_attention, self.after_attention)
        self.min_tokens: int = getattr(self.before_attention, "min_tokens", 1)
        """The fewest tokens the regions compute without padding them (compiled ones: 2); DecodeGraphs pads its
        steps to at least that many rows."""

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: torch.Tensor,
                 segserve_batch: AttentionBatch) -> torch.Tensor:
        """input_ids, position_ids: [1, T]; logits_to_keep: [N] the rows to compute logits for. Returns [1, N, V]."""
        hidden = self.text.embed_tokens(input_ids)
        for index, (cos, sin) in enumerate(self.rotary(hidden, position_ids)):
            calls = self.calls[index]
            query, key, value = self.before_attention(calls, hidden, cos, sin)
            output, _ = paged_attention_forward(self.layers[index].self_attn, query, key, value, None,
                                                segserve_batch=segserve_batch, **self.attention_kwargs[index])
            hidden = self.after_attention(calls, hidden, output.contiguous())
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

    @staticmethod
    def after_attention(calls: LayerCalls, hidden: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input `hidden` [1, T, hidden size] and its attention's output [1, T, H, D]
        (contiguous)."""
        raise NotImplementedError

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)


def before_attention(calls: LayerCalls, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's queries [1, H, T, D], keys and values [1, KVH, T, D] from its input hidden [1, T, hidden size]:
    input norm, projections, query and key norms (where the class has them), rotary embedding."""
    normed = calls.input_norm(hidden)
    heads_shape = (*normed.shape[:-1], -1, calls.head_dim)
    query_key = torch.cat((calls.q_proj(normed).view(heads_shape), calls.k_proj(normed).view(heads_shape)), dim=-2)
    if calls.query_key_norm is not None:
        query_key = calls.query_key_norm(query_key)
    query_key = query_key.transpose(1, 2)  # [1, H + KVH, T, D]
    value = calls.v_proj(normed).view(heads_shape).transpose(1, 2)
    query_key = (query_key * cos) + (calls.rotate_half(query_key) * sin)  # apply_rotary_pos_emb's
    return query_key[:, :calls.num_heads], query_key[:, calls.num_heads:], value


def _output_projection(calls: LayerCalls, hidden: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """The attention block's output before its residual: [1, T, H, D] (contiguous) -> o_proj -> [1, T, hidden size]."""
    return calls.o_proj(attention.view(*hidden.shape[:-1], -1))


class LeanGemma3(LeanDecoder):
    """Gemma3ForCausalLM (text): four norms per layer, normed queries and keys, rotary per layer type."""

    modeling = modeling_gemma3
    has_query_key_norms = True

    def __init__(self, model: nn.Module, regions: Regions | None = None):
        super().__init__(model, regions)
        self.layer_types = list(self.text.config.layer_types)
        self.final_softcap = self.text.config.final_logit_softcapping

    def rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list[Rotary]:
        by_type = {kind: _over_heads(self.text.rotary_emb(hidden, position_ids, kind))
                   for kind in set(self.layer_types)}
        return [by_type[kind] for kind in self.layer_types]

    def window(self, attn: nn.Module) -> dict:
        return {"sliding_window": attn.sliding_window}

    @staticmethod
    def after_attention(calls: LayerCalls, hidden: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        hidden = hidden + calls.post_attention_norm(_output_projection(calls, hidden, attention))
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

    @staticmethod
    def after_attention(calls: LayerCalls, hidden: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        hidden = hidden + _output_projection(calls, hidden, attention)
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
