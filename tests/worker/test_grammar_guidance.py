"""JSON schemas that xgrammar would approximate, enforced by llguidance in the worker (worker/grammar_guidance.py):
constrained greedy and sampled decoding through the model runner, against transformers' generate under
llguidance's own matcher, multi-step, trees walked and pruned, and a step mixing both engines' rows."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch
import xgrammar as xgr

from protos.segserve.v1.sampling import SamplingParams, StructuredKind, StructuredOutput
from protos.segserve.v1.tree import ROOT, CandidateTree
from tests.worker.test_grammar import EOS, decode, prompt, runner, text_of, tokenizer  # noqa: F401
from tests.worker.test_model_runner import stock_attention
from worker.grammar import fill_rows, json_schema_source
from worker.grammar_guidance import GuidanceMatcher

SCHEMA = {"type": "object", "properties": {
    "code": {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 5},
    "n": {"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 7}]}}, "required": ["code", "n"],
    "additionalProperties": False}
"""xgrammar would drop the length beside the pattern and not intersect the allOf; llguidance enforces both. (It
allows the properties a schema does not forbid, where xgrammar allows none: this one forbids them.)"""
GUIDED = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))
PLAIN = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps({"type": "object", "properties": {
    "ok": {"type": "boolean"}}, "required": ["ok"]}))
MAX_NEW = 60


def test_the_schema_is_llguidances():
    assert json_schema_source(GUIDED.spec)[0] and not json_schema_source(PLAIN.spec)[0]


def test_greedy_output_validates_and_equals_transformers_under_llguidance(runner, tokenizer, prompt):
    got = decode(runner, prompt, SamplingParams(structured_output=GUIDED), max_new=MAX_NEW)
    jsonschema.validate(json.loads(text_of(tokenizer, got)), SCHEMA)
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=runner.model.config.vocab_size,
                                                                eos_token=EOS), json_schema_source(GUIDED.spec)[1])
    bitmask = xgr.allocate_token_bitmask(1, runner.model.config.vocab_size)

    def masked(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # [1, L], [1, V]
        if input_ids.shape[1] > len(prompt):
            assert matcher.consume_token(int(input_ids[0, -1]))
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
        xgr.apply_token_bitmask_inplace(scores, bitmask.to(scores.device))
        return scores

    with stock_attention(runner.model) as model, torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=MAX_NEW,
                             logits_processor=[masked], eos_token_id=EOS, pad_token_id=0)
    assert got == out[0, len(prompt):].tolist()


def test_sampled_outputs_validate(runner, tokenizer, prompt):
    for seed in range(3):
        params = SamplingParams(structured_output=GUIDED, do_sample=True, temperature=1.5, seed=seed)
        output = decode(runner, prompt, params, max_new=MAX_NEW)
        if output[-1] == EOS:  # (a random model may run out of tokens first)
            jsonschema.validate(json.loads(text_of(tokenizer, output)), SCHEMA)


def test_multi_step_decoding_advances_the_grammar(runner, prompt):
    params = SamplingParams(structured_output=GUIDED)
    assert decode(runner, prompt, params, num_steps=4, max_new=MAX_NEW) == decode(runner, prompt, params,
                                                                                  max_new=MAX_NEW)


def test_a_tree_walk_and_prune_leave_the_matcher_where_it_stood(runner, tokenizer):
    state = runner.grammars.start(GUIDED)
    assert isinstance(state.matcher, GuidanceMatcher)
    output = tokenizer.encode('{"code": "ab', add_special_tokens=False)
    assert state.sync(output) is None
    vocab = runner.model.config.vocab_size
    before = xgr.allocate_token_bitmask(1, vocab)
    state.fill(before, 0)
    good, bad = tokenizer.encode('c"', add_special_tokens=False), tokenizer.encode("1", add_special_tokens=False)
    tree = CandidateTree(tuple(good + bad), tuple([ROOT] + list(range(len(good) - 1)) + [ROOT]))
    pruned = state.prune(output[-1], tree)
    assert pruned.token_ids == tuple(good)
    after = xgr.allocate_token_bitmask(1, vocab)
    state.fill(after, 0)
    assert torch.equal(before, after)
    assert state.sync(output + [EOS]) is not None  # the string is open: no end here
    assert state.sync(output + tokenizer.encode('c", "n": 5}', add_special_tokens=False) + [EOS]) is None
    assert state.is_ended


def test_one_fill_masks_rows_of_both_engines(runner):
    states = [runner.grammars.start(GUIDED), runner.grammars.start(PLAIN)]
    for state in states:
        assert state.sync([]) is None
    vocab = runner.model.config.vocab_size
    bitmask = xgr.allocate_token_bitmask(3, vocab)
    fill_rows(states, bitmask, [2, 0])
    one = xgr.allocate_token_bitmask(1, vocab)
    for state, row in zip(states, [2, 0]):
        state.fill(one, 0)
        assert torch.equal(bitmask[row], one[0])


@pytest.mark.parametrize("text", ['{"code": "a", "n": 5}', '{"code": "abcdef", "n": 5}', '{"code": "ab", "n": 8}'])
def test_what_breaks_the_schema_is_refused(runner, tokenizer, text):
    state = runner.grammars.start(GUIDED)
    assert state.sync(tokenizer.encode(text, add_special_tokens=False) + [EOS]) is not None
