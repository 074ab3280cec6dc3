"""Learned segments through reflow's redaction before they reach a corpus, the shared log or a snapshot.

In: a closed segment's token ids. Out: the same ids when their text holds nothing
to redact, else the ids of the redacted text (e-mail addresses, phone numbers and
API keys replaced by [EMAIL], [PHONE] and [API_KEY], as common.redact
does for the inference logs). The corpus then never proposes, persists or shares
what redaction removes; drafts of that text are lost, which costs speed, never
correctness (a draft is only a guess the target verifies).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from common.redact import redact_text


class SegmentRedactor:
    """Callable over token ids with the served model's tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_ids: Sequence[int]) -> Sequence[int]:
        text = self.tokenizer.decode(list(token_ids))
        redacted = redact_text(text)
        if redacted == text:
            return token_ids
        return self.tokenizer.encode(redacted, add_special_tokens=False)
