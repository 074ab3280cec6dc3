"""Float64 references for logits, and the bound an fp32 forward is held to against them.

Two fp32 forwards of the same model that add their sums up in different orders (a sum split over tensor-parallel
ranks, another kernel, another instruction set) round differently, and by how much depends on the machine: an
absolute tolerance fitted on one CPU fails on another. What does not depend on the machine is the exact result.
So a forward under test is held to the float64 forward of the same checkpoint, the exact result to within fp32's
own rounding: it must be no further from it than a reference fp32 forward of the same steps is (up to SLACK), and
choose the same greedy token on every row.

Why SLACK and the floor. Both fp32 forwards do the same operations in different orders, so standard error analysis
gives both the same worst-case bound; the reference's observed error is an estimate of what that machine's fp32
makes of this model, not a ceiling, and the other's maximum over a step's rows may land above it. SLACK = 2 says:
the same order of rounding, not more than twice the reference's largest error. The floor, FLOOR_ULPS units of
fp32 rounding at the logits' scale, keeps a step whose reference error happens to be tiny from demanding less than
one rounding of the output itself."""

from __future__ import annotations

import torch

from protos.segserve.v1.step import StepRequest
from protos.segserve.v1.tree import CandidateTree

SLACK = 2.0
FLOOR_ULPS = 8
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
FP32_UNIT_ROUNDOFF = UNIT_ROUNDOFF[torch.float32]


def tree_paths(root: int, tree: CandidateTree) -> list[list[int]]:
    """Each row of a tree step, as its tokens from the root: row 0 is the root, row i + 1 is draft node i."""
    paths = [[root]]
    for token, parent in zip(tree.token_ids, tree.parents):
        paths.append(paths[parent + 1] + [token])
    return paths


def row_prefixes(requests: list[StepRequest]) -> list[list[list[int]]]:
    """For each step, the whole token sequence behind each logits row it returns, in the runner's row order
    (sequences in order; a sequence's sampled indices, or its tree's nodes)."""
    history: dict[str, list[int]] = {}
    steps = []
    for request in requests:
        rows = []
        for seq in request.sequences:
            before = history.get(seq.seq_id, [])[:seq.num_computed_tokens]
            if seq.draft is not None:
                rows += [before + path for path in tree_paths(seq.token_ids[-1], seq.draft)]
            else:
                rows += [before + list(seq.token_ids[:index + 1]) for index in seq.sample_indices]
            history[seq.seq_id] = before + list(seq.token_ids)
        steps.append(rows)
    return steps


def exact_last_logits(model_dir, rows: list[list[int]]) -> torch.Tensor:
    """The float64 forward's logits after each of `rows` (token sequences), each run from scratch: [rows, V].
    Transformers' eager attention: the one that does everything a config asks (soft-capping included)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager").eval()
    with torch.inference_mode():
        return torch.stack([model(torch.tensor([row])).logits[0, -1] for row in rows])


def exact_logits(model_dir, requests: list[StepRequest]) -> list[torch.Tensor]:
    """The float64 forward's logits for every row of every step: [rows, V] a step."""
    steps = row_prefixes(requests)
    rows = exact_last_logits(model_dir, [row for step in steps for row in step])
    return list(rows.split([len(step) for step in steps]))


def assert_as_exact_as(actual: torch.Tensor, reference: torch.Tensor, exact: torch.Tensor) -> None:
    """`actual` is within fp32's rounding of `exact`, as `reference` is, and picks the same greedy token on every
    row. actual, reference: fp32 [rows, V] (a test's steps concatenated: the more rows, the steadier the largest
    error); exact: float64 [rows, V]."""
    assert actual.shape == reference.shape == exact.shape and actual.shape[0] > 0
    exact = exact.to(actual.device)
    reference_error = (reference.double() - exact).abs().max().item()
    error = (actual.double() - exact).abs().max().item()
    bound = max(SLACK * reference_error, FLOOR_ULPS * FP32_UNIT_ROUNDOFF * exact.abs().max().item())
    assert error <= bound, f"{error:.3g} from the float64 forward, more than {bound:.3g} (the reference is " \
                           f"{reference_error:.3g} from it)"
    assert torch.equal(actual.argmax(-1), reference.argmax(-1))



def assert_linear_within_rounding(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                  bias: torch.Tensor | None = None) -> None:
    """`out` is `x @ weight.T + bias` as a float32-accumulating kernel may compute it, in any order of summation.

    A dot product of length n computed in floating point is within γ_n · Σ|x_i·w_i| of the exact one, whatever the
    order or blocking of its additions (γ_n = n·u / (1 - n·u), u = float32's unit roundoff; Higham, Accuracy and
    Stability of Numerical Algorithms, §3.1); a fused multiply-add only rounds less. Here n = K + 1 (the bias is one
    more addition). An output in a narrower dtype is rounded to it at most twice more (after the product and after
    the bias), by its own u each. The bound holds on every machine: nothing in it was measured.
    x: [..., K]; weight: [N, K]; bias: [N] or None; out: [..., N]."""
    x64, weight64 = x.double(), weight.double()
    exact = x64 @ weight64.T + (bias.double() if bias is not None else 0.0)
    magnitude = x64.abs() @ weight64.abs().T + (bias.double().abs() if bias is not None else 0.0)
    n = x.shape[-1] + 1
    gamma = n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF)
    accumulated = gamma * magnitude
    if out.dtype != torch.float32:
        accumulated = accumulated + 3 * UNIT_ROUNDOFF[out.dtype] * (exact.abs() + accumulated)  # (1 + u)² - 1 < 3u
    bound = accumulated
    error = (out.double() - exact).abs()
    assert out.shape == exact.shape and bool((error <= bound).all()), \
        f"{(error / bound.clamp_min(1e-300)).max().item():.3g} times the rounding bound"
