"""How a structured output becomes a grammar: the choices the router's compile check and the worker's compiler
must make alike, so that what the edge accepts is what the worker enforces.

In: a StructuredOutput's spec, or the error xgrammar raised for one. Out: the options a JSON schema is compiled
with, the schema of "any JSON object", the EBNF of a choice list, a structural tag in the engine's form, and the
engine's message without its source location. Imports no grammar engine: the router builds grammars without a
tokenizer, the worker compiles them against its model's, each through its own xgrammar entry point.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

JSON_SCHEMA_OPTIONS = {"any_whitespace": False}
"""No free whitespace: one-line JSON, so a model that favours blanks cannot spin in them forever."""
LLGUIDANCE_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                           "coerce_one_of": False, "lenient": False}
"""llguidance's JSON options, as overrides (a schema's own `x-guidance` cannot loosen them): the one-line layout
xgrammar writes with JSON_SCHEMA_OPTIONS (", " and ": "), and nothing approximated: no keyword ignored, no oneOf
read as anyOf but where common/schema_exactness.py proved its branches disjoint (its llguidance_options)."""
JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""Any JSON object (additional properties allowed: compile it with strict_mode=False); not a top-level array."""
ROOT_RULE = "root"
"""The rule a structured output's EBNF grammar starts from."""
_ENGINE_PREFIX = re.compile(r"^\[[0-9:.]+\]\s*\S+:\d+:\s*")  # xgrammar's "[08:17:05] /project/cpp/x.cc:83: "


_LOOSE_STRING_CHARACTER = r'[^\"\\\r\n]'
"""The engine's (xgrammar 0.2's) rule for one character of a string with minLength or maxLength, as its EBNF
prints it: it lets the control characters U+0000-U+001F other than CR and LF through, which JSON forbids raw."""
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\]'
"""One character JSON allows raw in a string: no control character, quote or backslash."""


def json_string_characters(ebnf: str) -> str:
    """A JSON schema's grammar (the engine's EBNF of it) whose length-bounded strings allow only characters JSON
    allows raw; the engine's own rule would let control characters into them, making the output invalid JSON."""
    return ebnf.replace(_LOOSE_STRING_CHARACTER, _JSON_STRING_CHARACTER)


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose root matches exactly one of `choices` (JSON string escapes are EBNF's too)."""
    return f"{ROOT_RULE} ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def structural_tag(value: dict) -> dict:
    """A structural tag in the grammar engine's form, {"type": "structural_tag", "format": {...}}, from that form
    or from the older one OpenAI-style APIs take: {"structures": [{"begin", "schema", "end"}], "triggers": [...]},
    free text until a trigger, then one of the structures whose begin it starts (each structure's content
    matching its JSON schema). ValueError says what is missing; whether the format compiles is the engine's to
    say."""
    if "format" in value:
        if not isinstance(value["format"], dict):
            raise ValueError("`format` must be an object")
        return {"type": "structural_tag", "format": value["format"]}
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise ValueError("needs `format`, or non-empty `structures` and `triggers` lists")
    tags = []
    for index, structure in enumerate(structures):
        if not (isinstance(structure, dict) and isinstance(structure.get("begin"), str)
                and isinstance(structure.get("end"), str) and isinstance(structure.get("schema"), (dict, bool))):
            raise ValueError(f"structures[{index}] needs `begin` and `end` strings and a `schema` object")
        tags.append({"type": "tag", "begin": structure["begin"], "end": structure["end"],
                     "content": {"type": "json_schema", "json_schema": structure["schema"]}})
    if not all(isinstance(trigger, str) and trigger for trigger in triggers):
        raise ValueError("`triggers` must be non-empty strings")
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}


def engine_message(exc: BaseException) -> str:
    """The first line of the grammar engine's error, without the source location it starts with."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    return _ENGINE_PREFIX.sub("", lines[0])
