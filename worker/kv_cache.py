"""The paged KV cache: fixed-size blocks of key/value slots per layer.

The worker owns this memory; the scheduler owns its allocation and sends each
sequence's block table. A token at storage position `pos` of a sequence lives in
slot `block_table[pos // block_size] * block_size + pos % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheShape:
    """Per-layer geometry of the cache, read from the model config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    """Width of a key head (and of a value head, unless value_head_dim says otherwise)."""
    value_head_dim: int = 0
    """Width of a value head when it differs from a key head's (multi-head latent attention); 0: head_dim."""
    layer_kv_heads: tuple[int, ...] = ()
    """KV heads of each layer: num_kv_heads, or 0 for a layer without attention (a hybrid's convolution or SSM
    layers), which gets no cache. Empty: num_kv_heads in every layer."""

    def __post_init__(self) -> None:
        if not self.value_head_dim:
            object.__setattr__(self, "value_head_dim", self.head_dim)
        if not self.layer_kv_heads:
            object.__setattr__(self, "layer_kv_heads", (self.num_kv_heads,) * self.num_layers)
        if len(self.layer_kv_heads) != self.num_layers:
            raise ValueError(f"{len(self.layer_kv_heads)} layers' KV heads for {self.num_layers} layers")

    @property
    def last_attention_layer(self) -> int:
        """The last layer that has a KV cache."""
        return max(i for i, heads in enumerate(self.layer_kv_heads) if heads)

    @classmethod
    def from_model_config(cls, config) -> KVCacheShape:
        """Multi-head latent attention (kv_lora_rank) that worker/latent_attention.py does not serve from its latent
        (DeepSeek-V2's) is cached as the keys and values its latent expands to, every attention head's: keys of
        qk_nope_head_dim + qk_rope_head_dim, values of v_head_dim, as transformers hands them to the attention."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = text.num_attention_heads
        if getattr(text, "kv_lora_rank", None):
            key_dim = text.qk_nope_head_dim + text.qk_rope_head_dim
            return cls(text.num_hidden_layers, num_heads, key_dim, text.v_head_dim)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        layer_types = getattr(text, "layer_types", None) or ()
        layer_kv_heads = tuple(0 if kind in NO_ATTENTION_LAYERS else num_kv_heads for kind in layer_types)
        return cls(text.num_hidden_layers, num_kv_heads, head_dim, layer_kv_heads=layer_kv_heads)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes over all layers, keys and values."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return sum(self.layer_kv_heads) * block_size * (self.head_dim + self.value_head_dim) * itemsize


NO_ATTENTION_LAYERS = frozenset({"conv", "mamba", "linear_attention"})
"""Layer types (a config's layer_types) that keep no keys and values: hybrids' convolution, Mamba and linear
attention layers."""


def num_blocks_in_gb(shape: KVCacheShape, block_size: int, dtype: torch.dtype, kv_cache_gb: float) -> int:
    """How many blocks fit in kv_cache_gb GiB."""
    return max(1, int(kv_cache_gb * 2**30) // shape.bytes_per_block(block_size, dtype))


class PagedKVCache:
    """K and V tensors per layer, [num_blocks, block_size, num_kv_heads, head_dim] and [..., value_head_dim]."""

    def __init__(self, shape: KVCacheShape, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        # zeros, not empty: padded key slots are read (and masked out); a NaN there
        # would still poison the output through 0 * NaN in the value product.
        self.keys = [torch.zeros(num_blocks, block_size, heads, shape.head_dim, dtype=dtype, device=device)
                     for heads in shape.layer_kv_heads]
        self.values = [torch.zeros(num_blocks, block_size, heads, shape.value_head_dim, dtype=dtype, device=device)
                       for heads in shape.layer_kv_heads]
        self._flat_keys = [k.flatten(0, 1) for k in self.keys]
        self._flat_values = [v.flatten(0, 1) for v in self.values]

    def write(self, layer_idx: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new tokens. slots: [T] flat slot ids; key/value: [T, num_kv_heads, head_dim]."""
        self._flat_keys[layer_idx].index_copy_(0, slots, key)
        self._flat_values[layer_idx].index_copy_(0, slots, value)

    def clear_non_finite(self, blocks: torch.Tensor) -> None:
        """Set every non-finite key and value in `blocks` [B] (block ids) to 0, in every layer; finite ones stay.

        For the blocks of a sequence whose forward overflowed: a block outlives its sequence, and attention
        reads the slots of a block past a sequence's own tokens (masked, but a masked value still enters the
        product as 0 * value), so a NaN left there would fail whichever sequence takes the block next."""
        for cache in (*self.keys, *self.values):
            cache.index_copy_(0, blocks, cache.index_select(0, blocks).nan_to_num_(0.0, 0.0, 0.0))

    def move(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy every layer's K and V from src_slots [M] to dst_slots [M] (all sources read first)."""
        for flat in (*self._flat_keys, *self._flat_values):
            flat.index_copy_(0, dst_slots, flat.index_select(0, src_slots))

    def gather(self, layer_idx: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read slots [R, L] as keys [R, num_kv_heads, L, head_dim] and values [R, num_kv_heads, L, value_head_dim]."""
        dims = (*slots.shape, self.shape.layer_kv_heads[layer_idx], -1)  # [R, L, KVH, D]
        flat = slots.reshape(-1)
        key = self._flat_keys[layer_idx].index_select(0, flat).view(dims)
        value = self._flat_values[layer_idx].index_select(0, flat).view(dims)
        return key.transpose(1, 2), value.transpose(1, 2)

