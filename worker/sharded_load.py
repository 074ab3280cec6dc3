"""Load one rank's shard of a checkpoint (worker/tensor_parallel.py), reading only that slice of each tensor.

The model is built on the meta device (accelerate's init_empty_weights: no parameter memory, real buffers such as
the rotary frequencies) from a config that describes one rank: its query and key-value heads and its 1/N of the
MLP. Each parameter then gets its slice straight from the safetensors files, memory-mapped: a rank reads only its
rows or columns of each tensor, in the dtype asked for, so a rank's host memory is its shard, not the model.
The output projection and down projection are wrapped to all-reduce, the embedding and LM head cut by vocabulary.
"""

from __future__ import annotations

import copy
import json
import resource
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch import nn
from torch.nn import functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from worker.attention import ATTN_IMPLEMENTATION
from worker.lean_decoder import LEAN_DECODERS
from worker.tensor_parallel import (
    HeadLayout,
    RankGroup,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
    VocabParallelHead,
    even_shard,
    vocab_shard,
)

ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")
"""The linears whose input columns are split (all-reduced after)."""


class Checkpoint:
    """A safetensors checkpoint (one file or an index of several), memory-mapped; tensors read by slice."""

    def __init__(self, path: Path):
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (path / "model.safetensors").exists():
            weight_map = None
        else:
            raise ValueError(f"tensor parallelism loads safetensors checkpoints; {path} has none")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._files = {name: safe_open(path / name, framework="pt") for name in files}
        self._where = weight_map or {key: files[0] for key in self._files[files[0]].keys()}  # noqa: SIM118 (not a dict)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> list[int]:
        return self._files[self._where[key]].get_slice(key).get_shape()

    def read(self, key: str, shard: Shard | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Tensor `key`, or only its shard (padded with zero rows to shard.size), as dtype on device."""
        if key not in self._where:
            raise ValueError(f"the checkpoint has no tensor {key!r}")
        tensor_slice = self._files[self._where[key]].get_slice(key)
        if shard is None:
            tensor = tensor_slice[:]
        elif shard.dim == 0:
            tensor = tensor_slice[shard.start:shard.stop]
        else:
            tensor = tensor_slice[:, shard.start:shard.stop]
        tensor = tensor.to(device=device, dtype=dtype)
        if shard is not None and shard.dim == 0 and tensor.shape[0] < shard.size:
            tensor = F.pad(tensor, (0, 0) * (tensor.dim() - 1) + (0, shard.size - tensor.shape[0]))
        return tensor


def check_shardable(path: Path, size: int) -> HeadLayout:
    """How the model at `path` falls on `size` ranks; ValueError naming the problem when it cannot: an architecture
    without a lean decoder (the sharded layers run in it), or heads or MLP columns that size does not divide."""
    config = AutoConfig.from_pretrained(path)
    architecture = (config.architectures or ["?"])[0]
    if architecture not in LEAN_DECODERS:
        raise ValueError(f"tensor parallelism serves {', '.join(LEAN_DECODERS)}; {path.name} is {architecture}")
    text = config.get_text_config()
    num_heads = text.num_attention_heads
    layout = HeadLayout(num_heads, getattr(text, "num_key_value_heads", None) or num_heads,
                        getattr(text, "head_dim", None) or text.hidden_size // num_heads, size)
    layout.check(text.intermediate_size, config.model_type)
    return layout


def load_shard(path: Path, dtype: torch.dtype, device: torch.device, ranks: RankGroup) -> nn.Module:
    """The causal LM at `path` as rank `ranks.rank` of `ranks.size` holds it; ValueError when N cannot split it."""
    layout = check_shardable(path, ranks.size)
    config = AutoConfig.from_pretrained(path)
    text = config.get_text_config()
    local = copy.deepcopy(config)
    local_text = local.get_text_config()
    local_text.head_dim = layout.head_dim
    local_text.num_attention_heads, local_text.num_key_value_heads = layout.local_heads, layout.local_kv_heads
    local_text.intermediate_size = text.intermediate_size // ranks.size
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(local, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
    checkpoint = Checkpoint(path)
    _load_layers(model, checkpoint, layout, ranks, dtype, device)
    _load_vocabulary(model, checkpoint, ranks, dtype, device)
    for name, param in model.named_parameters():
        if param.is_meta:  # norms and the like: whole on every rank
            _set_parameter(model, name, checkpoint.read(name, None, dtype, device))
    for name, buffer in model.named_buffers():
        if buffer.device != device:
            _set_buffer(model, name, buffer.to(device))
    return model.eval()


def peak_host_gib() -> float:
    """This process's peak resident memory so far, GiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _load_layers(model: nn.Module, checkpoint: Checkpoint, layout: HeadLayout, ranks: RankGroup,
                 dtype: torch.dtype, device: torch.device) -> None:
    rank, text = ranks.rank, model.config.get_text_config()
    mlp_columns = even_shard(text.intermediate_size * ranks.size, rank, ranks.size)
    shards = {"self_attn.q_proj": layout.query_rows(rank), "self_attn.k_proj": layout.kv_rows(rank),
              "self_attn.v_proj": layout.kv_rows(rank), "mlp.gate_proj": mlp_columns, "mlp.up_proj": mlp_columns}
    prefix = _prefix_of(model, model.model.layers)
    for index, layer in enumerate(model.model.layers):
        for name, shard in shards.items():
            linear = layer.get_submodule(name)
            key = f"{prefix}.{index}.{name}"
            _assign(linear, "weight", checkpoint.read(f"{key}.weight", shard, dtype, device))
            if linear.bias is not None:
                _assign(linear, "bias", checkpoint.read(f"{key}.bias", shard, dtype, device))
        for name, columns in zip(ROW_PARALLEL, (layout.query_rows(rank), mlp_columns)):
            parent_name, _, attr = name.rpartition(".")
            parent, linear = layer.get_submodule(parent_name), layer.get_submodule(name)
            key = f"{prefix}.{index}.{name}"
            bias = checkpoint.read(f"{key}.bias", None, dtype, device) if linear.bias is not None else None
            inner = nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
            _assign(inner, "weight", checkpoint.read(f"{key}.weight", Shard(1, columns.start, columns.stop,
                                                                              columns.size), dtype, device))
            setattr(parent, attr, RowParallelLinear(inner, bias, ranks))


