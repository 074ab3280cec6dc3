"""Redaction of personal data and secrets in records, before the consumer writes them.

In: a record (assembly.build_record). Out: a copy whose strings, at any depth of
the request and in the response, have e-mail addresses, phone numbers and API
keys replaced by [EMAIL], [PHONE] and [API_KEY]. The response's token ids (every
choice's) encode the unredacted text, so a redacted record carries none.
"""

from __future__ import annotations

import re
from typing import Any

_PATTERNS = (
    # API keys first: some contain digit runs a phone pattern would half-match.
    ("[API_KEY]", re.compile(
        r"\b(?:sk|pk|rk)-(?:[A-Za-z0-9_-]{2,16}-)?[A-Za-z0-9_-]{16,}"  # OpenAI / Anthropic / Stripe style
        r"|\bAKIA[0-9A-Z]{16}\b"  # AWS access key id
        r"|\bgh[pousr]_[A-Za-z0-9]{30,}"  # GitHub tokens
        r"|\bxox[abprs]-[A-Za-z0-9-]{10,}"  # Slack tokens
        r"|\bAIza[0-9A-Za-z_-]{35}"  # Google API keys
        r"|(?<=Bearer )[A-Za-z0-9._~+/-]{16,}=*")),
    ("[EMAIL]", re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}")),
    # +country code optional, 7-15 digits with the usual separators; bare short numbers stay.
    ("[PHONE]", re.compile(r"(?<![\w+])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{2,4}\)[\s.-]?)?\d{2,4}(?:[\s.-]\d{2,4}){1,4}(?!\w)"
                           r"|(?<![\w+])\+\d{7,15}\b")),
)
_MIN_PHONE_DIGITS = 7
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")  # ISO dates look like phone numbers; they are not


def redact_text(text: str) -> str:
    for label, pattern in _PATTERNS:
        if label == "[PHONE]":
            text = pattern.sub(lambda m: label if _is_phone(m.group()) else m.group(), text)
        else:
            text = pattern.sub(label, text)
    return text


def redact_record(record: dict[str, Any]) -> dict[str, Any]:
    redacted = {key: _redact_value(value) for key, value in record.items()
                if key not in ("response_token_ids", "request_id", "session_id", "client_id", "service_id")}
    if redacted.get("other_choices"):
        redacted["other_choices"] = [{**choice, "token_ids": []} for choice in redacted["other_choices"]]
    return {**record, **redacted, "response_token_ids": []}


def _redact_value(value: Any) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, list):
        return [_redact_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _redact_value(v) for k, v in value.items()}
    return value


def _is_phone(text: str) -> bool:
    return sum(ch.isdigit() for ch in text) >= _MIN_PHONE_DIGITS and not _DATE.fullmatch(text)
