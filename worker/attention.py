"""Paged attention under the stock transformers model code.

`segserve_paged` is registered with transformers' AttentionInterface, so any
causal LM whose attention modules call `attention_interface(...)` runs with it
unchanged. The model gets one packed row of every scheduled token ([1, T]) and
builds no mask of its own (the name is not a mask implementation); everything
the attention needs travels as the `segserve_batch` forward kwarg, an
`AttentionBatch` built once per step and shared by all layers.

Per layer: write the new keys/values into their cache slots, then for each group
of similarly sized sequences gather [R, KVH, L, D] keys/values from the cache
and run one masked SDPA. Each query sees every cached position of its sequence
plus the new tokens its mask allows (causal, or a candidate tree); sliding-window
layers also hide keys whose rotary position is `window` or more behind. A cached
key's rotary position is its storage index (the scheduler only counts tokens as
computed when they sit at their own position); a new key's is its Work position.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from transformers import AttentionInterface

from worker.kv_cache import PagedKVCache, slot_ids
from worker.work import Work

ATTN_IMPLEMENTATION = "segserve_paged"


@dataclass
class AttentionGroup:
    """R sequences padded to Q queries and L keys, attended in one call."""

    query_index: torch.Tensor  # [R, Q] long: token index in the packed step row (0 for padding)
    key_slots: torch.Tensor  # [R, L] long: cache slot of every key (0 for padding)
    mask: torch.Tensor  # [R, Q, L] bool: True where query may attend key (window not applied)
    query_pos: torch.Tensor  # [R, Q] long: rotary positions of queries
    key_pos: torch.Tensor  # [R, L] long: rotary positions of keys
    is_pad_query: torch.Tensor  # [R, Q] bool
    out_rows: torch.Tensor  # [M] long: flat r * Q + q of real queries
    out_tokens: torch.Tensor  # [M] long: their token index in the packed row
    _masks: dict = field(default_factory=dict)

    def to(self, device) -> AttentionGroup:
        tensors = {f.name: getattr(self, f.name).to(device) for f in fields(self) if f.name != "_masks"}
        return AttentionGroup(**tensors)

    def attn_mask(self, window: int | None, num_groups: int) -> torch.Tensor:
        """[R, 1, num_groups * Q, L] bool mask for a layer, cached per (window, num_groups)."""
        cached = self._masks.get((window, num_groups))
        if cached is None:
            mask = self.mask
            if window is not None:
                # mask: [R, Q, L]; a key `window` or more positions behind the query is out of reach
                mask = mask & (self.query_pos[:, :, None] - self.key_pos[:, None, :] < window)
                # a padding query keeps key 0 so its softmax row is never empty (no NaN)
                mask[:, :, 0] |= self.is_pad_query
            cached = mask.repeat(1, num_groups, 1).unsqueeze(1)
            self._masks[(window, num_groups)] = cached
        return cached


@dataclass
class AttentionBatch:
    """Per-step attention metadata: where new tokens go, and what each query may see."""

    kv_cache: PagedKVCache
    slots: torch.Tensor  # [T] long: cache slot of every new token
    groups: list[AttentionGroup]


def _bucket(num_queries: int) -> int:
    """Sequences whose query counts share a power-of-two bucket are padded together."""
    return 1 << (num_queries - 1).bit_length()


def build_attention_batch(works: list[Work], kv_cache: PagedKVCache, device: torch.device) -> AttentionBatch:
    """Lay out one step: the works' tokens are packed in order into the [1, T] row."""
    block_size = kv_cache.block_size
    new_slots, per_seq, offset = [], [], 0
    for work in works:
        n, start = len(work.token_ids), work.num_computed_tokens
        table = torch.tensor(work.block_table, dtype=torch.long)
        key_slots = slot_ids(table, 0, start + n, block_size)  # [L]
        positions = torch.tensor(work.positions, dtype=torch.long)  # [n]
        key_pos = torch.cat([torch.arange(start), positions])  # [L]
        mask = torch.ones(n, start + n, dtype=torch.bool)
        mask[:, start:] = work.attention_mask()  # [n, n]: causal, or the tree's paths
        new_slots.append(key_slots[start:])
        per_seq.append((offset, key_slots, positions, key_pos, mask))
        offset += n
    buckets: dict[int, list] = {}
    for item in per_seq:
        buckets.setdefault(_bucket(len(item[2])), []).append(item)
    groups = [_pad_group(items).to(device) for _, items in sorted(buckets.items())]
    slots = torch.cat(new_slots) if new_slots else torch.empty(0, dtype=torch.long)
    return AttentionBatch(kv_cache, slots.to(device), groups)