def _load_vocabulary(model: nn.Module, checkpoint: Checkpoint, ranks: RankGroup, dtype: torch.dtype,
                     device: torch.device) -> None:
    """The embedding and the LM head, each rank its rows of the vocabulary (one tensor where they are tied)."""
    embed = model.get_input_embeddings()
    embed_key = f"{_prefix_of(model, embed)}.weight"
    vocab_size = checkpoint.shape(embed_key)[0]
    shard = vocab_shard(vocab_size, ranks.rank, ranks.size)
    embed_weight = checkpoint.read(embed_key, shard, dtype, device)
    scale = getattr(embed, "embed_scale", None)
    model.set_input_embeddings(VocabParallelEmbedding(
        embed_weight, shard, vocab_size, None if scale is None else scale.to(device), ranks))
    head = model.get_output_embeddings()
    head_key = f"{_prefix_of(model, head)}.weight"
    is_tied = head_key not in checkpoint and model.config.get_text_config().tie_word_embeddings
    head_weight = embed_weight if is_tied else checkpoint.read(head_key, shard, dtype, device)
    linear = nn.Linear(head.in_features, shard.size, bias=False, device="meta")
    _assign(linear, "weight", head_weight)
    model.set_output_embeddings(VocabParallelHead(linear, vocab_size, ranks))


def _prefix_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module)


def _assign(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    expected = getattr(module, name).shape
    if tensor.shape != expected:
        raise ValueError(f"a shard of shape {tuple(tensor.shape)} where the model's {name} is {tuple(expected)}")
    setattr(module, name, nn.Parameter(tensor, requires_grad=False))


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    _assign(model.get_submodule(owner), attr, tensor)


def _set_buffer(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    module.register_buffer(attr, tensor, persistent=attr not in module._non_persistent_buffers_set)
