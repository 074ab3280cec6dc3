"""Checks that a step is one the worker can run, before any state changes.

Two kinds of failure:
- `sequence_problem` names what is wrong with ONE scheduled sequence (unknown id, short block
  table, token out of the vocabulary, a malformed tree...), and `constrained_problem` what a
  sequence with a structured output cannot run; the runner leaves that sequence out of
  the forward and answers it with an error output, and the rest of the batch runs. A structured
  output whose grammar does not compile fails the same way (worker/planning.py).
- `InvalidRequest` is a step malformed as a whole (a sequence scheduled twice, two sequences
  writing one KV slot: `has_overlapping_slots`); the gRPC server maps it to INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protos.segserve.v1.step import ScheduledSequence


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
    if min(seq.token_ids) < 0 or max(seq.token_ids) >= limits.input_vocab_size:
        return f"token_ids must be in [0, {limits.input_vocab_size})"
    if seq.sample_indices and (min(seq.sample_indices) < 0 or max(seq.sample_indices) >= n):
        return f"sample_indices must be in [0, {n})"
    if seq.draft is not None:
        problem = _tree_problem(seq, limits)
        if problem is not None:
            return problem
    num_tokens = seq.num_tokens
    if num_tokens > limits.max_model_len:
        return f"{num_tokens} tokens exceed max_model_len={limits.max_model_len}"
    needed_blocks = -(-num_tokens // limits.block_size)
    if len(seq.block_table) < needed_blocks:
        return f"block_table has {len(seq.block_table)} blocks, {num_tokens} tokens need {needed_blocks}"
    return None  # block ids are checked as they enter the block tables (worker/block_tables.py)


def constrained_problem(seq: ScheduledSequence) -> str | None:
    """Why a sequence with a structured output cannot run `seq` (None when it can): its grammar follows its output,
    so a plain step samples one row, at the end of its tokens (a tree step samples every node of its tree, each
    under the grammar's state after the node's path)."""
    if seq.draft is None and seq.sample_indices not in ((), (len(seq.token_ids) - 1,)):
        return (f"sequence {seq.seq_id!r}: a sequence with a structured_output samples only at its last token "
                f"(got sample_indices {list(seq.sample_indices)} for {len(seq.token_ids)} tokens)")
    return None


def _tree_problem(seq: ScheduledSequence, limits: StepLimits) -> str | None:
    """A tree step: exactly one token (the root), no sample indices, a well-formed tree."""
    if len(seq.token_ids) != 1 or seq.sample_indices:
        return (f"a tree step takes exactly one token (the root) and no sample_indices "
                f"(got {len(seq.token_ids)} tokens, {len(seq.sample_indices)} sample indices)")
    problem = seq.draft.problem(vocab_size=limits.input_vocab_size)
    return None if problem is None else f"invalid draft tree: {problem}"


def has_overlapping_slots(slots: np.ndarray) -> bool:
    """Whether two new tokens of one step would be written to the same cache slot. slots: [T] (host)."""
    return len(set(slots.tolist())) != slots.size  # a set: 3x faster than np.unique here, up to 2,048 tokens
