"""Per-sequence fault isolation after the forward: a fault tied to one sequence fails it alone.

Three checks, all free on the normal path:
- `non_finite_mask`: which logits rows cannot be sampled from (a NaN, +inf, or nothing but -inf),
  computed on the device; the caller brings it to the host with the sampled tokens, in the step's
  one transfer, and fails the sequences those rows belong to (their tokens are discarded).
- `non_finite_tokens`: which new tokens' keys or values are not finite in the last layer (a value
  that overflows in any layer reaches every later one), so that a forward that overflows fails its
  sequence even in a step that samples nothing from it (a prefill chunk); same transfer.
- `sample_isolated`: sample every row in one call; when the sampler raises, sample each sequence's
  rows on their own, so only the sequence that raises again fails and every other one gets exactly
  the tokens it would have had. Nothing is saved or restored for that: the uniforms are drawn
  before the first call (worker/draws.py) and the retries reuse them, and the sampler is batch
  invariant.
An out-of-memory error is never blamed on one sequence: it fails the whole step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from worker.sampler import SampleRow, SamplerOutput, sample

logger = logging.getLogger(__name__)


def non_finite_mask(logits: torch.Tensor) -> torch.Tensor:
    """Per row of logits [N, V]: whether it cannot be sampled from, [N] bool on the logits' device.

    Tested on the row maxima: torch's max propagates NaN, so a row's max is NaN when any entry
    is, +inf when any entry is, and -inf only when every entry is. A -inf among finite logits
    is harmless (a token some models mask out) and is not flagged. One reduction instead of an
    [N, V] mask.
    """
    if logits.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool, device=logits.device)
    return ~torch.isfinite(logits.amax(dim=1))  # [N]


def non_finite_tokens(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Per new token of one layer, whether its key or value holds a NaN or an infinity: [T] bool on their device.
    key/value: [1, KVH, T, D] and [1, KVH, T, Dv], as the model hands them to attention."""
    return ~(torch.isfinite(key[0]).all(dim=2) & torch.isfinite(value[0]).all(dim=2)).all(dim=0)


def sample_isolated(logits: torch.Tensor, rows: Sequence[SampleRow], uniform: torch.Tensor | None,
                    groups: Sequence[tuple[int, int]]) -> tuple[list[tuple[int, SamplerOutput]], dict[int, str]]:
    """Sample rows [N, V] together; when that raises, each group of rows [start, end) (one sequence's) alone.

    uniform: [N] or None, as sample() takes it. Returns (first row, output) parts that cover every row of
    the groups that did not fail (normally one part: (0, the whole batch)), and group index -> error message.
    """
    try:
        return [(0, sample(logits, rows, uniform))], {}
    except torch.OutOfMemoryError:
        raise
    except Exception:
        logger.warning("sampling %d rows failed; retrying sequence by sequence to find the faulty one", len(rows),
                       exc_info=True)
    parts: list[tuple[int, SamplerOutput]] = []
    failed: dict[int, str] = {}
    for g, (start, end) in enumerate(groups):
        try:
            part_uniform = None if uniform is None else uniform[start:end]
            parts.append((start, sample(logits[start:end], rows[start:end], part_uniform)))
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            failed[g] = f"sampling failed: {type(exc).__name__}: {exc}"
    return parts, failed
