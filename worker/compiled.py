"""The model's decoder compiled with torch.compile (inductor), one static shape per token-count bucket.

An eager forward of a small model spends most of its time dispatching ops from Python, one at a time.
Inductor fuses the norms, rotary embeddings and element-wise ops into a few generated kernels and, with
freezing, treats the weights as constants (the packed oneDNN linears stay oneDNN calls on the packed
weights, the small unpacked ones torch's BLAS calls, as the eager worker makes them: `_COMPILE_CONFIG`).
The tiny Gemma3 of the tests, one row, one thread: 1.94 ms per forward against 2.80 eager (docs/engine.md,
"Compiled decoder"). The paged attention stays eager, as one opaque custom op per layer
(`segserve::paged_attention`): it reads the step's AttentionBatch, which is no tensor and changes every step,
from `_current`, where `CompiledDecoder` puts it before each forward.

Shapes are static: a step's packed row of T tokens is padded to the next power of two (`bucket`), with
token 0 at position 0. The runner's warm-up compiles the buckets up to WorkerConfig.compile_max_tokens; a
larger one compiles the first time a step of that size comes (the log says how long each took). The attention
takes only the step's real tokens (it writes no KV for padding) and gives padding rows zeros; nothing
downstream reads them (the logits are taken at real rows only).

Numerics: a compiled forward differs from the eager one in the last bits (fused reductions round in another
order), so a worker runs every step compiled, prefill and trees included. On the CPU rows stay independent: a
row's logits are bit-identical whatever bucket it is computed in and whatever else is in the batch
(tests/worker/test_compiled.py), which greedy speculation relies on. On an H100 they were not: a row padded among
others differed in the last bits from the row alone, with the linears in fixed row blocks too (docs/engine.md,
"Batch invariance"), so a compiled GPU worker's greedy speculation is not known to be lossless.
"""

from __future__ import annotations

import logging
import time

import torch
import torch._inductor.config as inductor_config
from torch import nn
from transformers import AttentionInterface

from worker.attention import AttentionBatch, check_attention_kwargs, layer_window, paged_attention_forward

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "segserve_paged_compiled"
RECOMPILE_LIMIT = 64
"""Compiled shapes per decoder code (dynamo's limit, 8 by default, past which it would run eager, with other
numerics): a worker's buckets, 2**0 to 2**16 tokens, for a few runners in one process (tests, benchmarks)."""


def allow_recompiles() -> None:
    """Raise dynamo's recompile limit, process-wide, to at least RECOMPILE_LIMIT (never lower it)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


_COMPILE_CONFIG = {"freezing": True, "cpp.weight_prepack": False}
"""Inductor's options for the worker's compiles (a compile() option does not take them): the weights as constants;
the linears computed as the eager worker computes them (and its probe checked: worker/row_blocks.py), a packed
one by its custom op, a small one by torch's BLAS call, not repacked for MKL, whose rows can differ with the
batch's row count."""

_current: list[AttentionBatch | None] = [None]
"""The AttentionBatch of the forward under way (one forward at a time runs per process: the worker serializes
its steps; CompiledDecoder sets it)."""


@torch.library.custom_op("segserve::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, window: int,
                    scaling: float, softcap: float) -> torch.Tensor:
    """worker.attention.paged_attention_forward on the real tokens of a padded row: query [1, H, P, D],
    key/value [1, KVH, P, D]; returns [1, P, H, D] with zeros at the P - T padding tokens. window 0 = none,
    softcap 0 = none."""
    batch = _current[0]
    if batch is None:
        raise RuntimeError("segserve::paged_attention runs only inside CompiledDecoder's forward")
    num_tokens = batch.slots.shape[0]
    module = _Layer(layer, window or None)
    if num_tokens == query.shape[2]:  # no padding (a step of 1, 2, 4... tokens): nothing to slice or pad
        out, _ = paged_attention_forward(module, query, key, value, None, scaling, softcap or None,
                                         segserve_batch=batch, sliding_window=window or None)
        return out.contiguous()  # the layout the fake promises; a view of the attention's own output
    out, _ = paged_attention_forward(
        module, query[:, :, :num_tokens], key[:, :, :num_tokens], value[:, :, :num_tokens], None, scaling,
        softcap or None, segserve_batch=batch, sliding_window=window or None)
    padded = query.new_zeros(1, query.shape[2], query.shape[1], value.shape[-1])
    padded[:, :num_tokens] = out
    return padded


@paged_attention.register_fake
def _(query, key, value, layer, window, scaling, softcap):
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[-1])


class _Layer:
    """What paged_attention_forward reads of an attention module."""

    def __init__(self, layer_idx: int, sliding_window: int | None):
        self.layer_idx, self.sliding_window = layer_idx, sliding_window


def _compiled_attention(module: nn.Module, query, key, value, attention_mask, scaling: float | None = None,
                        softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The attention interface the compiled decoder's layers call: the custom op, traced as one node (without
    sinks: a model with them is refused, as any keyword the op does not carry)."""
    check_attention_kwargs(module, kwargs)
    window = layer_window(module, kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return torch.ops.segserve.paged_attention(query, key, value, module.layer_idx, window or 0, scale,
                                              softcap or 0.0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, _compiled_attention)


def bucket(num_tokens: int) -> int:
    """The padded length of a step of num_tokens tokens: the next power of two."""
    return 1 << max(0, num_tokens - 1).bit_length()


class CompiledDecoder:
    """Replaces the forward of a causal LM's decoder (`model.model`) with a compiled one; the output head
    stays eager (it runs on the kept rows only)."""

    def __init__(self, model: nn.Module):
        decoder = getattr(model, "model", None)
        if not isinstance(decoder, nn.Module):
            raise ValueError(f"{type(model).__name__} has no decoder at .model to compile")
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        allow_recompiles()
        self.eager = decoder.forward
        """The decoder's own forward (worker/self_check.py's reference runs it)."""
        self._compiled = torch.compile(self.eager, dynamic=False, fullgraph=True)
        self._buckets: set[int] = set()
        decoder.forward = self.forward

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, segserve_batch: AttentionBatch,
                **kwargs):
        """input_ids/position_ids: [1, T]; runs the compiled decoder on them padded to bucket(T)."""
        num_tokens = input_ids.shape[1]
        padded = bucket(num_tokens)
        if padded > num_tokens:
            pad = (0, padded - num_tokens)
            input_ids = nn.functional.pad(input_ids, pad)
            position_ids = nn.functional.pad(position_ids, pad)
        _current[0] = segserve_batch
        start = time.perf_counter()
        try:
            if padded in self._buckets:
                # Compiled already. Only the guards that tell the buckets' graphs apart (the shapes) are
                # checked, not all of them (~0.1 ms per forward on the tiny model): the runner hands every
                # forward the same kinds of inputs, so nothing else a guard checks changes between calls.
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    return self._compiled(input_ids=input_ids, position_ids=position_ids, **kwargs)
            with inductor_config.patch(_COMPILE_CONFIG):
                output = self._compiled(input_ids=input_ids, position_ids=position_ids, **kwargs)
        finally:
            _current[0] = None
        self._buckets.add(padded)
        logger.info("compiled the forward for %d tokens in %.1f s", padded, time.perf_counter() - start)
        return output
