"""Checks that a scheduled sequence is one the worker can run, before any state changes.

Every failure raises InvalidRequest with a message naming the sequence and the field;
the gRPC server maps it to INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker.kv_cache import slot_ids
from worker.messages import InvalidRequest, ScheduledSequence


@dataclass(frozen=True)
class StepLimits:
    """What the loaded model and its KV cache can take."""

    num_blocks: int
    block_size: int
    input_vocab_size: int
    max_model_len: int


def validate_sequence(seq: ScheduledSequence, num_known_tokens: int, limits: StepLimits) -> None:
    """Raise InvalidRequest unless `seq` fits the model, the cache and the worker's history of it.

    num_known_tokens: how many of the sequence's tokens the worker has seen so far.
    """
    name = f"sequence {seq.seq_id!r}"
    n = len(seq.token_ids)
    if n == 0:
        raise InvalidRequest(f"{name}: token_ids is empty")
    if seq.num_computed_tokens > num_known_tokens:
        raise InvalidRequest(
            f"{name}: num_computed_tokens={seq.num_computed_tokens} but the worker knows only "
            f"{num_known_tokens} of its tokens (restart it with a NewSequence)"
        )
    if any(t >= limits.input_vocab_size or t < 0 for t in seq.token_ids):
        raise InvalidRequest(f"{name}: token_ids must be in [0, {limits.input_vocab_size})")
    if seq.num_tokens > limits.max_model_len:
        raise InvalidRequest(f"{name}: {seq.num_tokens} tokens exceed max_model_len={limits.max_model_len}")
    needed_blocks = -(-seq.num_tokens // limits.block_size)
    if len(seq.block_table) < needed_blocks:
        raise InvalidRequest(
            f"{name}: block_table has {len(seq.block_table)} blocks, {seq.num_tokens} tokens need {needed_blocks}"
        )
    if any(b >= limits.num_blocks or b < 0 for b in seq.block_table[:needed_blocks]):
        raise InvalidRequest(f"{name}: block ids must be in [0, {limits.num_blocks})")
    if seq.position_ids is not None:
        if len(seq.position_ids) != n:
            raise InvalidRequest(f"{name}: {len(seq.position_ids)} position_ids for {n} tokens")
        if any(p >= limits.max_model_len or p < 0 for p in seq.position_ids):
            raise InvalidRequest(f"{name}: position_ids must be in [0, {limits.max_model_len})")
    if seq.attention_mask is not None:
        if seq.attention_mask.shape != (n, n):
            raise InvalidRequest(f"{name}: attention_mask shape {seq.attention_mask.shape}, expected {(n, n)}")
        if not np.diagonal(seq.attention_mask).all():
            raise InvalidRequest(f"{name}: attention_mask must let every token attend to itself")
    if any(i >= n or i < 0 for i in seq.sample_indices):
        raise InvalidRequest(f"{name}: sample_indices must be in [0, {n})")
    if seq.draft_parents is not None:
        _validate_tree(seq, name)


def _validate_tree(seq: ScheduledSequence, name: str) -> None:
    """A tree step: one parent per draft token, each an earlier node; the worker derives the layout."""
    if len(seq.draft_parents) != len(seq.token_ids) - 1:
        raise InvalidRequest(f"{name}: {len(seq.draft_parents)} draft_parents for {len(seq.token_ids) - 1} drafts")
    if any(not 0 <= parent <= i for i, parent in enumerate(seq.draft_parents)):
        raise InvalidRequest(f"{name}: draft_parents[i] must be in [0, i] (an earlier node)")
    if seq.position_ids is not None or seq.attention_mask is not None or seq.sample_indices:
        raise InvalidRequest(f"{name}: a tree step (draft_parents) takes no position_ids, attention_mask "
                             "or sample_indices")


def validate_disjoint_slots(sequences: list[ScheduledSequence], block_size: int) -> None:
    """Raise InvalidRequest when two new tokens of one step would be written to the same cache slot."""
    if not sequences:
        return
    slots = torch.cat([
        slot_ids(torch.tensor(seq.block_table, dtype=torch.long), seq.num_computed_tokens, seq.num_tokens, block_size)
        for seq in sequences
    ])
    if slots.unique().numel() != slots.numel():
        raise InvalidRequest("two scheduled tokens would write the same KV-cache slot (overlapping block tables)")
