"""common/schema_exactness.py against the engines themselves: whatever it calls exact, the engine enforces (an
output that breaks the schema is refused by the engine's grammar), and what it calls a gap is named where it is.

The engines run over a vocabulary of the 256 bytes, so a text is matched byte by byte (no model, no tokenizer).
"""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest
import xgrammar as xgr

from common.grammar import JSON_SCHEMA_OPTIONS
from common.schema_exactness import (
    empty_ref_cycle,
    llguidance_gaps,
    llguidance_options,
    llguidance_schema,
    regex_problem,
    xgrammar_gaps,
)
from tests.support.real_schemas import real_world_schemas

_BYTES = [bytes([byte]) for byte in range(256)] + [b"</s>"]
_XGRAMMAR = xgr.GrammarCompiler(xgr.TokenizerInfo(_BYTES, vocab_type=xgr.VocabType.RAW, stop_token_ids=[256]),
                                max_threads=1, cache_enabled=False)


class _ByteTokenizer:
    eos_token_id, bos_token_id, special_token_ids, tokens = 256, None, [256], _BYTES

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


_LLGUIDANCE = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))


def xgrammar_accepts(schema: dict, text: str) -> bool:
    matcher = xgr.GrammarMatcher(_XGRAMMAR.compile_grammar(
        xgr.Grammar.from_json_schema(json.dumps(schema), **JSON_SCHEMA_OPTIONS)))
    return all(matcher.accept_token(byte) for byte in text.encode()) and matcher.accept_token(256)


