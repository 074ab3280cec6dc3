"""The runner's forward path: how a step's packed tokens become logits, chosen once when the model loads.

`PathChoice.of` reads the switches (the config's lean decoder, compiled decoder, compiled layers and decode graphs,
the device, the model class) before anything is built, since the linears' packing and the KV cache's scratch block
depend on it; `PathChoice.build` then makes the path, and `ModelRunner.execute` calls that path on every step
without asking again:

- `EagerPath`: every step through one decode function, the model's lean decoder (worker/lean_decoder.py) or
  transformers' forward (compiled whole by torch.compile with --compiled: worker/compiled.py), its attention
  groups planned and its arrays uploaded for the step.
- `GraphPath`: decode steps that fit run on static buffers, replayed as CUDA graphs on a GPU
  (worker/decode_graphs.py); the others as an `EagerPath` on the same lean decoder, whose key lengths are padded
  as the graphs pad theirs, so that a sequence's logits do not depend on which of the two ran its step.

A path's `prepare` does a step's host work (the metadata) and returns the forward itself, so that the runner can
time the two apart and start the grammar masks between them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from worker.attention import AttentionBatch, build_attention_batch
from worker.attention_plan import bucket_keys, graph_bucket_keys, plan_groups
from worker.block_tables import BlockTables
from worker.compiled import CompiledDecoder
from worker.compiled_layers import compiled_regions
from worker.config import WorkerConfig
from worker.decode_graphs import DecodeGraphs
from worker.kv_cache import PagedKVCache
from worker.lean_decoder import LEAN_DECODERS, lean_decoder
from worker.planning import ForwardPlan
from worker.sequence_state import SequenceStates, Span
from worker.upload import upload

Decode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBatch], torch.Tensor]
"""(input_ids [1, T], position_ids [1, T], logits_to_keep [K], batch) -> logits [1, K, V]."""

KeyBucket = Callable[[int], int]
"""Pads a key length (worker/attention_plan.py: bucket_keys, graph_bucket_keys)."""

Forward = Callable[[], torch.Tensor]
"""A prepared step's forward: its float32 logits [K, V], the plan's non-finite tokens set."""


def transformers_decode(model: torch.nn.Module) -> Decode:
    """transformers' forward of the model on the paged KV cache (worker/attention.py reads `segserve_batch`)."""

    def decode(input_ids, position_ids, logits_to_keep, batch):
        return model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=logits_to_keep,
                     segserve_batch=batch).logits

    return decode


@dataclass(frozen=True)
class EagerPath:
    """Every step through `decode`, its attention planned per step (worker/attention_plan.py)."""

    decode: Decode
    device: torch.device
    kv_cache: PagedKVCache
    block_tables: BlockTables
    key_bucket: KeyBucket = bucket_keys
    """How key lengths are padded into the attention's groups."""
    sequence_states: SequenceStates | None = None
    """The sequences' states besides the KV cache, which a forward reads and advances (worker/sequence_state.py)."""
    compiled: CompiledDecoder | None = None
    """With --compiled: the compiled decoder, which `decode` runs (the self-check reads its eager forward too)."""
    graphs: DecodeGraphs | None = None
    """GraphPath's decode graphs; None on an eager path."""

    def prepare(self, plan: ForwardPlan, token_ids: np.ndarray, positions: np.ndarray, keep: np.ndarray) -> Forward:
        """Everything a step needs before its forward, for the plan's works (token ids, positions and the rows to
        keep, in work order); the forward runs when the result is called."""
        works, layout = plan.works, plan.layout
        groups = plan_groups(works, layout, self.key_bucket)
        uploaded = upload([np.stack([token_ids, positions, layout.slots]), keep,
                           *(a for group in groups for a in group.arrays())], self.device)
        inputs, logits_to_keep = uploaded[0], uploaded[1]  # [3, T], [N + R]
        batch = build_attention_batch(groups, uploaded[2:], inputs[2], self.block_tables.device_table, self.kv_cache)
        input_ids, position_ids = inputs[0:1], inputs[1:2]  # [1, T] each
        states = contextlib.nullcontext()
        if self.sequence_states is not None:
            states = self.sequence_states.step([
                Span(w.seq_id, int(offset), len(w.token_ids), w.num_computed_tokens, w.node_parents, w.node_depths)
                for w, offset in zip(works, layout.offsets)])

        def forward() -> torch.Tensor:
            with states:
                logits = self.decode(input_ids, position_ids, logits_to_keep, batch)
            plan.non_finite_tokens = batch.non_finite
            return logits[0].float()  # [N + R, V]

        return forward


