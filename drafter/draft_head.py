"""A draft model's output head restricted to the tokens that matter.

On a CPU the head of a large-vocabulary model dominates a draft step (gemma-3-270m:
262,144 x 640, ~63 ms a row, against ~8 ms per decoder layer). A draft only needs
to guess tokens the target is likely to emit, so its head keeps a fixed set (the
most frequent tokens of a corpus, plus special tokens) and, per call, the tokens of
the request's own context (code edits and grounded answers copy them).

In: the head weight [V, H], the fixed token ids (from a spec's "head_vocab_size" +
"head_vocab_corpus" text files), a final hidden state [H] and the context.
Out: logits over the kept tokens and the token id of each logit.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch


class RestrictedHead:
    """Logits over a fixed token subset plus the context's own tokens."""

    def __init__(self, weight: torch.Tensor, token_ids: Sequence[int], softcap: float | None = None):
        vocab_size = weight.shape[0]
        ids = sorted(set(int(t) for t in token_ids))
        if not ids:
            raise ValueError("a restricted head needs at least one token id")
        if ids[0] < 0 or ids[-1] >= vocab_size:
            raise ValueError(f"head token ids must lie in [0, {vocab_size}), got {ids[0]}..{ids[-1]}")
        self.weight = weight  # [V, H], the full head (shared, not copied)
        self.token_ids = torch.tensor(ids, dtype=torch.long, device=weight.device)  # [N]
        self.fixed_weight = weight[self.token_ids].contiguous()  # [N, H]
        self.softcap = softcap
        """Gemma-style final logit soft-capping (tanh(x / c) * c), or None."""
        self._fixed = set(ids)

    def logits(self, hidden: torch.Tensor, context: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [N + E] for hidden [H]; the token id [N + E] of each (E = context tokens not fixed)."""
        extra = sorted(set(context) - self._fixed)
        logits = self.fixed_weight @ hidden  # [N]
        ids = self.token_ids
        if extra:
            extra_ids = torch.tensor(extra, dtype=torch.long, device=ids.device)  # [E]
            logits = torch.cat([logits, self.weight[extra_ids] @ hidden])  # [N + E]
            ids = torch.cat([ids, extra_ids])
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float(), ids


def most_frequent_token_ids(
    token_streams: Iterable[Sequence[int]], num_tokens: int, always: Iterable[int] = ()
) -> list[int]:
    """The `num_tokens` most frequent ids across streams (ties: smaller id first), plus `always`."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    counts: Counter[int] = Counter()
    for stream in token_streams:
        counts.update(stream)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:num_tokens]
    return sorted({token_id for token_id, _ in ranked} | set(always))


def parse_head_vocab(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The head-vocabulary keys of a draft-model spec, validated ({} when absent)."""
    size, corpus = spec.get("head_vocab_size"), spec.get("head_vocab_corpus")
    if size is None and corpus is None:
        return {}
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"'head_vocab_size' must be a positive integer (with 'head_vocab_corpus'), got {size!r}")
    files = [corpus] if isinstance(corpus, (str, Path)) else corpus
    if not files or not isinstance(files, (list, tuple)) or not all(isinstance(f, (str, Path)) for f in files):
        raise ValueError(f"'head_vocab_corpus' must be a text file or a list of them, got {corpus!r}")
    paths = [Path(f).expanduser() for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"'head_vocab_corpus' files not found: {missing}")
    return {"head_vocab_size": size, "head_vocab_corpus": paths}


def corpus_head_token_ids(model_dir: Path, corpus_files: Sequence[Path], num_tokens: int) -> list[int]:
    """The head's fixed tokens: the corpus's most frequent ones plus every special token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    streams = (tokenizer(Path(path).read_text(errors="replace"))["input_ids"] for path in corpus_files)
    return most_frequent_token_ids(streams, num_tokens, always=tokenizer.all_special_ids)
