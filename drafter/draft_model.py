"""Draft models: a small causal LM that proposes continuations for one segment kind.

In: a request's token ids (the context), optionally under a request id so the
draft model's KV cache is reused across calls. Out: `Continuation`s, the greedy
chain of `max_len` tokens first, then one-token branches (top-k alternatives at
the first positions of the chain), each scored by its path probability under
the draft model, so a tree builder can merge them with corpus continuations.

Two kinds are loaded from a spec dict (see `load_draft_model`):
- {"kind": "model", "path": DIR}: any causal LM sharing the target's tokenizer;
- {"kind": "self_speculative", "target": DIR, "num_layers": k}: the target's first
  k decoder layers plus its final norm and head, loaded from the target's own
  checkpoint (no extra weights).
Either kind may restrict its head to the most frequent tokens of a text corpus
plus each request's own tokens ("head_vocab_size" + "head_vocab_corpus"): on a
CPU the full head of a 262k vocabulary costs several times the draft's layers.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from drafter.draft_head import RestrictedHead, corpus_head_token_ids, parse_head_vocab
from drafter.types import Continuation

DRAFT_MODEL_KINDS = ("model", "self_speculative")


@dataclass
class _RequestCache:
    """A request's draft KV cache and the tokens it holds, position by position."""

    cache: Any
    token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _Branch:
    """A one-token deviation from the chain: chain[:position] + (token_id,)."""

    position: int
    token_id: int
    score: float