def _pad_group(items: list) -> AttentionGroup:
    rows = len(items)
    num_queries = max(len(positions) for _, _, positions, _, _ in items)
    num_keys = max(len(key_slots) for _, key_slots, _, _, _ in items)
    query_index = torch.zeros(rows, num_queries, dtype=torch.long)
    key_slots_pad = torch.zeros(rows, num_keys, dtype=torch.long)
    mask = torch.zeros(rows, num_queries, num_keys, dtype=torch.bool)
    query_pos = torch.zeros(rows, num_queries, dtype=torch.long)
    key_pos_pad = torch.zeros(rows, num_keys, dtype=torch.long)
    is_pad = torch.ones(rows, num_queries, dtype=torch.bool)
    out_rows, out_tokens = [], []
    for r, (offset, key_slots, positions, key_pos, seq_mask) in enumerate(items):
        n, length = len(positions), len(key_slots)
        query_index[r, :n] = torch.arange(offset, offset + n)
        key_slots_pad[r, :length] = key_slots
        mask[r, :n, :length] = seq_mask
        query_pos[r, :n] = positions
        key_pos_pad[r, :length] = key_pos
        is_pad[r, :n] = False
        out_rows.append(torch.arange(r * num_queries, r * num_queries + n))
        out_tokens.append(query_index[r, :n])
    mask[:, :, 0] |= is_pad
    return AttentionGroup(
        query_index, key_slots_pad, mask, query_pos, key_pos_pad, is_pad, torch.cat(out_rows), torch.cat(out_tokens)
    )


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    softcap: float | None = None,
    segserve_batch: AttentionBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query: [1, H, T, D]; key/value: [1, KVH, T, D] after RoPE. Returns [1, T, H, D] and no weights."""
    if segserve_batch is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the segserve_batch forward kwarg")
    # The model passes sliding_window=None for full-attention layers when it passes it at all.
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    layer = module.layer_idx
    cache = segserve_batch.kv_cache
    cache.write(layer, segserve_batch.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    num_heads, num_tokens, head_dim = query.shape[1], query.shape[2], value.shape[-1]
    tokens_query = query[0].transpose(0, 1)  # [T, H, D]
    out = query.new_empty(num_tokens, num_heads, head_dim)  # [T, H, D]
    for group in segserve_batch.groups:
        group_key, group_value = cache.gather(layer, group.key_slots)  # [R, KVH, L, D]
        num_groups = num_heads // group_key.shape[1]
        rows, num_queries = group.query_index.shape
        # [R, Q, H, D] -> [R, KVH, G * Q, D]: query head h reads kv head h // G, so the G heads
        # of one kv head become G blocks of Q rows and no key/value is repeated.
        group_query = tokens_query[group.query_index].permute(0, 2, 1, 3)
        group_query = group_query.reshape(rows, group_key.shape[1], num_groups * num_queries, -1)
        mask = group.attn_mask(window, num_groups)  # [R, 1, G * Q, L]
        attn = _attend(group_query, group_key, group_value, mask, scaling, softcap)  # [R, KVH, G * Q, D]
        attn = attn.reshape(rows, num_heads, num_queries, head_dim).transpose(1, 2)  # [R, Q, H, D]
        out[group.out_tokens] = attn.reshape(rows * num_queries, num_heads, head_dim)[group.out_rows]
    return out.unsqueeze(0), None


def _attend(query, key, value, mask, scaling, softcap):
    """Masked attention; SDPA unless the model caps its attention logits (SDPA cannot)."""
    if softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # [R, KVH, G * Q, L]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
