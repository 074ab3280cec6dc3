"""Green-list watermarking (Kirchenbauer et al., 2023) with transformers' own processor and detector.

A request that asks for `watermark` gets, at every position, `bias` added to the
logits of a pseudo-random "green" share of the vocabulary (greenlist_ratio), seeded
by the previous token; this runs after every other logits processor, where
transformers puts it. Text written that way holds far more green tokens than the
expected share, which `detect` measures as a z-score. The parameters are fixed
for the service (transformers' `WatermarkingConfig` defaults), so a text can be
tested without knowing which request produced it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PretrainedConfig, WatermarkDetector, WatermarkingConfig, WatermarkLogitsProcessor

WATERMARKING = WatermarkingConfig()
"""greenlist_ratio 0.25, bias 2.0, hashing_key 15485863, seeding_scheme "lefthash", context_width 1."""

_processors: dict[int, WatermarkLogitsProcessor] = {}


def _processor(vocab_size: int) -> WatermarkLogitsProcessor:
    """The CPU processor: its green lists come from CPU random permutations, as `detect`'s do. One built on a GPU
    draws other lists from the same seeds (a CUDA generator's randperm is not the CPU's), so text written on a GPU
    would not test as watermarked."""
    if vocab_size not in _processors:
        _processors[vocab_size] = WATERMARKING.construct_processor(vocab_size, "cpu")
    return _processors[vocab_size]


def apply_watermark(scores: torch.Tensor, histories: Sequence[Sequence[int]]) -> torch.Tensor:
    """scores: [R, V] final logits of R watermarked rows; histories: each row's tokens so far.

    Returns the biased [R, V] logits (filtered tokens stay at -inf). A row with a history
    shorter than the seeding context is left unbiased, as transformers does.
    """
    processor = _processor(scores.shape[1])
    width = WATERMARKING.context_width
    biased = scores.clone()
    for i, history in enumerate(histories):
        if len(history) < width:
            continue
        green = processor._get_greenlist_ids(torch.tensor(list(history[-width:]), dtype=torch.long))  # on the CPU
        green = green.to(scores.device)
        biased[i, green] += processor.bias  # what the processor's __call__ adds, on the scores' device
    return biased


def detect(token_ids: Sequence[int], model_config: PretrainedConfig, z_threshold: float = 4.0) -> dict:
    """Test generated token ids for the watermark: green share, z-score, p-value, verdict.

    z_threshold 4 is the paper's choice (a one-sided false-positive rate of ~3e-5).
    """
    detector = WatermarkDetector(model_config, "cpu", WATERMARKING)
    result = detector(torch.tensor([list(token_ids)], dtype=torch.long), z_threshold=z_threshold, return_dict=True)
    return {
        "num_tokens_scored": int(result.num_tokens_scored[0]),
        "num_green_tokens": int(result.num_green_tokens[0]),
        "green_fraction": float(result.green_fraction[0]),
        "z_score": float(result.z_score[0]),
        "p_value": float(result.p_value[0]),
        "is_watermarked": bool(result.prediction[0]),
    }
