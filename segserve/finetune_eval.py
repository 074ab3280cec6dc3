"""How well a model places segment markers: greedy generation on held-out prompts, precision and recall.

In: held-out {"prompt", "completion"} or chat samples (unannotated or annotated: markers in them are
ignored), a fine-tuned model directory (its tokenizer records the markers) and the base model it started
from. Out: a JSON report per model.

Scoring one generation: the marker tokens are taken out of the generated tokens, leaving the clean text the
model wrote. The annotator's boundary rules (segserve/annotate.py) find the true segments of that clean text;
each segment's start marker belongs right before it and its end marker right after it. A marker's position is
the number of clean tokens before it. A generated marker is correct when the same marker belongs within
`tolerance` clean tokens of where it was generated (each true marker matches at most one generated one).
Precision = correct / generated markers, recall = correct / true markers, summed over all samples (a zero
denominator gives 0.0; the counts are reported too). Scoring the model's own text, not the reference
answer, measures placement and not whether the model guessed the answer's exact content.

A second score, "reference", reads the held-out answer itself, annotated by the rules (teacher forcing):
at each label token the model's greedy choice is compared with the answer's token. A marker chosen where
the answer has that marker is correct; precision and recall as above, with no tolerance. It measures the
base model where its own text has no segments to find.

The base model is scored with the fine-tuned tokenizer, its embeddings grown the way fine-tuning grows them:
it could emit the markers, it was never taught to.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

from segserve.annotate import (MarkedKind, annotate_sample, load_marked_kinds, read_samples, segment_spans,
                               strip_markers)
from segserve.finetune import encode_sample, load_model_for_tokenizer, prompt_token_ids


def marker_positions(token_ids: Iterable[int], marker_of: dict[int, str]) -> tuple[list[int], list[tuple[str, int]]]:
    """(clean token ids, [(marker, number of clean tokens before it)])."""
    clean: list[int] = []
    markers: list[tuple[str, int]] = []
    for token_id in token_ids:
        if token_id in marker_of:
            markers.append((marker_of[token_id], len(clean)))
        else:
            clean.append(token_id)
    return clean, markers


def true_positions(clean_ids: list[int], tokenizer: Any, kinds: list[MarkedKind]) -> list[tuple[str, int]]:
    """Where the rules put the markers in the clean text, as clean-token positions."""
    text = tokenizer.decode(clean_ids, skip_special_tokens=True)
    ends = [len(tokenizer.decode(clean_ids[: i + 1], skip_special_tokens=True)) for i in range(len(clean_ids))]

    def position(char: int) -> int:  # the clean tokens that end at or before `char`
        return sum(1 for end in ends if end <= char)

    truth = []
    for kind, span in segment_spans(text, kinds):
        truth += [(kind.start, position(span.start)), (kind.end, position(span.end))]
    return truth


def match(generated: list[tuple[str, int]], truth: list[tuple[str, int]], tolerance: int) -> int:
    """How many generated markers sit within `tolerance` tokens of a still unmatched true one of their kind."""
    free = list(truth)
    num_matched = 0
    for marker, pos in generated:
        candidates = [t for t in free if t[0] == marker and abs(t[1] - pos) <= tolerance]
        if candidates:
            free.remove(min(candidates, key=lambda t: abs(t[1] - pos)))
            num_matched += 1
    return num_matched


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0


def score(generations: list[list[int]], tokenizer: Any, kinds: list[MarkedKind], marker_of: dict[int, str],
          tolerance: int) -> dict:
    counts = Counter()
    for token_ids in generations:
        clean, generated = marker_positions(token_ids, marker_of)
        truth = true_positions(clean, tokenizer, kinds)
        counts.update(generated=len(generated), true=len(truth), matched=match(generated, truth, tolerance))
    return {"precision": _ratio(counts["matched"], counts["generated"]),
            "recall": _ratio(counts["matched"], counts["true"]),
            "num_generated_markers": counts["generated"], "num_true_markers": counts["true"],
            "num_matched": counts["matched"]}


def reference_score(model: Any, encoded: list[tuple[list[int], int]], marker_of: dict[int, str]) -> dict:
    """Greedy choices along the annotated reference answers (prompt + label token ids, number of prompt tokens)."""
    import torch

    counts = Counter()
    for ids, num_prompt in encoded:
        labels = ids[num_prompt:]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), logits_to_keep=len(labels) + 1).logits[0, :-1]  # [L, V]
        for choice, label in zip(logits.argmax(-1).tolist(), labels):
            counts.update(generated=choice in marker_of, true=label in marker_of,
                          matched=choice in marker_of and choice == label)
    return {"precision": _ratio(counts["matched"], counts["generated"]),
            "recall": _ratio(counts["matched"], counts["true"]),
            "num_generated_markers": counts["generated"], "num_true_markers": counts["true"],
            "num_matched": counts["matched"]}


def generate_greedy(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: list[int],
                    batch_size: int = 8) -> list[list[int]]:
    """Greedy continuations (EOS dropped), left-padded batches."""
    import torch

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    outputs: list[list[int]] = []
    for begin in range(0, len(prompts), batch_size):
        batch = prompts[begin: begin + batch_size]
        width = max(map(len, batch))
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])  # [B, T], left-padded
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=False,
                                 max_new_tokens=max(max_new_tokens[begin: begin + batch_size]),
                                 eos_token_id=sorted(eos_ids), pad_token_id=pad_id)
        for row, limit in zip(out[:, width:].tolist(), max_new_tokens[begin: begin + batch_size]):
            row = row[:limit]
            cut = next((i for i, t in enumerate(row) if t in eos_ids), len(row))
            outputs.append(row[:cut])
    return outputs


def evaluate(model_dir: str | Path, base_model_dir: str | Path, data: Iterable[str | Path], out: str | Path,
             segments_config: str | Path | None = None, rules: dict[str, str] | None = None,
             tolerance: int = 1, num_samples: int = 0, extra_tokens: int = 8) -> dict:
    """Score the fine-tuned and the base model on the held-out samples; write and return the report."""
    import torch
    from transformers import AutoTokenizer

    if tolerance < 0 or num_samples < 0 or extra_tokens < 0:
        raise ValueError("tolerance, num_samples and extra_tokens must be >= 0")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    kinds = load_marked_kinds(segments_config, rules, tokenizer)
    markers = [m for kind in kinds for m in (kind.start, kind.end)]
    marker_of = {tokenizer.convert_tokens_to_ids(m): m for m in markers}
    if len(marker_of) != len(set(markers)) or any(i is None or i == tokenizer.unk_token_id for i in marker_of):
        raise ValueError(f"{model_dir}'s tokenizer lacks the markers {markers}: is it a fine-tuned model?")
    samples = list(read_samples(data))[: num_samples or None]
    if not samples:
        raise ValueError("no held-out samples")
    prompts, limits, references = [], [], []
    for sample in samples:
        clean = _strip_sample(sample, kinds)
        references.append(encode_sample(annotate_sample(clean, kinds)[0], tokenizer, max_length=100_000))
        ids, num_prompt = encode_sample(clean, tokenizer, max_length=100_000)
        prompts.append(prompt_token_ids(clean["prompt"], tokenizer) if "prompt" in clean else ids[:num_prompt])
        # room for the reference answer, its markers and a few tokens more
        limits.append(len(ids) - num_prompt + 2 * len(segment_spans(_label(clean), kinds)) + extra_tokens)
    report = {"tolerance_tokens": tolerance, "num_samples": len(samples), "markers": markers, "models": {},
              "examples": []}
    texts = {}
    for name, directory in (("finetuned", model_dir), ("base", base_model_dir)):
        torch.manual_seed(0)  # the base model's new embedding rows are drawn at random
        model = load_model_for_tokenizer(directory, tokenizer).eval()
        generations = generate_greedy(model, tokenizer, prompts, limits)
        report["models"][name] = {"model": str(directory),
                                  **score(generations, tokenizer, kinds, marker_of, tolerance),
                                  "reference": reference_score(model, references, marker_of)}
        texts[name] = [tokenizer.decode(g) for g in generations[:5]]
        del model
    report["examples"] = [{"prompt": tokenizer.decode(p, skip_special_tokens=True), "finetuned": f, "base": b}
                          for p, f, b in zip(prompts, texts["finetuned"], texts["base"])]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    return report


def _label(sample: dict) -> str:
    return sample["completion"] if "completion" in sample else sample["messages"][-1]["content"]


def _strip_sample(sample: dict, kinds: list[MarkedKind]) -> dict:
    if "completion" in sample:
        return {**sample, "completion": strip_markers(sample["completion"], kinds)}
    return {**sample, "messages": [{**m, "content": strip_markers(m["content"], kinds)} for m in sample["messages"]]}
