"""router/schema_engines.py: a JSON schema is enforced exactly, by xgrammar or llguidance, or refused with each
construct neither enforces named at its JSON pointer; over hand-made schemas and the real-world ones
(tests/data/schemas), the worker taking the engine the edge chose."""

from __future__ import annotations

import json

import pytest

from common.schema_exactness import llguidance_gaps, xgrammar_gaps
from protos.segserve.v1.sampling import StructuredKind
from router.schema_engines import guidance_message, json_schema_problem, llguidance_problem
from router.structured import _compile_error, _xgrammar_error
from tests.support.real_schemas import real_world_schemas
from worker.grammar import json_schema_source


def problem(schema: dict) -> str | None:
    return _compile_error(StructuredKind.JSON_SCHEMA, json.dumps(schema))


@pytest.mark.parametrize("schema, engine", [
    ({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}, "xgrammar"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "llguidance"),
    ({"allOf": [{"type": "integer", "minimum": 5}, {"maximum": 7}]}, "llguidance"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]}, "llguidance"),
    ({"type": "string", "pattern": "^(?:[1-9]\\d{0,2}|1\\d{3})$"}, "llguidance"),
    ({"type": "integer", "minimum": 1.5, "maximum": 3.5}, "llguidance"),  # (xgrammar does not compile it)
])  # fmt: skip
def test_an_enforceable_schema_is_accepted_and_the_worker_takes_the_same_engine(schema, engine):
    assert problem(schema) is None
    assert json_schema_source(json.dumps(schema))[0] == (engine == "llguidance")


@pytest.mark.parametrize("schema, words", [
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
     "cannot be enforced exactly: `uniqueItems` at /properties/tags (neither xgrammar nor llguidance enforces it)"),
    ({"$defs": {"x": {"type": "string", "pattern": "^(?!org\\.bukkit\\.)[a-z.]+$"}}, "$ref": "#/$defs/x"},
     "cannot be enforced exactly: `pattern` '^(?!org\\\\.bukkit\\\\.)[a-z.]+$' at /$defs/x"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]},
     "`oneOf` at / (its branches are not provably disjoint: xgrammar allows several); and llguidance refuses it: "
     "oneOf constraints are not supported"),
    ({"type": "object", "properties": {"a": {"if": {"const": 1}, "then": {"minimum": 0}}}}, "`if` at /properties/a"),
    ({"$ref": "https://example.com/schema.json"}, "`$ref` to 'https://example.com/schema.json' at /"),
    ({"type": "frob"}, 'does not compile: Unsupported type "frob"'),
    ({"$ref": "#"}, "does not compile: Circular $ref chain with no schema content"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "does not compile"),
])  # fmt: skip
def test_a_refusal_names_the_construct_and_its_place(schema, words):
    reason = problem(schema)
    assert reason is not None and words in reason, reason


def test_a_refusal_names_at_most_a_few_constructs():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "array", "uniqueItems": True} for i in range(5)}}
    assert problem(schema).endswith("; and 2 more")


def test_llguidance_messages_carry_their_place_as_a_pointer():
    error = ("oneOf constraints are not supported. Enable 'coerce_one_of' option to approximate oneOf with anyOf\n"
             "  while processing json-schema:///#/definitions/tasks")
    assert guidance_message(error) == "oneOf constraints are not supported (at /definitions/tasks)"


def test_json_schema_problem_asks_xgrammar_only_when_it_has_no_gap():
    asked = []
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    json_schema_problem(json.dumps(schema), lambda spec: asked.append(spec))
    assert asked == []


def test_over_real_world_schemas_every_refusal_is_needed_and_named():
    """Each accepted schema is enforced exactly by the engine the worker takes (no gap there); each refusal names
    a construct and its pointer, and neither engine could have taken the schema."""
    schemas = real_world_schemas()
    num_accepted = 0
    for name, schema in schemas.items():
        spec = json.dumps(schema)
        reason = _compile_error(StructuredKind.JSON_SCHEMA, spec)
        is_xgrammar_exact = not xgrammar_gaps(schema) and _xgrammar_error(StructuredKind.JSON_SCHEMA, spec) is None
        is_llguidance_exact = not llguidance_gaps(schema) and llguidance_problem(schema) is None
        if reason is None:
            num_accepted += 1
            assert json_schema_source(spec)[0] == (not is_xgrammar_exact), name
            assert is_xgrammar_exact or is_llguidance_exact, name
        else:
            assert reason.startswith(("cannot be enforced exactly: `", "does not compile: ")), (name, reason)
            assert "at /" in reason, (name, reason)  # (the place, as a JSON pointer)
            assert not is_xgrammar_exact and not is_llguidance_exact, (name, reason)
    assert 0 < num_accepted < len(schemas)


def test_a_structural_tags_schema_is_refused_where_xgrammar_would_approximate_it():
    def tag(schema: dict) -> str:
        content = {"type": "json_schema", "json_schema": schema}
        return json.dumps({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f>"], "tags": [
            {"type": "tag", "begin": "<f>", "end": "</f>", "content": content}]}})
    assert _compile_error(StructuredKind.STRUCTURAL_TAG, tag({"type": "object"})) is None
    reason = _compile_error(StructuredKind.STRUCTURAL_TAG, tag({"type": "array", "uniqueItems": True}))
    assert reason == ("cannot be enforced exactly: `uniqueItems` at /format/tags/0/content/json_schema "
                      "(xgrammar ignores it)")
