"""Appending sampled tokens to a sequence, one by one, up to the first stop condition.

In: a Sequence and the tokens the worker returned for it (one token, or
accepted drafts plus the target's token). Out: how many were kept (everything
after a stop is dropped) and, when it stopped, the FinishReason. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence as Tokens
from collections.abc import Set

from protos.segserve.v1.generate import FinishReason
from scheduler.sequence import Sequence


def stop_reason(seq: Sequence, token_id: int, eos_token_ids: Set[int], max_len: int) -> FinishReason | None:
    """Why seq stops after token_id was appended, or None."""
    if token_id in eos_token_ids and not seq.stopping.ignore_eos:
        return FinishReason.EOS_TOKEN
    if token_id in seq.stopping.stop_token_ids:
        return FinishReason.STOP_TOKEN
    if seq.num_output_tokens >= seq.stopping.max_tokens:
        return FinishReason.LENGTH
    if seq.num_tokens >= max_len:
        return FinishReason.CONTEXT_LENGTH
    return None


def append_tokens(seq: Sequence, token_ids: Tokens[int], now: float, eos_token_ids: Set[int],
                  max_len: int) -> tuple[int, FinishReason | None]:
    """Append token_ids until one stops seq: (number kept, why it stopped or None)."""
    for num_kept, token_id in enumerate(token_ids, start=1):
        seq.append_token(token_id, now)
        reason = stop_reason(seq, token_id, eos_token_ids, max_len)
        if reason is not None:
            return num_kept, reason
    return len(token_ids), None
