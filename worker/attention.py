"""Paged attention under the stock transformers model code.

`segserve_paged` is registered with transformers' AttentionInterface, so any
causal LM whose attention modules call `attention_interface(...)` runs with it
unchanged. The model gets one packed row of every scheduled token ([1, T]) and
builds no mask of its own (the name is not a mask implementation); everything
the attention needs travels as the `segserve_batch` forward kwarg, an
`AttentionBatch` built once per step and shared by all layers.

Building it is cheap and mostly on the device: the host computes a `StepLayout`
(a few numpy arrays per step) and a `GroupPlan` per group of similar query
counts (worker/attention_plan.py), the runner uploads all of them in one copy (worker/upload.py), and the
key slots, positions and masks are derived on the device from the persistent
block tables (worker/block_tables.py). Key lengths are padded to a few bucketed
sizes, so consecutive decode steps reuse tensor shapes.

Per layer: write the new keys/values into their cache slots, then for each group
of similarly sized sequences gather [R, KVH, L, D] keys/values from the cache
and run one masked SDPA. Each query sees every cached position of its sequence
plus the new tokens its mask allows (causal, or a candidate tree); sliding-window
layers also hide keys whose rotary position is `window` or more behind, and once
the context is longer than their window they gather only the keys within reach
(AttentionGroup.layer_keys: gemma-3-270m's window is 512 keys). When one
group holds every token of the step in order, with no padding (every sequence
decoding, say), its queries and its output are the packed row itself, neither
gathered nor scattered (three indexing ops per layer fewer). A cached
key's rotary position is its storage index (the scheduler only counts tokens as
computed when they sit at their own position); a new key's is its Work position.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import AttentionInterface

from worker.attention_plan import GroupPlan, bucket_keys
from worker.faults import non_finite_tokens
from worker.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "segserve_paged"


@dataclass
class AttentionGroup:
    """R sequences padded to Q queries and L keys, attended in one call (every tensor on the model's device)."""

    query_index: torch.Tensor  # [R, Q] long: token index in the packed step row (0 for padding)
    key_slots: torch.Tensor  # [R, L] long: cache slot of every key (a valid but masked slot for padding)
    mask: torch.Tensor  # [R, Q, L] bool: True where query may attend key (window not applied)
    query_pos: torch.Tensor  # [R, Q] long: rotary positions of queries
    key_pos: torch.Tensor  # [R, L] long: rotary positions of keys
    is_pad_query: torch.Tensor  # [R, Q] bool
    out_rows: torch.Tensor  # [M] long: flat r * Q + q of real queries
    out_tokens: torch.Tensor  # [M] long: their token index in the packed row
    window_source: WindowSource
    """What a sliding-window layer's shorter key range is built from."""
    is_whole_step: bool = False
    """The step's only group, without padding queries: its R * Q queries are the packed row's tokens in order, so
    the attention reads the queries and writes its output as they are, without gathering or scattering rows."""
    _masks: dict = field(default_factory=dict)
    _windows: dict = field(default_factory=dict)

    def attn_mask(self, window: int | None, num_groups: int, dtype: torch.dtype) -> torch.Tensor:
        """[R, 1, num_groups * Q, L] additive mask of `dtype` for a layer (_additive), cached per (window,
        num_groups, dtype); [R, 1, 1, L] with one query per row (decode), which attention broadcasts over the query
        heads instead of copying it."""
        cached = self._masks.get((window, num_groups, dtype))
        if cached is None:
            mask = self.mask
            if window is not None:
                # mask: [R, Q, L]; a key `window` or more positions behind the query is out of reach
                mask = mask & (self.query_pos[:, :, None] - self.key_pos[:, None, :] < window)
                # a padding query keeps key 0 so its softmax row is never empty (no NaN)
                mask[:, :, 0] |= self.is_pad_query
            cached = _additive(_per_query_head(mask, num_groups), dtype)
            self._masks[(window, num_groups, dtype)] = cached
        return cached

    def layer_keys(self, window: int | None, num_groups: int, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The key slots [R, L'] and additive mask [R, 1, G * Q or 1, L'] of `dtype` a layer with this window
        attends with.

        A sliding-window layer reads only the keys its queries can reach, when that range is shorter than the
        group's keys: from the WINDOW_KEY_GRID line at or below `window` - 1 keys before a row's first new token
        to its last new token (gemma-3-270m's window is 512 keys, against contexts of thousands). The keys it
        skips are the ones the full range masks."""
        cache_key = (window, num_groups, dtype)
        if cache_key not in self._windows:
            windowed = None if window is None else self.window_source.keys(window, self)
            self._windows[cache_key] = windowed and (windowed[0],
                                                     _additive(_per_query_head(windowed[1], num_groups), dtype))
        return self._windows[cache_key] or (self.key_slots, self.attn_mask(window, num_groups, dtype))


def _per_query_head(mask: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[R, Q, L] -> [R, 1, G * Q, L] for G query heads per kv head; one query per row stays [R, 1, 1, L], which
    attention broadcasts over the query heads instead of copying it."""
    return (mask if mask.shape[1] == 1 else mask.repeat(1, num_groups, 1)).unsqueeze(1)


MASK_ALIGNMENT = 8
"""Elements: the strides CUDA's memory-efficient attention kernel needs of a mask; SDPA pads a copy of any other."""


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask [..., L] (True: may attend) as SDPA would turn it into an additive one at every call: 0 where
    True, -inf where False, in the queries' dtype. Made once per step here, instead of at each layer (on CUDA with
    a pad too, unless the strides are aligned: the rows are stored MASK_ALIGNMENT-aligned, the view is [..., L])."""
    length = mask.shape[-1]
    stored = -(-length // MASK_ALIGNMENT) * MASK_ALIGNMENT
    additive = mask.new_empty((*mask.shape[:-1], stored), dtype=dtype)[..., :length]
    return additive.fill_(float("-inf")).masked_fill_(mask, 0.0)


WINDOW_KEY_GRID = 16
"""A sliding-window layer's key range starts at a multiple of this many keys, so that a key keeps its offset
modulo 16 in the gathered range (as in the full range) from one step or chunking to the next. Measured on this
CPU, with the tiny model: a five-token chunk's logits were bit-identical to reading every key with a grid of 16,
and differed by 3e-6 with none. A grid of 512 (torch's CPU flash-attention key block) cost 1.33-1.44x the step
time of none at batch 16 with 1,500-token contexts on gemma-3-270m."""


@dataclass
class WindowSource:
    """A group's rows as a sliding-window layer needs them: block tables, sizes, and the host's copy of where
    each row's keys end (so the windowed key count is known without reading the device)."""

    tables: torch.Tensor  # [R, C] long: the block-table columns the group's keys reach
    start: torch.Tensor  # [R, 1] long: num_computed_tokens
    length: torch.Tensor  # [R, 1] long: tokens this step
    depth: torch.Tensor  # [R, Q] long
    sees: torch.Tensor  # [R, Q, Q] (0/1)
    block_size: int
    host_starts: np.ndarray  # [R] int64
    host_ends: np.ndarray  # [R] int64: num_computed_tokens + tokens this step
    bucket: Callable[[int], int] = bucket_keys  # pads the windowed key count

    def keys(self, window: int, group: AttentionGroup) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Key slots and [R, Q, L'] mask of the keys within `window` of the group's queries, or None when
        they would be no fewer than the group's L (then the full range, masked, is the same attention)."""
        num_keys = windowed_num_keys(window, self.host_starts, self.host_ends, self.bucket)
        if num_keys >= group.key_slots.shape[1]:
            return None
        first = (self.start - window + 1).clamp_(min=0).div_(WINDOW_KEY_GRID, rounding_mode="floor")
        first *= WINDOW_KEY_GRID  # [R, 1]
        key = first + torch.arange(num_keys, device=first.device)  # [R, L']: key index (= storage position)
        key_slots = _window_slots(self.tables, first, key, self.block_size)
        mask, key_pos = _key_mask(key, self.start, self.length, self.depth, self.sees, group.is_pad_query)
        mask &= group.query_pos[:, :, None] - key_pos[:, None, :] < window  # the range starts below the window
        if mask.shape[1] > 1:  # a padding query keeps a key, so that its softmax row is never empty
            mask[:, :, 0] |= group.is_pad_query
        return key_slots, mask


def _window_slots(tables: torch.Tensor, first: torch.Tensor, key: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slots [R, L'] of keys key [R, L'] (storage positions, each row's from first [R, 1] on, a multiple of
    WINDOW_KEY_GRID), from the rows' block-table columns tables [R, C]. Past a row's last key, a column is capped to
    the last one the group reads (a real block, masked).

    Where block_size divides the grid, every row starts on a block: the blocks are gathered, one entry per block,
    and their slots laid out by a broadcast add, as _key_slots does. On this CPU, 64 rows of 544 keys (gemma-3-270m's
    window of 512) took 134 us by a gather per key and 37 us so."""
    num_cols, num_keys = tables.shape[1], key.shape[1]
    if WINDOW_KEY_GRID % block_size:
        return tables.gather(1, (key // block_size).clamp_(max=num_cols - 1)) * block_size + key % block_size
    num_blocks = -(-num_keys // block_size)
    columns = (first // block_size + torch.arange(num_blocks, device=first.device)).clamp_(max=num_cols - 1)
    return _block_slots(tables.gather(1, columns), torch.arange(block_size, device=first.device), num_keys)


def windowed_num_keys(window: int, host_starts: np.ndarray, host_ends: np.ndarray,
                      bucket: Callable[[int], int] = bucket_keys) -> int:
    """The key count of a sliding-window layer's range (WindowSource.keys), padded by `bucket`, for rows whose
    computed tokens are host_starts [R] and that end at host_ends [R] after this step."""
    # a query at `start` reaches back to key start - window + 1; the range starts at the grid line below it
    firsts = np.maximum(host_starts - window + 1, 0) // WINDOW_KEY_GRID * WINDOW_KEY_GRID
    return bucket(int((host_ends - firsts).max()))


@dataclass
class AttentionBatch:
    """Per-step attention metadata: where new tokens go, and what each query may see."""

    kv_cache: PagedKVCache
    slots: torch.Tensor  # [T] long: cache slot of every new token
    groups: list[AttentionGroup]
    non_finite: torch.Tensor | None = None
    """[T] bool, set by the last layer: the new tokens whose key or value there is not finite."""


def build_attention_batch(plans: list[GroupPlan], uploaded: list[torch.Tensor], slots: torch.Tensor,
                          device_tables: torch.Tensor, kv_cache: PagedKVCache) -> AttentionBatch:
    """The step's AttentionBatch from its group plans and their uploaded arrays (every plan's arrays()
    in turn, on the device); key slots, masks and positions are computed on the device from the
    persistent block tables (device_tables [rows, max_blocks] int32). slots: [T] long on the device."""
    parts = iter(uploaded)
    groups = [to_group(plan, [next(parts) for _ in range(7)], device_tables, kv_cache.block_size) for plan in plans]
    return AttentionBatch(kv_cache, slots, groups)


def to_group(plan: GroupPlan, arrays: list[torch.Tensor], device_tables: torch.Tensor, block_size: int,
             is_cached_columns: bool = True) -> AttentionGroup:
    """The device half: key slots, positions and the mask of one group. is_cached_columns=False computes the key
    columns afresh instead of taking _key_columns' (a CUDA graph's capture must not read, or leave in that cache,
    tensors of its own memory pool: worker/decode_graphs.py)."""
    per_row, depth, sees, is_pad, query_index, out_rows, out_tokens = arrays
    rows, num_keys = per_row.shape[1], plan.num_keys
    table_rows, start, length = per_row[0], per_row[1, :, None], per_row[2, :, None]  # [R], [R, 1], [R, 1]
    num_cols = min(-(-num_keys // block_size), device_tables.shape[1])  # only the blocks the keys reach
    columns = _key_columns if is_cached_columns else _key_columns.__wrapped__
    key, block_col, key_offset = columns(num_keys, block_size, num_cols, per_row.device)
    tables = device_tables[:, :num_cols].index_select(0, table_rows).long()  # [R, num_cols]
    key_slots = _key_slots(tables, block_size, num_keys, block_col, key_offset)  # [R, L]
    pad = is_pad.bool()  # [R, Q]
    mask, key_pos = _key_mask(key.expand(rows, num_keys), start, length, depth, sees, pad)
    host_starts = plan.per_row[1]
    windows = WindowSource(tables, start, length, depth, sees, block_size, host_starts, host_starts + plan.per_row[2],
                           plan.bucket)
    return AttentionGroup(query_index=query_index, key_slots=key_slots, mask=mask, query_pos=start + depth,
                          key_pos=key_pos, is_pad_query=pad, out_rows=out_rows, out_tokens=out_tokens,
                          window_source=windows, is_whole_step=plan.is_whole_step)


def _key_mask(key: torch.Tensor, start: torch.Tensor, length: torch.Tensor, depth: torch.Tensor,
              sees: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which keys each query may see, [R, Q, L] bool (no window), and the keys' rotary positions [R, L], for
    keys given by their index key [R, L] (their storage position: cached below start, new from start on)."""
    rows, q = depth.shape
    if q == 1:  # decode: one query per row, at position start, seeing keys 0..start (no padding queries)
        return (key <= start)[:, None, :], key
    rel = key - start  # [R, L]: key index among the new tokens (< 0: cached context)
    is_context = rel < 0
    new_index = rel.clamp(0, q - 1)  # [R, L]
    key_pos = torch.where(is_context, key, start + depth.gather(1, new_index))  # [R, L]
    is_new = ~is_context & (rel < length)  # [R, L]
    sees_key = sees.bool().gather(2, new_index[:, None, :].expand(rows, q, key.shape[1]))  # [R, Q, L]
    mask = (is_context[:, None, :] | (is_new[:, None, :] & sees_key)) & ~pad[:, :, None]  # [R, Q, L]
    mask[:, :, 0] |= pad
    return mask, key_pos


@functools.lru_cache(maxsize=256)
def _key_columns(num_keys: int, block_size: int, num_cols: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key index l, its block-table column (l // block_size, capped at num_cols - 1: a padding key reads a real
    block, masked) and its offset in the block, each [L] long; the same for every step with these sizes (few,
    as key lengths are bucketed), so they are made once."""
    key = torch.arange(num_keys, device=device)
    return key, (key // block_size).clamp_(max=num_cols - 1), key % block_size


def _key_slots(tables: torch.Tensor, block_size: int, num_keys: int, block_col: torch.Tensor,
               key_offset: torch.Tensor) -> torch.Tensor:
    """The cache slot of every key, [R, L] long: the rows' block-table entries tables [R, C] (long) at the keys'
    columns block_col [L], times block_size, plus their offsets key_offset [L] (_key_columns).

    Where the columns hold every key (no padding key past the table), the keys are each column's block_size slots
    in turn: one broadcast add, no gather. On this CPU, at 64 rows, index_select along the columns took 22, 41,
    250 and 750 us at 80, 160, 1,024 and 4,096 keys, against 10, 14, 34 and 95 us."""
    if block_size <= num_keys <= tables.shape[1] * block_size:
        return _block_slots(tables, key_offset[:block_size], num_keys)
    return tables.index_select(1, block_col) * block_size + key_offset  # padding keys read the last column


def _block_slots(blocks: torch.Tensor, offsets: torch.Tensor, num_keys: int) -> torch.Tensor:
    """The first num_keys slots of each row's blocks [R, C] (long) in turn, [R, num_keys] contiguous: a broadcast
    add of the in-block offsets [block_size] (0, 1, ...) to every block's first slot, no gather."""
    block_size = offsets.shape[0]
    slots = (blocks * block_size).unsqueeze(2) + offsets  # [R, C, block_size]
    return slots.view(len(blocks), -1)[:, :num_keys].contiguous()


def layer_window(module: torch.nn.Module, kwargs: dict) -> int | None:
    """The sliding window of the attention layer `module` (None: full attention), from the kwargs the model
    passes to its attention function (sliding_window=None for full-attention layers, when passed at all)."""
    return kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)


class UnsupportedAttention(ValueError):
    """A model's attention asks for something the paged attention does not do: never dropped silently."""


IGNORED_KWARGS = frozenset({"position_ids", "use_cache", "output_router_logits", "sliding_window"})
"""Keyword arguments models pass to their attention function that change nothing here: the positions are already
in the rotary embedding, the cache is the paged one, router logits are the MoE's business, the window is read by
layer_window. Any other keyword is an UnsupportedAttention error (GPT-OSS's sinks, `s_aux`, are implemented)."""


def check_attention_kwargs(module: torch.nn.Module, kwargs: dict, implemented: frozenset = frozenset()) -> None:
    """UnsupportedAttention naming every keyword in kwargs that is neither ignorable (IGNORED_KWARGS, a dropout of
    0) nor in `implemented`."""
    unknown = sorted(name for name in set(kwargs) - IGNORED_KWARGS - implemented
                     if not (name == "dropout" and not kwargs[name]))
    if unknown:
        raise UnsupportedAttention(f"{type(module).__name__} passes {', '.join(unknown)} to its attention function, "
                                   "which the paged attention does not implement")


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    softcap: float | None = None,
    segserve_batch: AttentionBatch | None = None,
    s_aux: torch.Tensor | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query: [1, H, T, D]; key/value: [1, KVH, T, D] after RoPE; s_aux: [H] attention sinks (GPT-OSS): one logit per
    head that takes a share of the softmax and gives no value. Returns [1, T, H, D] and no weights."""
    if segserve_batch is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the segserve_batch forward kwarg")
    check_attention_kwargs(module, {**kwargs, "dropout": dropout})
    window = layer_window(module, kwargs)
    layer = module.layer_idx
    cache = segserve_batch.kv_cache
    if layer == cache.shape.last_attention_layer:  # an overflow in any layer before it reaches this one
        segserve_batch.non_finite = non_finite_tokens(key, value)
    cache.write(layer, segserve_batch.slots, key[0].transpose(0, 1), value[0].transpose(0, 1))
    num_heads, num_tokens, head_dim = query.shape[1], query.shape[2], value.shape[-1]
    tokens_query = query[0].transpose(0, 1)  # [T, H, D]
    groups = segserve_batch.groups
    if len(groups) == 1 and groups[0].is_whole_step:  # the queries and the output rows are the tokens in order
        attn = _attend_group(groups[0], tokens_query, cache, layer, window, scaling, softcap, s_aux)  # [R, Q, H, D]
        return attn.reshape(1, num_tokens, num_heads, head_dim), None
    out = query.new_empty(num_tokens, num_heads, head_dim)  # [T, H, D]
    for group in groups:
        attn = _attend_group(group, tokens_query, cache, layer, window, scaling, softcap, s_aux)  # [R, Q, H, D]
        rows, num_queries = group.query_index.shape
        out[group.out_tokens] = attn.reshape(rows * num_queries, num_heads, head_dim)[group.out_rows]
    return out.unsqueeze(0), None


def _attend_group(group: AttentionGroup, tokens_query: torch.Tensor, cache: PagedKVCache, layer: int,
                  window: int | None, scaling, softcap, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One group's attention output [R, Q, H, D] (padding queries included). tokens_query: [T, H, D]."""
    num_heads, head_dim = tokens_query.shape[1], tokens_query.shape[2]
    num_groups = num_heads // cache.shape.layer_kv_heads[layer]
    key_slots, mask = group.layer_keys(window, num_groups, tokens_query.dtype)  # [R, L], [R, 1, G * Q or 1, L]
    group_key, group_value = cache.gather(layer, key_slots)  # [R, KVH, L, D]
    rows, num_queries = group.query_index.shape
    if group.is_whole_step:
        group_query = tokens_query.view(rows, num_queries, num_heads, head_dim)
    else:
        group_query = tokens_query[group.query_index]  # [R, Q, H, D]
    # [R, Q, H, D] -> [R, KVH, G * Q, D]: query head h reads kv head h // G, so the G heads
    # of one kv head become G blocks of Q rows and no key/value is repeated.
    group_query = group_query.permute(0, 2, 1, 3).reshape(rows, group_key.shape[1], num_groups * num_queries, -1)
    if sinks is not None:  # head h = kv head h // G, block h % G of its G * Q rows
        num_kv_heads = group_key.shape[1]
        sinks = sinks.view(num_kv_heads, num_groups, 1).expand(-1, -1, num_queries)
        sinks = sinks.reshape(1, num_kv_heads, num_groups * num_queries, 1)
    attn = _attend(group_query, group_key, group_value, mask, scaling, softcap, sinks)  # [R, KVH, G * Q, D]
    return attn.reshape(rows, num_heads, num_queries, -1).transpose(1, 2)  # values' width: keys' but under MLA


def _attend(query, key, value, mask, scaling, softcap, sinks=None):
    """Attention under an additive mask (_additive); SDPA unless the model caps its attention logits or has sinks
    (SDPA does neither). sinks: [1, KVH, G * Q, 1], each row's head's sink logit, a column of the softmax that
    weighs no value, as GPT-OSS's eager attention computes it."""
    if softcap is None and sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # [R, KVH, G * Q, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask  # capped logits are finite: + 0 leaves them as they are, + -inf masks them
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(weights, value)
    scores = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    weights = torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :-1].to(query.dtype)
    return torch.matmul(weights, value)


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
