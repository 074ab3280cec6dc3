"""Checks that a step is one the worker can run, before any state changes.

Two kinds of failure:
- `sequence_problem` names what is wrong with ONE scheduled sequence (unknown id, short block
  table, token out of the vocabulary, a malformed tree...); the runner leaves that sequence out
  of the forward and answers it with an error output, and the rest of the batch runs.
- `InvalidRequest` is a step malformed as a whole (a sequence scheduled twice, two sequences
  writing one KV slot); the gRPC server maps it to INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protos.segserve.v1.step import ScheduledSequence
from worker.kv_cache import slot_ids


class InvalidRequest(ValueError):
    """A step the worker cannot run at all as sent."""


@dataclass(frozen=True)
class StepLimits:
    """What the loaded model and its KV cache can take."""

    num_blocks: int
    block_size: int
    input_vocab_size: int
    max_model_len: int


def sequence_problem(seq: ScheduledSequence, num_known_tokens: int | None, limits: StepLimits) -> str | None:
    """Why `seq` cannot run (a message naming the sequence and the field), or None when it can.

    num_known_tokens: how many of the sequence's tokens the worker has seen; None = unknown sequence.
    """
    problem = _problem(seq, num_known_tokens, limits)
    return None if problem is None else f"sequence {seq.seq_id!r}: {problem}"


def _problem(seq: ScheduledSequence, num_known_tokens: int | None, limits: StepLimits) -> str | None:
    n = len(seq.token_ids)
    if num_known_tokens is None:
        return "unknown seq_id: send a NewSequence first"
    if n == 0:
        return "token_ids is empty"
    if seq.num_computed_tokens > num_known_tokens:
        return (f"num_computed_tokens={seq.num_computed_tokens} but the worker knows only {num_known_tokens} "
                "of its tokens (restart it with a NewSequence)")
    if any(t >= limits.input_vocab_size or t < 0 for t in seq.token_ids):
        return f"token_ids must be in [0, {limits.input_vocab_size})"
    if any(i >= n or i < 0 for i in seq.sample_indices):
        return f"sample_indices must be in [0, {n})"
    if seq.draft is not None:
        problem = _tree_problem(seq, limits)
        if problem is not None:
            return problem
    if seq.num_tokens > limits.max_model_len:
        return f"{seq.num_tokens} tokens exceed max_model_len={limits.max_model_len}"
    needed_blocks = -(-seq.num_tokens // limits.block_size)
    if len(seq.block_table) < needed_blocks:
        return f"block_table has {len(seq.block_table)} blocks, {seq.num_tokens} tokens need {needed_blocks}"
    if any(b >= limits.num_blocks or b < 0 for b in seq.block_table[:needed_blocks]):
        return f"block ids must be in [0, {limits.num_blocks})"
    return None


def _tree_problem(seq: ScheduledSequence, limits: StepLimits) -> str | None:
    """A tree step: exactly one token (the root), no sample indices, a well-formed tree."""
    if len(seq.token_ids) != 1 or seq.sample_indices:
        return (f"a tree step takes exactly one token (the root) and no sample_indices "
                f"(got {len(seq.token_ids)} tokens, {len(seq.sample_indices)} sample indices)")
    problem = seq.draft.problem(vocab_size=limits.input_vocab_size)
    return None if problem is None else f"invalid draft tree: {problem}"


def validate_disjoint_slots(sequences: Sequence[ScheduledSequence], block_size: int) -> None:
    """Raise InvalidRequest when two new tokens of one step would be written to the same cache slot.

    Only for sequences that passed sequence_problem (their block tables cover their tokens).
    """
    if not sequences:
        return
    slots = torch.cat([
        slot_ids(torch.tensor(seq.block_table, dtype=torch.long), seq.num_computed_tokens, seq.num_tokens, block_size)
        for seq in sequences
    ])
    if slots.unique().numel() != slots.numel():
        raise InvalidRequest("two scheduled tokens would write the same KV-cache slot (overlapping block tables)")
