"""The contract's shape check of a structural tag: the engine's form, {"type": "structural_tag", "format": ...},
as JSON text; the older `structures` + `triggers` form is the API edge's to map (common/grammar.py)."""

from __future__ import annotations

import json

import pytest

from common.grammar import structural_tag
from protos.segserve.v1.sampling import InvalidParameter, SamplingParams, StructuredKind, StructuredOutput, validate

FORMAT = {"type": "triggered_tags", "triggers": ["<f>"],
          "tags": [{"type": "tag", "begin": "<f>", "end": "</f>", "content": {"type": "json_schema",
                                                                                "json_schema": {"type": "object"}}}]}


def _sampling(spec: str) -> SamplingParams:
    return SamplingParams(structured_output=StructuredOutput(StructuredKind.STRUCTURAL_TAG, spec))


def test_the_engines_form_passes_and_round_trips_the_wire():
    sampling = _sampling(json.dumps({"type": "structural_tag", "format": FORMAT}))
    validate(sampling)
    assert StructuredOutput.from_pb(sampling.structured_output.to_pb()) == sampling.structured_output


@pytest.mark.parametrize("spec, words", [
    ("", "needs a spec"),
    ("{oops", "not JSON"),
    (json.dumps(["structural_tag"]), "must be an object"),
    (json.dumps({"format": FORMAT}), "must be an object"),
    (json.dumps({"type": "structural_tag", "structures": []}), "must be an object"),
])  # fmt: skip
def test_other_shapes_are_refused_naming_the_field(spec, words):
    with pytest.raises(InvalidParameter) as refused:
        validate(_sampling(spec))
    assert refused.value.field == "structured_output" and words in refused.value.message


def test_the_older_form_maps_onto_triggered_tags():
    older = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}
    assert structural_tag(older) == {"type": "structural_tag", "format": FORMAT}
    assert structural_tag({"format": FORMAT, "extra": 1}) == {"type": "structural_tag", "format": FORMAT}
    for broken in ({}, {"structures": older["structures"]}, {**older, "triggers": [""]}, {"format": []}):
        with pytest.raises(ValueError):
            structural_tag(broken)