def llguidance_accepts(schema: dict, text: str) -> bool | None:
    """Whether llguidance's grammar matches `text`; None when llguidance refuses the schema."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(llguidance_schema(schema),
                                                              overrides=llguidance_options(schema))
    matcher = llguidance.LLMatcher(_LLGUIDANCE, grammar, log_level=0)
    if matcher.is_error():
        return None
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def is_valid(schema: dict, text: str) -> bool:
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(schema).is_valid(
        json.loads(text))


OBJECT_AB = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
# (schema, an output that breaks it, written as the engines write JSON: ", " and ": ")
BROKEN = {
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
    "not": ({"type": "integer", "not": {"const": 1}}, "1"),
    "if/then": ({**OBJECT_AB, "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, '{"a": 1}'),
    "dependentRequired": ({**OBJECT_AB, "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    "dependentSchemas": ({**OBJECT_AB, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}'),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "[1]"),
    "multipleOf on a number": ({"type": "number", "multipleOf": 0.5}, "0.3"),
    "pattern and minLength": ({"type": "string", "pattern": "^[a-z]+$", "minLength": 3}, '"ab"'),
    "pattern and maxLength": ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, '"abcd"'),
    "lookahead": ({"type": "string", "pattern": "^(?!x)[a-z]+$"}, '"xa"'),
    "anchor inside": ({"type": "string", "pattern": "a^b"}, '"ab"'),
    "alternatives and a counted repetition": ({"type": "string", "pattern": "^([A-F]|[A-F]{1,3})$"}, '"AAAAA"'),
    "oneOf overlapping": ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1"),
    "oneOf beside type": ({"type": "string", "oneOf": [{"minLength": 2}, {"maxLength": 0}]}, '"a"'),
    "allOf of two": ({"allOf": [{"type": "integer", "minimum": 5}, {"maximum": 7}]}, "9"),
    "allOf of objects": ({"allOf": [{**OBJECT_AB, "required": ["a"]}, {"properties": {"a": {"minimum": 5}}}]},
                         '{"a": 1}'),
    "anyOf beside properties": ({**OBJECT_AB, "anyOf": [{"required": ["a"]}]}, "{}"),
    "enum beside type": ({"type": "string", "enum": ["a", 1]}, "1"),
    "const beside minLength": ({"type": "string", "const": "ab", "minLength": 3}, '"ab"'),
    "minLength without type": ({"minLength": 3}, '"a"'),
    "minimum without type": ({"minimum": 3}, "1"),
    "required without type": ({"required": ["a"]}, "{}"),
    "minItems without type": ({"minItems": 1}, "[]"),
    "$ref beside minimum": ({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "minimum": 5}, "1"),
    "$ref to an anchor": ({"$defs": {"n": {"$anchor": "n", "type": "integer"}}, "$ref": "#n"}, '"a"'),
    "propertyNames": ({"type": "object", "additionalProperties": {"type": "integer"},
                       "propertyNames": {"pattern": "^[a-z]+$"}}, '{"A": 1}'),
    "maxProperties": ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
                      '{"a": 1, "b": 2}'),
    "exclusive bounds": ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, "1"),
    "integer multipleOf": ({"type": "integer", "multipleOf": 3}, "4"),
    "oneOf discriminated": ({"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["kind"]},
        {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]}]}, '{"kind": "c"}'),
    "oneOf by type": ({"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}, "1"),
    "bounded string": ({"type": "string", "minLength": 2, "maxLength": 3}, '"abcd"'),
    "oneOf proved disjoint, beside an allOf": ({"allOf": [{"type": "object"}, {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}}, "required": ["kind"]},
        {"type": "object", "properties": {"kind": {"enum": ["b"]}, "n": {"maximum": 3}}, "required": ["kind"]}]}]},
        '{"kind": "b", "n": 4}'),
}


@pytest.mark.parametrize("name", BROKEN)
def test_what_is_called_exact_is_enforced(name):
    schema, broken = BROKEN[name]
    assert not is_valid(schema, broken)
    if not xgrammar_gaps(schema):
        assert not xgrammar_accepts(schema, broken), f"xgrammar lets {broken} through and no gap was named"
    if not llguidance_gaps(schema):
        assert not llguidance_accepts(schema, broken), f"llguidance lets {broken} through"


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "tags": {
        "type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}, "required": ["name"]},
    {"type": "string", "enum": ["a", "b"]},
    {"type": ["string", "null"], "minLength": 2},
    {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": "^x+$"}]},
    {"type": "array", "prefixItems": [{"type": "integer"}], "items": False, "minItems": 1},
    {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"a": {"type": "integer"}},
     "$ref": "#/definitions/a", "description": "ignored beside $ref in draft 7", "minimum": 5},
    {"type": "object", "properties": {"format": {"type": "string"}, "when": {"type": "string", "format": "date"}}},
    {"oneOf": [{"const": "a"}, {"enum": ["b", 1]}]},
    {"type": "object", "anyOf": [{"type": "object", "required": ["a"]}, {"type": "object", "required": ["b"]}]},
])  # fmt: skip
def test_what_xgrammar_enforces_has_no_gap(schema):
    assert xgrammar_gaps(schema) == []


def test_a_gap_is_named_with_its_json_pointer():
    schema = {"type": "object", "properties": {
        "a/b~c": {"type": "array", "items": {"$ref": "#/$defs/tag"}}},
        "$defs": {"tag": {"type": "array", "uniqueItems": True}, "unused": {"not": {}}}}
    gaps = xgrammar_gaps(schema)
    assert [(gap.construct, gap.pointer) for gap in gaps] == [("`uniqueItems`", "/$defs/tag")]
    assert str(gaps[0]) == "`uniqueItems` at /$defs/tag (xgrammar ignores it)"
    schema["properties"]["a/b~c"]["not"] = {"const": []}
    assert ("`not`", "/properties/a~1b~0c") in [(gap.construct, gap.pointer) for gap in xgrammar_gaps(schema)]
    assert [(gap.construct, gap.pointer) for gap in llguidance_gaps(schema)] == [  # (not /$defs/unused: unreached)
        ("`not`", "/properties/a~1b~0c"), ("`uniqueItems`", "/$defs/tag")]


@pytest.mark.parametrize("pattern, xgrammar_words, llguidance_words", [
    ("^[a-z]+$", None, None),
    ("^(foo|bar)-[0-9]{1,3}$", None, None),
    ("^[|^$]{1,2}$", None, None),  # (in a character class they are characters)
    ("^(?!org\\.bukkit\\.)[a-z.]+$", "lookaround", "lookaround"),
    ("^(a)\\1$", "backreference", "backreference"),
    ("^a\\b", "word boundary", "word boundary"),
    ("^\\p{L}+$", "Unicode property", None),
    ("a^b", "anchor inside", None),
    ("^(x|x{1,3})$", "counted repetition", None),
])  # fmt: skip
def test_regex_problems(pattern, xgrammar_words, llguidance_words):
    from common.schema_exactness import _without_classes  # (what regex_problem is given)

    for is_xgrammar, words in ((True, xgrammar_words), (False, llguidance_words)):
        problem = regex_problem(_without_classes(pattern), is_xgrammar)
        assert (problem is None) if words is None else (words in problem), problem


def test_llguidance_is_given_the_same_schema_without_what_it_would_refuse_needlessly():
    schema = {"x-guidance": {"lenient": True}, "type": "object", "properties": {
        "format": {"type": "string", "format": "uri-reference"}, "day": {"type": "string", "format": "date"},
        "next": {"$ref": "#/definitions/used"}},
        "definitions": {"used": {"type": "integer"}, "unused": {"$ref": "https://example.com/remote.json"}}}
    given = llguidance_schema(schema)
    assert "x-guidance" not in given and list(given["definitions"]) == ["used"]
    assert given["properties"]["format"] == {"type": "string"}  # the format dropped, the property kept
    assert given["properties"]["day"]["format"] == "date"
    assert "x-guidance" in schema and "format" in schema["properties"]["format"]  # (a copy)
    assert llguidance_accepts(schema, '{"format": "a", "day": "2020-01-01", "next": 1}')


def test_llguidance_reads_a_one_of_as_any_of_only_where_it_was_proved_disjoint():
    by_kind = {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}}, "required": ["kind"]},
                         {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]}]}
    assert llguidance_options({"allOf": [by_kind, {"type": "object"}]})["coerce_one_of"] is True
    assert llguidance_accepts({"allOf": [by_kind, {"type": "object"}]}, '{"kind": "b"}')
    overlapping = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    assert llguidance_options({"anyOf": [by_kind, overlapping]})["coerce_one_of"] is False
    assert llguidance_options({"type": "object"})["coerce_one_of"] is False
    assert llguidance_options({"x-guidance": {"lenient": True}})["lenient"] is False  # (overrides: the server's)


def test_a_ref_cycle_without_content_is_found():
    assert empty_ref_cycle({"$ref": "#"}) == ""
    assert empty_ref_cycle({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                            "$ref": "#/$defs/a"}) == ""
    assert empty_ref_cycle({"type": "object", "properties": {"child": {"$ref": "#"}}}) is None


def test_every_xgrammar_warning_on_a_real_world_schema_called_exact_is_a_proved_one_of(capfd):
    """xgrammar warns (on stderr) where it approximates; where no gap was named, the only warning allowed is its
    oneOf one, for branches that schema_exactness proved disjoint (xgrammar's own proof is weaker): the union it
    falls back to is then exact."""
    exact = [schema for schema in real_world_schemas().values() if not xgrammar_gaps(schema)]
    assert len(exact) > 100
    for schema in exact:
        try:
            xgr.Grammar.from_json_schema(json.dumps(schema), **JSON_SCHEMA_OPTIONS)
        except RuntimeError:  # (one it does not compile: llguidance's then)
            pass
    warnings = [line for line in capfd.readouterr().err.splitlines() if "Warning" in line]
    assert all("oneOf with overlapping" in line for line in warnings), warnings
