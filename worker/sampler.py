"""Batched sampling: choose the next token of every logits row, each row with its own parameters.

In: logits [N, V] (any device and dtype; processed in float32) and one SampleRow per row: its
SamplingParams (protos/segserve/v1/sampling.py, validated upstream: nothing here re-checks a
range), its own token history (prompt + output so far, so tree-verification rows of one sequence
each see their own path) and its own torch.Generator; optionally the uniform each sampling row
draws with (worker/draws.py draws them up front). Out: a SamplerOutput with the chosen token ids,
their scores and, on request, the top log-probabilities, still on the logits' device: the caller
brings them to the host together with whatever else it needs, in one transfer.

Processing follows transformers' logits processors, in transformers' order, so those serve as the
reference: the request's logit_bias is added to the raw logits first (OpenAI's semantics), then
repetition penalty (prompt + output), then OpenAI frequency / presence penalties (output only);
greedy rows take the argmax of the processed logits; sampling rows go on through the warpers
(worker/warpers.py: temperature, top_k, top_p, typical_p) and draw one token by inverse CDF with
one uniform, from their own generator unless given, so a seeded row draws the same token whatever
else is in the batch. A row that asks for a watermark gets its green-list bias last
(worker/watermark.py), greedy or not. Only rows that need processing are copied to float32: a
greedy row without bias, penalty or watermark takes the argmax of the logits as they are (every
dtype converts to float32 exactly, so the token and its score are the same). Nothing here waits
for the device: small index tensors go up through pinned memory on CUDA (worker/upload.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protos.segserve.v1.sampling import SamplingParams
from worker.upload import to_device
from worker.warpers import warp
from worker.watermark import apply_watermark

__all__ = ["PrefixedHistory", "SampleRow", "SamplerOutput", "apply_logit_bias", "apply_penalties", "draw",
           "make_generator", "sample", "warp"]

TopLogprobs = tuple[list[int], list[float]]


class PrefixedHistory(Sequence[int]):
    """prefix[:num_prefix] + tail, without copying the prefix: the history of a row that shares its sequence's
    earlier tokens with other rows (the nodes of a tree). The penalties read a shared prefix once for all
    the rows that share it."""

    __slots__ = ("prefix", "num_prefix", "tail")

    def __init__(self, prefix: Sequence[int], num_prefix: int, tail: Sequence[int]):
        self.prefix, self.num_prefix, self.tail = prefix, num_prefix, tail

    def __len__(self) -> int:
        return self.num_prefix + len(self.tail)

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(itertools.islice(self.prefix, self.num_prefix), self.tail)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self)[index]
        index = index + len(self) if index < 0 else index
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.prefix[index] if index < self.num_prefix else self.tail[index - self.num_prefix]


@dataclass(slots=True)
class SampleRow:
    """One position whose next token is chosen."""

    params: SamplingParams
    token_ids: Sequence[int]
    """The full history before this position: prompt + output so far (this row's own path). Read only for
    penalties and watermarks, so positions of one sequence that use neither may share one SampleRow."""
    num_prompt_tokens: int
    """token_ids[num_prompt_tokens:] is the output that frequency / presence penalties count."""
    generator: torch.Generator | None
    """The sequence's own generator on the logits' device; None draws from torch's global RNG."""


class SamplerOutput:
    """Per row: the chosen token, its score and optionally the most likely alternatives, on the device.

    `device_parts()` lists the 1-D tensors to bring to the host and `from_host()` reads them back, so a
    caller fetches them with everything else of its step in one transfer; the `token_ids`, `scores`
    and `top_logprobs` properties fetch them on their own (tests, tools).
    """

    def __init__(self, token_ids: torch.Tensor, scores: torch.Tensor, top_rows: list[int], top_counts: list[int],
                 top_ids: torch.Tensor, top_values: torch.Tensor):
        self.token_id_tensor = token_ids  # [N] long
        self.score_tensor = scores  # [N] float32
        """Greedy rows: the chosen token's processed (biased, penalized) logit; sampling rows: its log-probability
        under the final (penalized and warped) distribution."""
        self.top_rows, self.top_counts = top_rows, top_counts
        """The rows that asked for top log-probabilities, in the order of top_ids, and how many each gets."""
        self.top_ids, self.top_values = top_ids, top_values  # [W, k] each, most likely first
        self._host: tuple[list[int], list[float], list[TopLogprobs | None]] | None = None

    def device_parts(self) -> list[torch.Tensor]:
        """The 1-D tensors that hold the output: token ids [N], scores [N], top ids and values [W * k]."""
        return [self.token_id_tensor, self.score_tensor, self.top_ids.reshape(-1), self.top_values.reshape(-1)]

    def from_host(self, parts: Sequence[np.ndarray]) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
        """(token ids, scores, top log-probabilities or None) per row, from device_parts() as host arrays."""
        token_ids, scores, flat_ids, flat_values = parts
        top: list[TopLogprobs | None] = [None] * len(token_ids)
        k = self.top_ids.shape[1]
        for w, (row, n) in enumerate(zip(self.top_rows, self.top_counts)):
            top[row] = (flat_ids[w * k:w * k + n].astype(np.int64).tolist(), flat_values[w * k:w * k + n].tolist())
        return token_ids.astype(np.int64).tolist(), scores.astype(np.float64).tolist(), top

    def _fetched(self) -> tuple[list[int], list[float], list[TopLogprobs | None]]:
        if self._host is None:
            self._host = self.from_host([part.cpu().numpy() for part in self.device_parts()])
        return self._host

    @property
    def token_ids(self) -> list[int]:
        return self._fetched()[0]

    @property
    def scores(self) -> list[float]:
        return self._fetched()[1]

    @property
    def top_logprobs(self) -> list[TopLogprobs | None]:
        """(token ids, log-probabilities), most likely first, under the same distribution as the score; None for
        rows with num_top_logprobs == 0."""
        return self._fetched()[2]


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A request's own generator on `device`, seeded; None (the global RNG) when seed is None."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def sample(logits: torch.Tensor, rows: Sequence[SampleRow], uniform: torch.Tensor | None = None) -> SamplerOutput:
    """Choose one token per logits row. logits: [N, V], rows: N SampleRows, never modified.

    uniform: [N] float32 on the logits' device, the uniform each sampling row draws with (greedy rows'
    entries are ignored); None: each sampling row draws one from its own generator, row after row.
    Rows with non-finite logits do not raise: they get some token, which the caller discards.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    num_rows, device = len(rows), logits.device
    params = [row.params for row in rows]
    kinds = _distinct(params)  # a tree's nodes share their sequence's params: flags are read per distinct params
    if not any(p.do_sample or p.logit_bias or p.has_penalty or p.watermark or p.num_top_logprobs for p in kinds):
        # plain greedy rows (most decode steps): each row's first maximum (argmax's token) and its logit, one op
        chosen, token_ids = logits.max(dim=-1)  # [N] each
        no_top = torch.empty(0, 0, dtype=torch.long, device=device)
        return SamplerOutput(token_ids, chosen.float(), [], [], no_top, no_top.float())
    token_ids = torch.empty(num_rows, dtype=torch.long, device=device)  # [N]
    chosen = torch.empty(num_rows, dtype=torch.float32, device=device)  # [N]
    # (row indices, final logits [n, V], their log-normalizer [n, 1] or None = not computed yet)
    distributions: list[tuple[list[int], torch.Tensor, torch.Tensor | None]] = []
    if not any(p.do_sample for p in kinds):
        greedy_rows, sampling_rows = list(range(num_rows)), []
    elif all(p.do_sample for p in kinds):
        greedy_rows, sampling_rows = [], list(range(num_rows))
    else:
        greedy_rows = [i for i, p in enumerate(params) if not p.do_sample]
        sampling_rows = [i for i, p in enumerate(params) if p.do_sample]
    if greedy_rows:
        greedy_of = rows if len(greedy_rows) == num_rows else [rows[i] for i in greedy_rows]
        greedy = _watermarked(_processed(logits, greedy_rows, greedy_of, is_copied=False), greedy_of)  # [G, V]
        greedy_ids = greedy.argmax(dim=-1)  # [G]
        _put(token_ids, greedy_rows, greedy_ids)
        _put(chosen, greedy_rows, greedy.gather(1, greedy_ids[:, None]).squeeze(1).float())
        distributions.append((greedy_rows, greedy, None))
    if sampling_rows:
        sampling_of = rows if len(sampling_rows) == num_rows else [rows[i] for i in sampling_rows]
        sampling = _processed(logits, sampling_rows, sampling_of, is_copied=True)  # [S, V]
        warped = warp(sampling, [row.params for row in sampling_of])  # [S, V], in place on the copy
        warped = _watermarked(warped, sampling_of)
        probs = torch.softmax(warped, dim=-1)  # [S, V]
        log_norm = _log_normalizer(warped, probs)  # [S, 1]
        if uniform is None:
            drawn = draw(probs, [row.generator for row in sampling_of])  # [S]
        else:
            drawn = draw(probs, (), _take_rows(uniform, sampling_rows))  # [S]
        _put(token_ids, sampling_rows, drawn)
        _put(chosen, sampling_rows, (warped.gather(1, drawn[:, None]) - log_norm).squeeze(1))
        distributions.append((sampling_rows, warped, log_norm))
    return SamplerOutput(token_ids, chosen, *_top_logprobs(distributions, params, kinds, logits.shape[1], device))


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
        index = to_device(torch.tensor([row_idx, tok_idx], dtype=torch.long), scores.device)  # [2, B]
        values = to_device(torch.tensor(bias, dtype=torch.float32), scores.device)  # [B]
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


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None], uniform: torch.Tensor | None = None
         ) -> torch.Tensor:
    """One token per row by inverse CDF, one uniform per row: `uniform` [S] when given, else drawn from each row's
    generator in turn.

    probs: [S, V] -> token ids [S]. Zero-probability tokens are never drawn.
    """
    device = probs.device
    if uniform is None:
        uniform = torch.cat([torch.rand(1, generator=g, device=device) for g in generators])  # [S]
    cdf = probs.cumsum(dim=-1)  # [S, V]; each token's interval is off by at most one float32 ulp
    total = cdf[:, -1:]  # [S, 1]
    # Strictly below the total, so the first cdf entry above it exists and has probability > 0.
    target = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _watermarked(scores: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """scores [R, V] with the watermark rows biased; a copy when any row is (never the input)."""
    if not any(p.watermark for p in _distinct([row.params for row in rows])):
        return scores
    marked = [j for j, row in enumerate(rows) if row.params.watermark]
    scores = scores.clone()
    index = _index(marked, scores.device)
    scores[index] = apply_watermark(scores[index], [rows[j].token_ids for j in marked])
    return scores


def _log_normalizer(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(logits))) per row [n, 1], from softmax's output (torch.logsumexp is several
    times slower on a CPU): the most likely token's probability is 1 / sum(exp(logits - max)), up
    to softmax's float32 normalizer, which the (accurate) sum of the probabilities corrects."""
    scale = probs.sum(dim=-1, keepdim=True).log()  # [n, 1], ~0
    return logits.amax(dim=-1, keepdim=True) - probs.amax(dim=-1, keepdim=True).log() + scale


def _processed(logits: torch.Tensor, row_ids: list[int], rows: Sequence[SampleRow], is_copied: bool
               ) -> torch.Tensor:
    """Rows row_ids of logits with their logit bias and penalties applied. [R, V].

    A float32 copy when a row needs processing (bias, penalty, watermark) or is_copied asks for one (the
    warpers work in place); otherwise the logits' rows as they are, the tensor itself when that is all of them.
    """
    params = [row.params for row in rows]
    kinds = _distinct(params)
    has_bias = any(p.logit_bias for p in kinds)
    has_penalty = any(p.has_penalty for p in kinds)
    scores = _take_rows(logits, row_ids)
    if not (is_copied or has_bias or has_penalty or any(p.watermark for p in kinds)):
        return scores
    scores = scores.to(torch.float32, copy=scores is logits)  # index_select already copied
    if has_bias:
        apply_logit_bias(scores, params)
    if has_penalty:
        apply_penalties(scores, rows)
    return scores


def _distinct(params: list[SamplingParams]) -> list[SamplingParams]:
    """The distinct params objects among params (by identity: rows of one sequence share theirs)."""
    return list({id(p): p for p in params}.values())


def _take_rows(scores: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """scores[rows] for sorted distinct rows; the tensor itself (no copy) when that is all of them."""
    if len(rows) == scores.shape[0]:
        return scores
    return scores.index_select(0, _index(rows, scores.device))


def _put(target: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    """target[rows] = values for sorted distinct rows. target: [N]; values: [len(rows)]."""
    if len(rows) == target.shape[0]:
        target.copy_(values)
    else:
        target[_index(rows, target.device)] = values.to(target.dtype)


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    """rows as a long tensor on device, without making the host wait (worker/upload.py)."""
    return to_device(torch.tensor(rows, dtype=torch.long), device)


def _history_pairs(
    rows: Sequence[SampleRow], row_ids: list[int], vocab_size: int, device: torch.device, output_only: bool,
    values: list[list[float]],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Every (row, token) of the rows' histories (the output only, or prompt + output), on `device`.

    Returns row indices [T], token ids [T] (ids outside the vocabulary dropped, as transformers does)
    and, for each per-row list in `values`, its value at every pair [T] float32. Built on the host
    from the Python histories, then copied: one long and one float copy, no device sync. A prefix
    that rows share (PrefixedHistory: a tree's nodes) is read once and repeated for them by numpy.
    """
    own_rows, own_histories = [], []
    shared: dict[tuple[int, int, int], tuple[Sequence[int], list[int]]] = {}  # (prefix, start, stop) -> rows
    for i in row_ids:
        history, start = rows[i].token_ids, rows[i].num_prompt_tokens if output_only else 0
        if isinstance(history, PrefixedHistory):
            if start < history.num_prefix:
                key = (id(history.prefix), start, history.num_prefix)
                shared.setdefault(key, (history.prefix, []))[1].append(i)
            history, start = history.tail, max(start - history.num_prefix, 0)
        own_rows.append(i)
        own_histories.append(history[start:])
    lengths = [len(h) for h in own_histories]
    # [L]; numpy reads a chain of Python ints ~4x faster than torch.tensor(list(...))
    token_parts = [np.fromiter(itertools.chain.from_iterable(own_histories), np.int64, sum(lengths))]
    row_parts = [np.repeat(np.array(own_rows, dtype=np.int64), lengths)]
    for (_, start, stop), (prefix, prefix_rows) in shared.items():
        segment = np.fromiter(itertools.islice(prefix, start, stop), np.int64, stop - start)
        token_parts.append(np.tile(segment, len(prefix_rows)))
        row_parts.append(np.repeat(np.array(prefix_rows, dtype=np.int64), len(segment)))
    tokens = torch.from_numpy(np.concatenate(token_parts))  # [L]
    row_idx = torch.from_numpy(np.concatenate(row_parts))  # [L]
    is_in_vocab = (tokens >= 0) & (tokens < vocab_size)
    if not bool(is_in_vocab.all()):  # a host tensor: no device sync
        tokens, row_idx = tokens[is_in_vocab], row_idx[is_in_vocab]
    per_pair = torch.tensor(values, dtype=torch.float32)[:, row_idx]  # [K, T]
    pairs = to_device(torch.stack([row_idx, tokens]), device)  # [2, T]
    return pairs[0], pairs[1], list(to_device(per_pair, device).unbind(0))


def _occurrences(keys: torch.Tensor) -> torch.Tensor:
    """How often each key occurs among `keys`, per element [T] long; sorting, so no sync on a GPU."""
    ordered = keys.sort().values
    return torch.searchsorted(ordered, keys, right=True) - torch.searchsorted(ordered, keys)


def _top_logprobs(
    distributions: list[tuple[list[int], torch.Tensor, torch.Tensor | None]], params: Sequence[SamplingParams],
    kinds: list[SamplingParams], vocab_size: int, device: torch.device,
) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """The num_top_logprobs most likely tokens of each asking row, under its final distribution.

    Returns the asking rows, how many each gets, and their top ids and log-probabilities [W, k], most likely
    first, k the largest count (every distribution is cut at the same k, so they stack).
    """
    k = min(max((p.num_top_logprobs for p in kinds), default=0), vocab_size)
    top_rows: list[int] = []
    ids_parts, values_parts = [torch.empty(0, k, dtype=torch.long, device=device)], []
    values_parts.append(torch.empty(0, k, dtype=torch.float32, device=device))
    for row_ids, logits, log_norm in distributions if k else ():
        wanted = [j for j, i in enumerate(row_ids) if params[i].num_top_logprobs > 0]
        if not wanted:
            continue
        if len(wanted) < len(row_ids):
            logits = _take_rows(logits, wanted)
            log_norm = None if log_norm is None else _take_rows(log_norm, wanted)
        logits = logits.float()  # greedy rows nothing processed are still in the model's dtype
        if log_norm is None:
            log_norm = _log_normalizer(logits, torch.softmax(logits, dim=-1))  # [W, 1]
        values, ids = torch.topk(logits, k, dim=-1)  # [W, k], most likely first
        ids_parts.append(ids)
        values_parts.append(values - log_norm)
        top_rows += [row_ids[j] for j in wanted]
    counts = [min(params[i].num_top_logprobs, k) for i in top_rows]
    return top_rows, counts, torch.cat(ids_parts), torch.cat(values_parts)
