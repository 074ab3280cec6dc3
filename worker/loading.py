"""Loading the worker's model: its device and dtype, its weights (whole, or this tensor-parallel rank's shard, rank 0
starting the others first), its linears prepared so that no row depends on the batch, and the length it serves.

In: a WorkerConfig (and, on a follower rank, its place among the ranks). Out: a `Loaded` model, which ModelRunner
then gives its attention, KV cache and sequence states.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from worker.attention import ATTN_IMPLEMENTATION
from worker.config import WorkerConfig
from worker.packed_linear import choose_row_policies, pack_linears
from worker.ranks import Followers, Launch, rank_device
from worker.row_blocks import RowPolicy, block_linears, fixed_policy
from worker.sharded_load import check_shardable, load_shard
from worker.tensor_parallel import RankGroup

logger = logging.getLogger(__name__)
DEFAULT_MAX_MODEL_LEN = 2048
"""The longest sequence served of a model that declares no max_position_embeddings, unless max_model_len says."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def keep_compiled_code_per_isa() -> None:
    """Give inductor a cache folder per CPU instruction set, unless the deployment names one of its own
    (TORCHINDUCTOR_CACHE_DIR, other than torch's default, which torch writes there itself once asked). Its cache
    does not tell kernels compiled under one capability from another's: a process run with
    ATEN_CPU_CAPABILITY=avx2 left kernels that aborted a later one on the machine's own AVX-512 (Fatal Python
    error: Aborted, in a compiled layer). Call it before anything is compiled."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default_cache_dir(),
                                                             torch._C._get_cpu_capability().lower())


def resolve_device_dtype(config: WorkerConfig) -> tuple[torch.device, torch.dtype]:
    """"auto" means cuda + bfloat16 when a GPU is present, else cpu + float32."""
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
    if config.dtype != "auto":
        return device, _DTYPES[config.dtype]
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass
class Loaded:
    """A model on its device, in eval mode."""

    model: torch.nn.Module
    device: torch.device
    """Where it is: "cuda" resolved to "cuda:0"; a rank's own device."""
    name: str
    """Who loaded it, for the logs: "the worker", or "rank R of N"."""
    followers: Followers | None
    """Rank 0's other ranks, which run each step with it (worker/ranks.py); None on one device and on them."""
    seed: int | None
    """The seed every rank samples with (None on one device)."""


def load(config: WorkerConfig, path: Path, device: torch.device, dtype: torch.dtype, ranks: RankGroup | None,
         seed: int | None, launch: Launch) -> Loaded:
    """The model at `path` in `dtype`, logging the time it took: whole, or with tensor_parallel_size > 1 this rank's
    shard. Rank 0 (ranks None) first starts the others by `launch`, and stops them when its own load fails."""
    keep_compiled_code_per_isa()
    size, followers = config.tensor_parallel_size, None
    if size > 1:
        check_shardable(path, size)  # before any rank starts
        if ranks is None:
            followers = Followers(config, rank_device(device, 0), launch)
            ranks, seed = followers.group, followers.seed
        device = rank_device(device, ranks.rank)
    started = time.perf_counter()
    try:
        if size > 1:
            model = load_shard(path, dtype, device, ranks)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                         attn_implementation=ATTN_IMPLEMENTATION).to(device).eval()
            device = model.device
    except BaseException:
        if followers is not None:
            followers.close()
        raise
    name = f"rank {ranks.rank} of {size}" if size > 1 else "the worker"
    logger.info("%s loaded %s in %.1f s (%s)", name, path.name, time.perf_counter() - started,
                str(dtype).removeprefix("torch."))
    return Loaded(model, device, name, followers, seed)


def prepare_linears(model: torch.nn.Module, config: WorkerConfig, is_packed: bool) -> None:
    """Pack the large CPU linears for oneDNN (is_packed), merge siblings, and hand every linear its rows so that none
    depends on the batch (worker/row_blocks.py): as this machine's probe finds cheapest at each weight shape, or in
    blocks of config.linear_block_rows."""
    if config.linear_block_rows < 0:
        policies = choose_row_policies(model, is_packed)
        padded = {shape: policy for shape, policy in policies.items() if policy != RowPolicy()}
        logger.info("linear rows as they come, except at weight shapes %s", padded)

        def policy_of(shape: tuple[int, ...]) -> RowPolicy:
            return policies.get(shape, RowPolicy())
    else:
        policy_of = fixed_policy(config.linear_block_rows)
    if is_packed:
        logger.info("packed %d linear weights for oneDNN or merged them with their siblings",
                    pack_linears(model, is_merged=not config.is_compiled, policy_of=policy_of))
    block_linears(model, policy_of)


def max_model_len(model: torch.nn.Module, config: WorkerConfig) -> int:
    """The positions the model has: its max_position_embeddings, or for a model without (ALiBi: Bloom)
    config.max_model_len or DEFAULT_MAX_MODEL_LEN. ValueError when config.max_model_len asks for more."""
    max_len = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_len is None:
        max_len = config.max_model_len or DEFAULT_MAX_MODEL_LEN
        logger.warning("%s declares no max_position_embeddings: serving up to %d tokens (--max-model-len)",
                       type(model).__name__, max_len)
    if config.max_model_len > max_len:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's {max_len} positions")
    return max_len
