"""Batched sampling: choose the next token of every logits row, each row with its own parameters.

In: logits [N, V] (any device and dtype; computed in float32) and one SampleRow per row: its
SamplingParams (protos/segserve/v1/sampling.py, validated upstream: nothing here re-checks a
range), its own token history (prompt + output so far, so tree-verification rows of one sequence
each see their own path) and its own torch.Generator. Out: a SamplerOutput with the chosen token
ids, their scores and, on request, the top log-probabilities.

Processing follows transformers' logits processors, in transformers' order, so those serve as the
reference: the request's logit_bias is added to the raw logits first (OpenAI's semantics), then
repetition penalty (prompt + output), then OpenAI frequency / presence penalties (output only);
greedy rows take the argmax of the processed logits; sampling rows go on through the warpers
(worker/warpers.py: temperature, top_k, top_p, typical_p) and draw one token by inverse CDF with
one uniform from their own generator, so a seeded row draws the same token whatever else is in
the batch. A row that asks for a watermark gets its green-list bias last (worker/watermark.py),
greedy or not.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from protos.segserve.v1.sampling import SamplingParams
from worker.warpers import warp
from worker.watermark import apply_watermark

__all__ = ["SampleRow", "SamplerOutput", "apply_logit_bias", "apply_penalties", "draw", "make_generator", "sample",
           "warp"]


@dataclass
class SampleRow:
    """One position whose next token is chosen."""

    params: SamplingParams
    token_ids: Sequence[int]
    """The full history before this position: prompt + output so far (this row's own path)."""
    num_prompt_tokens: int
    """token_ids[num_prompt_tokens:] is the output that frequency / presence penalties count."""
    generator: torch.Generator | None
    """The sequence's own generator on the logits' device; None draws from torch's global RNG."""


@dataclass
class SamplerOutput:
    """Per row: the chosen token, its score and optionally the most likely alternatives."""

    token_ids: list[int]
    scores: list[float]
    """Greedy rows: the chosen token's processed (biased, penalized) logit; sampling rows: its log-probability under
    the final (penalized and warped) distribution."""
    top_logprobs: list[tuple[list[int], list[float]] | None]
    """(token ids, log-probabilities), most likely first, under the same distribution as the
    score; None for rows with num_top_logprobs == 0."""


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A request's own generator on `device`, seeded; None (the global RNG) when seed is None."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> SamplerOutput:
    """Choose one token per logits row. logits: [N, V], rows: N SampleRows."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    num_rows, device = len(rows), logits.device
    params = [row.params for row in rows]
    has_bias = any(p.logit_bias for p in params)
    has_penalty = any(p.has_penalty for p in params)
    # [N, V]; copied before the in-place bias and penalties, so the input is never modified
    scores = logits.to(torch.float32, copy=has_bias or has_penalty)
    if has_bias:
        apply_logit_bias(scores, params)
    if has_penalty:
        apply_penalties(scores, rows)

    token_ids = torch.empty(num_rows, dtype=torch.long, device=device)  # [N]
    chosen = torch.empty(num_rows, dtype=torch.float32, device=device)  # [N]
    # (row indices, final logits [n, V], their log-normalizer [n, 1] or None = not computed yet)
    distributions: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []
    greedy_rows = [i for i, p in enumerate(params) if not p.do_sample]
    sampling_rows = [i for i, p in enumerate(params) if p.do_sample]
    if greedy_rows:
        greedy = _watermarked(_take_rows(scores, greedy_rows), [rows[i] for i in greedy_rows])  # [G, V]
        index = torch.tensor(greedy_rows, device=device)
        greedy_ids = greedy.argmax(dim=-1)  # [G]
        token_ids[index] = greedy_ids
        chosen[index] = greedy.gather(1, greedy_ids[:, None]).squeeze(1)
        distributions.append((greedy_rows, greedy, None))
    if sampling_rows:
        sampling = _take_rows(scores, sampling_rows)  # [S, V]; warped in place, so never the input
        sampling = sampling.clone() if sampling is logits else sampling
        warped = warp(sampling, [params[i] for i in sampling_rows])  # [S, V]
        warped = _watermarked(warped, [rows[i] for i in sampling_rows])
        probs = torch.softmax(warped, dim=-1)  # [S, V]
        log_norm = _log_normalizer(warped, probs)  # [S, 1]
        drawn = draw(probs, [rows[i].generator for i in sampling_rows])  # [S]
        index = torch.tensor(sampling_rows, device=device)
        token_ids[index] = drawn
        chosen[index] = (warped.gather(1, drawn[:, None]) - log_norm).squeeze(1)
        distributions.append((sampling_rows, warped, log_norm))
    top = _top_logprobs(distributions, params)
    return SamplerOutput(token_ids=token_ids.tolist(), scores=chosen.tolist(), top_logprobs=top)


def apply_logit_bias(scores: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add every row's logit_bias to its logits, in place, with one index_put. scores: [N, V] float32.

    Token ids outside the vocabulary are dropped, as penalties drop them (validate() with the
    vocabulary size refuses them upstream; an out-of-range index would be a device assert on a GPU).
    """
    vocab_size = scores.shape[1]
    row_idx, tok_idx, bias = [], [], []
    for i, p in enumerate(params):
        for token_id, value in p.logit_bias.items():
            if 0 <= token_id < vocab_size:
                row_idx.append(i)
                tok_idx.append(token_id)
                bias.append(value)
    if row_idx:
        index = torch.tensor([row_idx, tok_idx], dtype=torch.long).to(scores.device)  # [2, B]
        values = torch.tensor(bias, dtype=torch.float32).to(scores.device)  # [B]
        scores.index_put_((index[0], index[1]), values, accumulate=True)


def apply_penalties(scores: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """Repetition, then frequency / presence penalties, in place. scores: [N, V] float32.

    As transformers' RepetitionPenaltyLogitsProcessor does it: gather the logits at every (row,
    history token) pair, penalize, scatter back. A token seen twice is written twice with the same
    value, so it is penalized once; its count, for the frequency penalty, comes from sorting the
    pairs on the logits' device. No [N, V] tensor is built (at a 262k vocabulary that costs more
    than the whole sparse update), nothing is made unique on the host and nothing waits for the
    device. Only rows with a penalty pay; ids outside the vocabulary are dropped.
    """
    vocab_size = scores.shape[1]
    rep_rows = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep_rows:
        row_idx, tok_idx, (penalty,) = _history_pairs(
            rows, rep_rows, vocab_size, scores.device, output_only=False,
            values=[[r.params.repetition_penalty for r in rows]])
        seen = scores[row_idx, tok_idx]  # [T]
        scores[row_idx, tok_idx] = torch.where(seen < 0, seen * penalty, seen / penalty)
    out_rows = [i for i, r in enumerate(rows) if r.params.frequency_penalty or r.params.presence_penalty]
    if out_rows:
        row_idx, tok_idx, (freq, presence) = _history_pairs(
            rows, out_rows, vocab_size, scores.device, output_only=True,
            values=[[r.params.frequency_penalty for r in rows], [r.params.presence_penalty for r in rows]])
        counts = _occurrences(row_idx * vocab_size + tok_idx).to(torch.float32)  # [T]: count of the pair's token
        scores[row_idx, tok_idx] = scores[row_idx, tok_idx] - (freq * counts + presence)


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row by inverse CDF, one uniform per row from that row's generator.

    probs: [S, V] -> token ids [S]. Zero-probability tokens are never drawn.
    """
    device = probs.device
    uniform = torch.cat([torch.rand(1, generator=g, device=device) for g in generators])  # [S]
    cdf = probs.cumsum(dim=-1)  # [S, V]; each token's interval is off by at most one float32 ulp
    total = cdf[:, -1:]  # [S, 1]
    # Strictly below the total, so the first cdf entry above it exists and has probability > 0.
    target = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _watermarked(scores: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """scores [R, V] with the watermark rows biased; a copy when any row is (never the input)."""
    marked = [j for j, row in enumerate(rows) if row.params.watermark]
    if not marked:
        return scores
    scores = scores.clone()
    index = torch.tensor(marked, device=scores.device)
    scores[index] = apply_watermark(scores[index], [rows[j].token_ids for j in marked])
    return scores


def _log_normalizer(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(logits))) per row [n, 1], from softmax's output (torch.logsumexp is several
    times slower on a CPU): the most likely token's probability is 1 / sum(exp(logits - max)), up
    to softmax's float32 normalizer, which the (accurate) sum of the probabilities corrects."""
    scale = probs.sum(dim=-1, keepdim=True).log()  # [n, 1], ~0
    return logits.amax(dim=-1, keepdim=True) - probs.amax(dim=-1, keepdim=True).log() + scale


def _take_rows(scores: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if len(rows) == scores.shape[0]:
        return scores
    return scores.index_select(0, torch.tensor(rows, device=scores.device))


def _history_pairs(
    rows: Sequence[SampleRow], row_ids: list[int], vocab_size: int, device: torch.device, output_only: bool,
    values: list[list[float]],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Every (row, token) of the rows' histories (the output only, or prompt + output), on `device`.

    Returns row indices [T], token ids [T] (ids outside the vocabulary dropped, as transformers does)
    and, for each per-row list in `values`, its value at every pair [T] float32. Built on the host
    from the Python histories, then copied: one long and one float copy, no device sync.
    """
    histories = [rows[i].token_ids[rows[i].num_prompt_tokens:] if output_only else rows[i].token_ids
                 for i in row_ids]
    lengths = [len(h) for h in histories]
    # [L]; numpy reads a chain of Python ints ~4x faster than torch.tensor(list(...))
    tokens = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(histories), np.int64, sum(lengths)))
    row_idx = torch.repeat_interleave(torch.tensor(row_ids), torch.tensor(lengths))  # [L]
    is_in_vocab = (tokens >= 0) & (tokens < vocab_size)
    if not bool(is_in_vocab.all()):  # a host tensor: no device sync
        tokens, row_idx = tokens[is_in_vocab], row_idx[is_in_vocab]
    per_pair = torch.tensor(values, dtype=torch.float32)[:, row_idx]  # [K, T]
    pairs = torch.stack([row_idx, tokens]).to(device)  # [2, T]
    return pairs[0], pairs[1], list(per_pair.to(device).unbind(0))


def _occurrences(keys: torch.Tensor) -> torch.Tensor:
    """How often each key occurs among `keys`, per element [T] long; sorting, so no sync on a GPU."""
    ordered = keys.sort().values
    return torch.searchsorted(ordered, keys, right=True) - torch.searchsorted(ordered, keys)


def _top_logprobs(
    distributions: list[tuple[list[int], torch.Tensor, torch.Tensor | None]], params: Sequence[SamplingParams]
) -> list[tuple[list[int], list[float]] | None]:
    """The num_top_logprobs most likely tokens of each asking row, under its final distribution."""
    result: list[tuple[list[int], list[float]] | None] = [None] * len(params)
    for row_ids, logits, log_norm in distributions:
        wanted = [j for j, i in enumerate(row_ids) if params[i].num_top_logprobs > 0]
        if not wanted:
            continue
        if len(wanted) < len(row_ids):
            local = torch.tensor(wanted, device=logits.device)
            logits, log_norm = _take_rows(logits, wanted), None if log_norm is None else log_norm[local]
        if log_norm is None:
            log_norm = _log_normalizer(logits, torch.softmax(logits, dim=-1))  # [W, 1]
        k = min(max(params[row_ids[j]].num_top_logprobs for j in wanted), logits.shape[1])
        values, ids = torch.topk(logits, k, dim=-1)  # [W, k], most likely first
        for j, row_top_ids, row_top_values in zip(wanted, ids.tolist(), (values - log_norm).tolist()):
            n = params[row_ids[j]].num_top_logprobs
            result[row_ids[j]] = (row_top_ids[:n], row_top_values[:n])
    return result
