"""Logits warpers: temperature, top_k, top_p and typical_p, each row with its own values.

In: processed logits [S, V] float32 (penalties and logit bias already applied) and one
SamplingParams per row. Out: the same tensor, warped in place, with filtered tokens at -inf.
Each step follows the transformers warper of the same name (the tests' reference).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from protos.segserve.v1.sampling import SamplingParams
from worker.upload import to_device

_TOP_P_CANDIDATES = 1024
"""top_p first looks at this many most likely tokens per row, then 16x as many, and sorts the whole
row only when those do not cover the nucleus (a full sort of a 262k vocabulary costs ~25 ms per
row on a CPU; gemma-3-270m's 0.95-nucleus stays under 1024 tokens at temperature <= 1)."""


def warp(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top_k, top_p, typical_p (transformers' warpers), each row its own values.

    scores: [S, V] float32, modified in place and returned with filtered tokens at -inf (in place
    saves a [S, V] copy per step). Steps no row uses are skipped.
    """
    device, vocab_size = scores.device, scores.shape[1]

    def column(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [S, 1]
        return _on(values, dtype, device)[:, None]

    if any(p.temperature != 1.0 for p in params):
        scores.div_(column([p.temperature for p in params]))
    top_k = [p.top_k if p.top_k < vocab_size else 0 for p in params]  # k >= V keeps every token
    if any(top_k):
        values = torch.topk(scores, max(top_k), dim=-1).values  # [S, k_max], descending
        kth = values.gather(1, column([max(k, 1) - 1 for k in top_k], torch.long))
        is_off = column([k == 0 for k in top_k], torch.bool)
        kth = kth.masked_fill(is_off, -math.inf)  # [S, 1]
        scores.masked_fill_(scores < kth, -math.inf)
    if any(p.top_p < 1.0 for p in params):
        scores = _top_p(scores, [p.top_p for p in params], _TOP_P_CANDIDATES)
    if any(p.typical_p < 1.0 for p in params):
        is_on = column([p.typical_p < 1.0 for p in params], torch.bool)
        scores.masked_fill_(_typical_removed(scores, column([p.typical_p for p in params])) & is_on, -math.inf)
    return scores


def _on(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values as a tensor on device, without making the host wait (worker/upload.py)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def _top_p(scores: torch.Tensor, top_p: list[float], num_candidates: int) -> torch.Tensor:
    """transformers' TopPLogitsWarper per row, in place: drop tokens whose more likely tokens (in
    sorted order) already hold top_p of the mass; the most likely token always stays. [S, V]."""
    device, vocab_size = scores.device, scores.shape[1]
    num_candidates = min(num_candidates, vocab_size)
    cand_logits, cand_idx = torch.topk(scores, num_candidates, dim=-1)  # [S, C], descending
    probs = torch.softmax(scores, dim=-1)  # [S, V]
    # float32 softmax over a large vocabulary is off by a common factor (~2e-5 at 262k); torch's
    # float32 sum is accurate to ~1e-7 (a dtype=float64 sum would copy the whole tensor first).
    cand_probs = probs.gather(1, cand_idx).double() / probs.sum(dim=-1, keepdim=True).double()
    mass_above = cand_probs.cumsum(dim=-1) - cand_probs  # [S, C]: mass of more likely candidates
    p = _on(top_p, torch.float64, device)[:, None]  # [S, 1]
    # [S, 1], >= 1 (the clamp only matters for a row with NaN logits: its token is discarded, but an index of -1
    # would raise here, and on a GPU abort the process)
    num_keep = (mass_above < p).sum(dim=-1, keepdim=True).clamp_(min=1)
    threshold = cand_logits.gather(1, num_keep - 1)  # [S, 1]: least likely kept logit
    threshold = threshold.masked_fill(p >= 1.0, -math.inf)
    # The candidates settle a row unless all of them are kept and more tokens exist.
    unsettled = ((num_keep == num_candidates) & (p < 1.0)).squeeze(1) & (num_candidates < vocab_size)
    if bool(unsettled.any()):  # on a GPU a wait for the device (known; only batches with a top_p row pay it)
        index = unsettled.nonzero().squeeze(1)
        rest, unsettled_scores = [top_p[i] for i in index.tolist()], scores[index]  # a copy
        if num_candidates == _TOP_P_CANDIDATES:  # first try: a 16x wider look, then the full sort
            scores[index] = _top_p(unsettled_scores, rest, 16 * num_candidates)
        else:
            scores[index] = _top_p_sorted(unsettled_scores, rest)
        threshold[index] = -math.inf  # those rows are done
    return scores.masked_fill_(scores < threshold, -math.inf)


def _top_p_sorted(scores: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """The full-sort form of _top_p, as transformers computes it. scores: [R, V]."""
    sorted_logits, sorted_idx = torch.sort(scores, descending=False)  # [R, V]
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    limit = _on([1.0 - p for p in top_p], torch.float32, scores.device)[:, None]
    sorted_remove = cumulative <= limit
    sorted_remove[:, -1] = False
    return scores.masked_fill_(sorted_remove.scatter(1, sorted_idx, sorted_remove), -math.inf)


def _typical_removed(scores: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Which tokens transformers' TypicalLogitsWarper drops, per row. scores: [S, V]; mass: [S, 1]."""
    normalized = torch.log_softmax(scores, dim=-1)  # [S, V]
    entropy = -(normalized * normalized.exp()).nansum(-1, keepdim=True)  # [S, 1]
    shifted = (-normalized - entropy).abs()  # [S, V]: distance from the expected surprise
    sorted_shifted, sorted_idx = torch.sort(shifted, descending=False)
    cumulative = scores.gather(-1, sorted_idx).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=1, keepdim=True).clamp_(max=scores.shape[1] - 1)  # [S, 1]
    sorted_remove = sorted_shifted > sorted_shifted.gather(1, last)
    sorted_remove[:, 0] = False
    return sorted_remove.scatter(1, sorted_idx, sorted_remove)  # [S, V]
