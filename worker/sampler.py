"""Batched sampling: choose the next token of every logits row, each row with its own parameters.

In: logits [N, V] (any device and dtype; computed in float32) and one SampleRow per row: its
SamplingParams, its own token history (prompt + output so far, so tree-verification rows of one
sequence each see their own path) and its own torch.Generator. Out: a SamplerOutput with the
chosen token ids, their scores and, on request, the top log-probabilities.

Processing follows transformers' logits processors, in transformers' order, so those serve as the
reference: repetition penalty (prompt + output), then OpenAI frequency / presence penalties (output
only); greedy rows take the argmax of the penalized logits; sampling rows go on through
temperature, top_k, top_p and typical_p and draw one token by inverse CDF with one uniform from
their own generator, so a seeded row draws the same token whatever else is in the batch. A row
that asks for a watermark gets its green-list bias last (worker/watermark.py), greedy or not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from protos.segserve.v1 import common_pb2
from worker.watermark import apply_watermark

_TOP_P_CANDIDATES = 1024
"""top_p first looks at this many most likely tokens per row, then 16x as many, and sorts the whole
row only when those do not cover the nucleus (a full sort of a 262k vocabulary costs ~25 ms per
row on a CPU; gemma-3-270m's 0.95-nucleus stays under 1024 tokens at temperature <= 1)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence chooses its next token; the worker's own copy of common.SamplingParams."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    num_top_logprobs: int = 0
    watermark: bool = False

    def __post_init__(self) -> None:
        if not self.temperature > 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 < self.typical_p <= 1:
            raise ValueError(f"typical_p must be in (0, 1], got {self.typical_p}")
        if not self.repetition_penalty > 0 or math.isinf(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not (math.isfinite(self.frequency_penalty) and math.isfinite(self.presence_penalty)):
            raise ValueError("frequency_penalty and presence_penalty must be finite")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.num_top_logprobs < 0:
            raise ValueError(f"num_top_logprobs must be >= 0, got {self.num_top_logprobs}")

    @classmethod
    def from_pb(cls, pb: common_pb2.SamplingParams) -> "SamplingParams":
        """Convert at the gRPC edge; raises ValueError on out-of-range values."""
        return cls(
            do_sample=pb.do_sample,
            temperature=pb.temperature,
            top_k=pb.top_k,
            top_p=pb.top_p,
            typical_p=pb.typical_p,
            repetition_penalty=pb.repetition_penalty,
            frequency_penalty=pb.frequency_penalty,
            presence_penalty=pb.presence_penalty,
            seed=pb.seed if pb.HasField("seed") else None,
            num_top_logprobs=pb.num_top_logprobs,
            watermark=pb.watermark,
        )


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
    """Greedy rows: the chosen token's penalized logit; sampling rows: its log-probability under
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
    has_penalty = any(_has_penalty(p) for p in params)
    scores = logits.to(torch.float32, copy=has_penalty)  # [N, V]; copied before in-place penalties
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


def apply_penalties(scores: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """Repetition, then frequency / presence penalties, in place. scores: [N, V] float32."""
    vocab_size, device = scores.shape[1], scores.device
    rep_rows = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep_rows:
        row_idx, tok_idx, _ = _unique_tokens(rows, rep_rows, vocab_size, output_only=False)
        penalty = torch.tensor([rows[i].params.repetition_penalty for i in range(len(rows))])[row_idx]
        row_idx, tok_idx, penalty = row_idx.to(device), tok_idx.to(device), penalty.to(device)
        seen = scores[row_idx, tok_idx]  # [T]: each (row, token) once
        scores[row_idx, tok_idx] = torch.where(seen < 0, seen * penalty, seen / penalty)
    out_rows = [i for i, r in enumerate(rows) if r.params.frequency_penalty or r.params.presence_penalty]
    if out_rows:
        row_idx, tok_idx, counts = _unique_tokens(rows, out_rows, vocab_size, output_only=True)
        freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=torch.float32)
        presence = torch.tensor([r.params.presence_penalty for r in rows], dtype=torch.float32)
        delta = freq[row_idx] * counts + presence[row_idx]  # [T]
        scores.index_put_((row_idx.to(device), tok_idx.to(device)), -delta.to(device), accumulate=True)


def warp(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top_k, top_p, typical_p (transformers' warpers), each row its own values.

    scores: [S, V] float32, modified in place and returned with filtered tokens at -inf (in place
    saves a [S, V] copy per step). Steps no row uses are skipped.
    """
    device, vocab_size = scores.device, scores.shape[1]

    def column(values: list[float]) -> torch.Tensor:  # [S, 1]
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

    if any(p.temperature != 1.0 for p in params):
        scores.div_(column([p.temperature for p in params]))
    top_k = [p.top_k if p.top_k < vocab_size else 0 for p in params]  # k >= V keeps every token
    if any(top_k):
        values = torch.topk(scores, max(top_k), dim=-1).values  # [S, k_max], descending
        kth = values.gather(1, torch.tensor([max(k, 1) - 1 for k in top_k], device=device)[:, None])
        is_off = torch.tensor([k == 0 for k in top_k], device=device)[:, None]
        kth = kth.masked_fill(is_off, -math.inf)  # [S, 1]
        scores.masked_fill_(scores < kth, -math.inf)
    if any(p.top_p < 1.0 for p in params):
        scores = _top_p(scores, [p.top_p for p in params], _TOP_P_CANDIDATES)
    if any(p.typical_p < 1.0 for p in params):
        is_on = torch.tensor([p.typical_p < 1.0 for p in params], device=device)[:, None]
        scores.masked_fill_(_typical_removed(scores, column([p.typical_p for p in params])) & is_on, -math.inf)
    return scores


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


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


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


def _unique_tokens(
    rows: Sequence[SampleRow], row_ids: list[int], vocab_size: int, output_only: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct (row, token) pairs of the rows' histories with their counts, on the CPU.

    Returns row indices [T], token ids [T], counts [T] (float32); ids outside the vocabulary are
    dropped, as transformers does.
    """
    keys = []
    for i in row_ids:
        history = rows[i].token_ids[rows[i].num_prompt_tokens :] if output_only else rows[i].token_ids
        tokens = torch.as_tensor(history, dtype=torch.long).reshape(-1)  # [L]
        # key = row * (V + 2) + token + 1, with out-of-range ids folded onto token -1 or V
        keys.append(tokens.clamp(-1, vocab_size) + 1 + i * (vocab_size + 2))
    unique, counts = torch.unique(torch.cat(keys), return_counts=True)  # [T]
    row_idx, tok_idx = unique // (vocab_size + 2), unique % (vocab_size + 2) - 1
    is_in_vocab = (tok_idx >= 0) & (tok_idx < vocab_size)
    return row_idx[is_in_vocab], tok_idx[is_in_vocab], counts[is_in_vocab].to(torch.float32)


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
    p = torch.tensor(top_p, dtype=torch.float64, device=device)[:, None]  # [S, 1]
    num_keep = (mass_above < p).sum(dim=-1, keepdim=True)  # [S, 1], >= 1
    threshold = cand_logits.gather(1, num_keep - 1)  # [S, 1]: least likely kept logit
    threshold = threshold.masked_fill(p >= 1.0, -math.inf)
    # The candidates settle a row unless all of them are kept and more tokens exist.
    unsettled = ((num_keep == num_candidates) & (p < 1.0)).squeeze(1) & (num_candidates < vocab_size)
    if bool(unsettled.any()):
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
    limit = torch.tensor([1.0 - p for p in top_p], dtype=torch.float32, device=scores.device)[:, None]
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
