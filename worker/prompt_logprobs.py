"""Prompt log-probabilities (OpenAI `echo` with `logprobs`): each prompt token under the raw model.

Prompt token i >= 1 gets log_softmax(raw logits at position i - 1)[token i], float32, with no
sampling processing, and, when num_prompt_logprobs > 0, that many most likely alternatives.
A prefill chunk ending inside the prompt cannot score the next chunk's first token yet: its last
raw logits row is kept in the sequence's `PromptLogprobState` until the next chunk arrives. Each
token is reported exactly once, in order (`next_index`), also when a preempted sequence
recomputes its prompt. Only sequences that ask keep any extra logits rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protos.segserve.v1.step import ScheduledSequence
from protos.segserve.v1.step_result import PromptLogprobs, TopLogprobs


@dataclass
class PromptLogprobState:
    """Per sequence that asks: what was reported and the row waiting for the next chunk."""

    num_top: int
    """Alternatives per token (the request's num_prompt_logprobs)."""
    next_index: int = 1
    """The first prompt token not reported yet (token 0 has no log-probability)."""
    pending_position: int = -1
    """Position of `pending_row`; -1 = none."""
    pending_row: torch.Tensor | None = None
    """[V] raw logits at pending_position, which predict prompt token pending_position + 1."""


@dataclass(frozen=True)
class PromptPlan:
    """What one step reports for one sequence: prompt tokens [start, stop)."""

    start: int
    stop: int
    uses_pending: bool
    """Token `start` is scored by the row kept from the previous chunk."""
    offsets: tuple[int, ...]
    """Indices into the step's token_ids whose raw logits are kept (a contiguous run)."""
    pending_position: int
    """Position of the last kept row when it predicts the next chunk's first token (it becomes the
    pending row); -1 = none."""


def plan(seq: ScheduledSequence, num_prompt_tokens: int, state: PromptLogprobState) -> PromptPlan | None:
    """The prompt tokens this step scores, or None when it computes no prompt token.

    A chunk at positions [first, end) scores prompt tokens up to min(end, P) - 1 and keeps its last
    row pending when end < P. Tokens below next_index were reported already (a recompute after a
    preemption): their rows are not kept.
    """
    first, end = seq.num_computed_tokens, seq.num_computed_tokens + len(seq.token_ids)
    if first >= num_prompt_tokens:
        return None
    stop = min(end, num_prompt_tokens)
    uses_pending = (state.pending_row is not None and state.pending_position == first - 1
                    and first >= state.next_index)
    start = max(state.next_index, first if uses_pending else first + 1)
    keeps_pending = end < num_prompt_tokens and end >= state.next_index
    # The kept rows sit at positions first_row .. last_row - 1 and predict tokens first_row + 1, ...
    first_row = max(start - 1, first)
    last_row = end if keeps_pending else stop - 1
    offsets = tuple(range(first_row - first, max(last_row, first_row) - first))
    return PromptPlan(start, max(start, stop), uses_pending, offsets, end - 1 if keeps_pending else -1)


def compute(items: list[tuple[PromptPlan, PromptLogprobState, list[int], torch.Tensor]]) -> list[PromptLogprobs]:
    """Score every plan and update its state: one batched log_softmax, one gather, one top-k.

    items: per sequence, its plan, its state, its token history and the raw logits [K, V] of its
    kept rows (the plan's offsets).
    """
    rows, targets, num_top = [], [], 0
    for plan_, state, history, kept in items:
        # rows scoring start, start + 1, ..., stop - 1, in order: the pending row first when used
        scoring = torch.cat([state.pending_row[None], kept]) if plan_.uses_pending else kept
        rows.append(scoring[:plan_.stop - plan_.start])
        targets += history[plan_.start:plan_.stop]
        num_top = max(num_top, state.num_top)
        state.next_index = plan_.stop
        state.pending_position = plan_.pending_position
        state.pending_row = kept[-1].float().clone() if plan_.pending_position >= 0 else None
    logprobs = torch.log_softmax(torch.cat(rows).float(), dim=-1)  # [T, V]
    target = torch.tensor(targets, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, target[:, None]).squeeze(1).tolist()  # [T]
    top_ids, top_values = [], []
    if num_top > 0 and targets:
        values, ids = torch.topk(logprobs, min(num_top, logprobs.shape[1]), dim=-1)  # [T, k]
        top_ids, top_values = ids.tolist(), values.tolist()
    results, first = [], 0
    for plan_, state, _, _ in items:
        last = first + plan_.stop - plan_.start
        tops = () if not state.num_top else tuple(
            TopLogprobs(ids[:state.num_top], values[:state.num_top])
            for ids, values in zip(top_ids[first:last], top_values[first:last]))
        results.append(PromptLogprobs(plan_.start, tuple(chosen[first:last]), tops))
        first = last
    return results