@dataclass(frozen=True)
class GraphPath(EagerPath):
    """Decode steps that fit on `graphs`; the others eager, on the same lean decoder."""

    def prepare(self, plan: ForwardPlan, token_ids: np.ndarray, positions: np.ndarray, keep: np.ndarray) -> Forward:
        if not self.graphs.fits(len(plan.works), len(token_ids), keep):
            return super().prepare(plan, token_ids, positions, keep)

        def forward() -> torch.Tensor:
            logits, plan.non_finite_tokens = self.graphs.run(plan.layout, token_ids, positions)
            return logits

        return forward


@dataclass(frozen=True)
class PathChoice:
    """Which path a runner's steps take, decided from its config, device and model class before anything is built."""

    is_lean: bool
    """The model's lean decoder (worker/lean_decoder.py), not transformers' forward."""
    is_graphs: bool
    """Decode steps on static buffers and CUDA graphs (GraphPath)."""
    is_compiled_layers: bool
    """The lean decoder's regions between attentions compiled (worker/compiled_layers.py)."""
    is_compiled: bool
    """transformers' forward compiled whole (worker/compiled.py)."""

    @classmethod
    def of(cls, config: WorkerConfig, device_type: str, model: torch.nn.Module) -> PathChoice:
        """ValueError for a combination that cannot run (graphs or compiled layers without a lean decoder)."""
        is_lean = config.is_lean_decoder and not config.is_compiled and type(model).__name__ in LEAN_DECODERS
        is_graphs = config.uses_cuda_graphs(device_type, is_lean)
        is_compiled_layers = config.uses_compiled_layers(device_type, is_lean)
        if (is_graphs or is_compiled_layers) and not is_lean:
            raise ValueError(f"{type(model).__name__} has no lean decoder for cuda_graphs or compiled_layers")
        return cls(is_lean, is_graphs, is_compiled_layers, config.is_compiled)

    @property
    def num_scratch_blocks(self) -> int:
        """KV blocks the path keeps for itself, past the scheduler's: the graphs' padding writes into one."""
        return 1 if self.is_graphs else 0

    def build(self, model: torch.nn.Module, device: torch.device, kv_cache: PagedKVCache, block_tables: BlockTables,
              sequence_states: SequenceStates | None) -> EagerPath:  # fmt: skip
        """The path, on a KV cache of num_scratch_blocks more blocks than the scheduler is given."""
        if self.is_lean:
            lean = lean_decoder(model, compiled_regions if self.is_compiled_layers else None)
            if not self.is_graphs:
                return EagerPath(lean, device, kv_cache, block_tables, bucket_keys, sequence_states)
            num_slots = (kv_cache.num_blocks - self.num_scratch_blocks) * kv_cache.block_size
            graphs = DecodeGraphs(lean, kv_cache, block_tables, num_slots, is_capture=device.type == "cuda")
            return GraphPath(lean, device, kv_cache, block_tables, graph_bucket_keys, sequence_states,
                             graphs=graphs)
        compiled = CompiledDecoder(model) if self.is_compiled else None
        decode = transformers_decode(model)
        return EagerPath(decode, device, kv_cache, block_tables, bucket_keys, sequence_states, compiled)

