"""A JSON schema at the API edge: which grammar engine enforces it exactly, or why none does.

In: a JSON_SCHEMA structured output's spec, and how to compile it with xgrammar (structured.py's check, without
a tokenizer); or a structural tag's, whose schemas xgrammar alone compiles (refused where it would approximate).
Out: None when an engine enforces the schema exactly, else the reason for the 400: "does not compile: ..." (no
engine builds a grammar of it) or "cannot be enforced exactly: ..." naming each construct neither engine
enforces and its JSON pointer. The rule is common/schema_exactness.py's, the one the worker follows when it
compiles the same spec: xgrammar where the schema has no xgrammar gap and compiles, else llguidance where it
compiles it (llguidance refuses what it would approximate), else refused. Runs in structured.py's compile
threads; llguidance is imported at the first schema xgrammar cannot take.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable

from common.schema_exactness import (
    Gap,
    empty_ref_cycle,
    llguidance_gaps,
    llguidance_options,
    llguidance_schema,
    xgrammar_gaps,
)

MAX_NAMED_GAPS = 3
"""Constructs a refusal names (then how many more there are)."""
_HINT = re.compile(r"\.?\s*Enable '\w+' option[^.]*\.?")
_PLACE = re.compile(r"\s*while processing \S*?#(\S*)")  # llguidance's "while processing <uri>#/definitions/x"


def json_schema_problem(spec: str, xgrammar_problem: Callable[[str], str | None]) -> str | None:
    """Why no engine enforces the schema `spec` exactly (None: one does). xgrammar_problem(spec): why xgrammar
    does not build a grammar of it, None when it does."""
    schema = json.loads(spec)
    gaps = xgrammar_gaps(schema) if isinstance(schema, dict) else []
    compile_problem = None if gaps else xgrammar_problem(spec)
    if not gaps and compile_problem is None:
        return None
    if not isinstance(schema, dict):  # (a boolean schema; the body refuses them before)
        return f"does not compile: {compile_problem}"
    cycle = empty_ref_cycle(schema)
    if cycle is not None:
        return f"does not compile: Circular $ref chain with no schema content (at {cycle or '/'})"
    guidance_gaps = llguidance_gaps(schema)
    if guidance_gaps:
        return f"cannot be enforced exactly: {_named(guidance_gaps, gaps)}"
    guidance_problem = llguidance_problem(schema)
    if guidance_problem is None:
        return None
    if compile_problem is not None:  # neither compiles it
        return f"does not compile: {compile_problem}; and llguidance refuses it: {guidance_problem}"
    return f"cannot be enforced exactly: {_named(gaps, [])}; and llguidance refuses it: {guidance_problem}"


def structural_tag_problem(spec: str) -> str | None:
    """Why a structural tag's JSON schemas (its `{"type": "json_schema", "json_schema": {...}}` contents) are not
    enforced exactly: xgrammar alone compiles a tag, so each gap of theirs is named, its pointer from the tag's
    root; None when they have none."""
    gaps, pending = [], [(json.loads(spec), "")]
    while pending:
        value, pointer = pending.pop()
        if isinstance(value, dict):
            if value.get("type") == "json_schema" and isinstance(value.get("json_schema"), dict):
                place = f"{pointer}/json_schema"
                gaps += [Gap(gap.construct, place + gap.pointer, gap.why)
                         for gap in xgrammar_gaps(value["json_schema"])]
                continue
            pending.extend((child, f"{pointer}/{key}") for key, child in value.items())
        elif isinstance(value, list):
            pending.extend((child, f"{pointer}/{index}") for index, child in enumerate(value))
    return f"cannot be enforced exactly: {_named(gaps, [])}" if gaps else None


def _named(gaps: list[Gap], also: list[Gap]) -> str:
    """The first MAX_NAMED_GAPS of `gaps` in words (one that `also` has too: "neither engine enforces it")."""
    both = {(gap.construct, gap.pointer) for gap in also}
    shown = "; ".join(str(gap) if (gap.construct, gap.pointer) not in both else
                      f"{gap.construct} at {gap.pointer or '/'} (neither xgrammar nor llguidance enforces it)"
                      for gap in gaps[:MAX_NAMED_GAPS])
    more = len(gaps) - MAX_NAMED_GAPS
    return shown + (f"; and {more} more" if more > 0 else "")


def llguidance_problem(schema: dict) -> str | None:
    """Why llguidance does not build an exact grammar of `schema` (None: it does, and some output matches it)."""
    llguidance = _llguidance()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(llguidance_schema(schema),
                                                              overrides=llguidance_options(schema))
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    if matcher.is_error():
        return guidance_message(matcher.get_error())
    if not any(matcher.compute_bitmask()):
        return "it matches no output at all"
    return None


def guidance_message(error: str) -> str:
    """llguidance's error on one line, its place ("while processing ...#/a/b") as a JSON pointer."""
    place = _PLACE.search(error)
    first = error.strip().splitlines()[0] if error.strip() else "llguidance refused it"
    first = _HINT.sub("", first)  # (its options are the server's, not the client's)
    return first + (f" (at {place.group(1) or '/'})" if place and place.group(0) not in first else "")


@functools.cache
def _llguidance():
    import llguidance

    return llguidance


class _Bytes:
    """A vocabulary of the 256 bytes and an end token, as llguidance's TokenizerWrapper reads one."""

    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([byte]) for byte in range(256)] + [b"</s>"]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@functools.cache
def _byte_tokenizer():
    llguidance = _llguidance()
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))