class DraftModel:
    """A `ContinuationSource` backed by a small causal LM with per-request KV caches.

    Not thread-safe: the drafter calls it from one thread. Caches are bounded by
    `max_cached_requests` (least recently used dropped first); each holds the
    draft's K/V for its whole context (num_layers x 2 x kv_heads x head_dim x
    tokens floats), so a deep draft over long contexts wants a small bound.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        head_token_ids: Sequence[int] | None = None,
        num_branch_positions: int = 2,
        max_cached_requests: int = 16,
    ):
        if num_branch_positions < 0:
            raise ValueError(f"num_branch_positions must be >= 0, got {num_branch_positions}")
        if max_cached_requests < 1:
            raise ValueError(f"max_cached_requests must be >= 1, got {max_cached_requests}")
        self.model = model.eval()
        self.num_branch_positions = num_branch_positions
        """Chain positions (from the first) where top-k alternatives become branches."""
        self.max_cached_requests = max_cached_requests
        """Most per-request KV caches kept; the least recently used is evicted."""
        self._caches: OrderedDict[str, _RequestCache] = OrderedDict()
        self.head: RestrictedHead | None = None
        """The head restricted to `head_token_ids` plus the context's tokens; None = the full head."""
        if head_token_ids is not None:
            softcap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
            self.head = RestrictedHead(model.get_output_embeddings().weight, head_token_ids, softcap)

    @property
    def num_cached_requests(self) -> int:
        return len(self._caches)

    def propose(self, context: Sequence[int], max_len: int, max_candidates: int) -> list[Continuation]:
        """Stateless proposal: a fresh cache, dropped afterwards.

        Returns the greedy chain of `max_len` tokens first, then up to
        `max_candidates - 1` one-token branches off its first
        `num_branch_positions` positions, best first. Scores are path
        probabilities under the draft (renormalised over the kept tokens when
        the head is restricted).
        """
        return self._propose(self._new_cache(), list(context), max_len, max_candidates)

    def propose_for(
        self, request_id: str, context: Sequence[int], max_len: int, max_candidates: int
    ) -> list[Continuation]:
        """`propose` for a live request, reusing the KV of the longest common prefix with its last call."""
        entry = self._caches.pop(request_id, None) or self._new_cache()
        self._caches[request_id] = entry  # most recently used last
        while len(self._caches) > self.max_cached_requests:
            self._caches.popitem(last=False)
        return self._propose(entry, list(context), max_len, max_candidates)

    def release(self, request_id: str) -> None:
        """Drop a finished request's cache (unknown ids are ignored)."""
        self._caches.pop(request_id, None)

    def _new_cache(self) -> _RequestCache:
        from transformers import DynamicCache

        # No config: every layer is a full DynamicLayer, so crop() can roll back
        # past a sliding window (the model still masks by its window).
        return _RequestCache(cache=DynamicCache())

    @torch.inference_mode()
    def _propose(
        self, entry: _RequestCache, context: list[int], max_len: int, max_candidates: int
    ) -> list[Continuation]:
        if not context or max_len < 1 or max_candidates < 1:
            return []
        log_probs, ids = self._advance(entry, context)  # [M] next-token log-probs; token id of each
        chain: list[int] = []
        branches: list[_Branch] = []
        path_log_prob = 0.0
        num_branches = max_candidates - 1
        for position in range(max_len):
            num_top = 1 + (num_branches if position < self.num_branch_positions else 0)
            top = torch.topk(log_probs, k=min(num_top, log_probs.numel()))
            values = top.values.tolist()
            indices = (top.indices if ids is None else ids[top.indices]).tolist()
            for value, token_id in zip(values[1:], indices[1:]):
                branches.append(_Branch(position, token_id, path_log_prob + value))
            chain.append(indices[0])
            path_log_prob += values[0]
            if position + 1 < max_len:
                log_probs, ids = self._advance(entry, context + chain)
        best = heapq.nlargest(num_branches, branches, key=lambda b: b.score)
        proposals = [Continuation(tuple(chain), math.exp(path_log_prob))]
        for branch in best:  # nlargest is sorted, best first
            token_ids = tuple(chain[: branch.position]) + (branch.token_id,)
            proposals.append(Continuation(token_ids, math.exp(branch.score)))
        return proposals

    def _advance(self, entry: _RequestCache, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Bring the cache to `token_ids`; return the next-token log-probs [M] after them.

        M = V with the full head (the ids are then None), else the restricted
        head's tokens, whose ids come second.

        Keeps the longest common prefix with what the cache holds (crops the rest)
        and runs only the new tokens; at least the last token is always run.
        """
        num_common = _common_prefix_len(entry.token_ids, token_ids)
        num_keep = min(num_common, len(token_ids) - 1)
        if num_keep < len(entry.token_ids):
            entry.cache.crop(num_keep - len(entry.token_ids))  # negative: tokens to remove
            del entry.token_ids[num_keep:]
        new_ids = token_ids[num_keep:]
        device = self.model.device
        input_ids = torch.tensor([new_ids], dtype=torch.long, device=device)  # [1, n]
        positions = torch.arange(num_keep, len(token_ids), device=device).unsqueeze(0)  # [1, n]
        inputs = dict(input_ids=input_ids, position_ids=positions, past_key_values=entry.cache, use_cache=True)
        if self.head is None:
            logits, ids = self.model(**inputs, logits_to_keep=1).logits[0, -1].float(), None  # [V]
        else:
            hidden = self.model.base_model(**inputs).last_hidden_state[0, -1]  # [H], after the final norm
            logits, ids = self.head.logits(hidden, token_ids)  # [M], [M]
        entry.token_ids.extend(new_ids)
        return torch.log_softmax(logits, dim=-1), ids


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def parse_draft_model_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Validate a draft-model spec; return it normalised. Raises ValueError with the reason."""
    if not isinstance(spec, Mapping):
        raise ValueError(f"draft model spec must be a table/dict, got {type(spec).__name__}")
    kind = spec.get("kind")
    if kind not in DRAFT_MODEL_KINDS:
        raise ValueError(f"draft model 'kind' must be one of {DRAFT_MODEL_KINDS}, got {kind!r}")
    allowed = {"model": {"kind", "path"}, "self_speculative": {"kind", "target", "num_layers"}}[kind]
    allowed |= {"head_vocab_size", "head_vocab_corpus"}
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise ValueError(f"unknown keys {unknown} in a {kind!r} draft model spec (allowed: {sorted(allowed)})")
    dir_key = "path" if kind == "model" else "target"
    if not isinstance(spec.get(dir_key), (str, Path)) or not str(spec.get(dir_key)):
        raise ValueError(f"a {kind!r} draft model spec needs '{dir_key}' = a model directory")
    model_dir = Path(spec[dir_key]).expanduser()
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"draft model {dir_key} {str(model_dir)!r} is not a transformers model directory")
    normalised: dict[str, Any] = {"kind": kind, dir_key: model_dir}
    if kind == "self_speculative":
        num_layers = spec.get("num_layers")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"'num_layers' must be a positive integer, got {num_layers!r}")
        normalised["num_layers"] = num_layers
    normalised.update(parse_head_vocab(spec))
    return normalised


def load_draft_model(
    spec: Mapping[str, Any], device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, **kwargs
) -> DraftModel:
    """Load the draft model a spec describes; extra kwargs go to `DraftModel`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    parsed = parse_draft_model_spec(spec)
    model_dir = parsed.get("path") or parsed["target"]
    if "head_vocab_size" in parsed:
        head_ids = corpus_head_token_ids(model_dir, parsed["head_vocab_corpus"], parsed["head_vocab_size"])
        kwargs.setdefault("head_token_ids", head_ids)
    if parsed["kind"] == "model":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    else:
        config = AutoConfig.from_pretrained(parsed["target"])
        text_config = config.get_text_config(decoder=True)
        num_layers = parsed["num_layers"]
        if num_layers > text_config.num_hidden_layers:
            raise ValueError(
                f"'num_layers' = {num_layers} exceeds the target's {text_config.num_hidden_layers} decoder layers"
            )
        text_config.num_hidden_layers = num_layers
        if getattr(text_config, "layer_types", None) is not None:
            text_config.layer_types = text_config.layer_types[:num_layers]
        # Weights of the layers past k are simply not loaded (reported as unused).
        model = AutoModelForCausalLM.from_pretrained(parsed["target"], config=config, dtype=dtype)
    return DraftModel(model.to(device), **kwargs)

