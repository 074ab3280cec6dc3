"""Per-sequence fault isolation after the forward: a fault tied to one sequence fails it alone.

Two checks, both cheap on the normal path:
- `non_finite_rows`: which logits rows cannot be sampled from (a NaN, +inf, or nothing but -inf;
  one host transfer per step);
  the runner fails the sequences those rows belong to before anything is sampled.
- `sample_isolated`: sample a group of rows in one call; when the sampler raises, put every
  row's generator back as it was and sample the rows one by one, so only the row that raises
  again fails and every other row gets exactly the token it would have had (the sampler is
  batch invariant, and a row draws one uniform from its own generator either way).
An out-of-memory error is never blamed on one row: it fails the whole step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from worker.sampler import SampleRow, sample

logger = logging.getLogger(__name__)

RowResult = tuple[int, float, "tuple[list[int], list[float]] | None"]
"""(token id, score, top log-probabilities or None) of one sampled row."""


def non_finite_rows(logits: torch.Tensor) -> list[bool]:
    """Per row of logits [N, V]: whether it cannot be sampled from (one host transfer).

    Tested on the row maxima: torch's max propagates NaN, so a row's max is NaN when any entry
    is, +inf when any entry is, and -inf only when every entry is. A -inf among finite logits
    is harmless (a token some models mask out) and is not flagged. One reduction instead of an
    [N, V] mask.
    """
    if logits.shape[0] == 0:
        return []
    return (~torch.isfinite(logits.amax(dim=1))).tolist()  # [N]


def sample_isolated(logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[RowResult | str]:
    """Sample rows [J, V] together; per row its result, or the error message when that row alone fails."""
    generators = {id(row.generator): row.generator for row in rows if row.generator is not None}
    saved = [(g, g.get_state()) for g in generators.values()]
    try:
        out = sample(logits, rows)
        return list(zip(out.token_ids, out.scores, out.top_logprobs))
    except torch.OutOfMemoryError:
        raise
    except Exception:
        logger.warning("sampling %d rows failed; retrying row by row to find the faulty one", len(rows),
                       exc_info=True)
    for generator, state in saved:
        generator.set_state(state)
    results: list[RowResult | str] = []
    for j, row in enumerate(rows):
        try:
            out = sample(logits[j:j + 1], [row])
            results.append((out.token_ids[0], out.scores[0], out.top_logprobs[0]))
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:
            results.append(f"sampling failed: {type(exc).__name__}: {exc}")
    return results
