"""Speculation under a grammar on the worker: a constrained sequence's candidate tree is cut to what its grammar allows
before the forward, every remaining node is verified against the constrained distribution (its own mask), and the
span the grammar forces comes back with each answer as a free draft.

Greedy trees must give exactly the tokens of plain constrained greedy decoding (itself equal to transformers with
xgrammar's logits processor, tests/worker/test_grammar.py), and seeded sampling with trees exactly the tokens of
plain seeded constrained sampling (one uniform per output token, as tests/worker/test_verify_sampling.py checks
without a grammar), every one of them allowed.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from xgrammar.contrib.hf import LogitsProcessor

from protos.segserve.v1.sampling import SamplingParams, StructuredKind, StructuredOutput
from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from protos.segserve.v1.step_result import MAX_FORCED_TOKENS
from protos.segserve.v1.tree import ROOT, CandidateTree
from tests.worker.test_grammar import (  # noqa: F401 (fixtures)
    CHOICE,
    CHOICES,
    EOS,
    JSON_SCHEMA,
    MAX_NEW,
    REGEX,
    SCHEMA,
    constrained,
    decode,
    prompt,
    tokenizer,
)
from tests.worker.test_model_runner import make_runner, stock_attention
from tests.worker.test_verify import oracle_tree, random_tree
from worker.grammar import GrammarEngine

BLOCKS = 40  # 160 tokens at block size 4, per sequence
KEYS_SCHEMA = {  # long fixed keys: their text is forced, the values are the model's
    "type": "object", "additionalProperties": False,
    "required": ["zebra_quux_identifier", "kind_of_the_record", "is_valid_flag"],
    "properties": {"zebra_quux_identifier": {"type": "integer", "minimum": 0, "maximum": 99},
                   "kind_of_the_record": {"enum": ["alpha_primary_kind", "beta_secondary_kind"]},
                   "is_valid_flag": {"type": "boolean"}},
}
KEYS = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(KEYS_SCHEMA))
GRAMMARS = {"json_schema": JSON_SCHEMA, "regex": REGEX, "choice": CHOICE, "keys": KEYS}


@pytest.fixture(scope="module")
def runner(tiny_gemma3_dir):
    return make_runner(tiny_gemma3_dir, num_kv_blocks=2 * BLOCKS)


def tree_decode(runner, prompt: list[int], params: SamplingParams, propose, max_new: int = MAX_NEW,
                is_forcing: bool = False) -> tuple[list[int], list[int]]:
    """Prefill prompt[:-1], then one step per turn rooted at the last token, carrying propose(output, the forced
    span of the last answer) as its tree (a plain step when it is empty); (output up to EOS or max_new, tokens
    per step)."""
    blocks = tuple(range(BLOCKS))
    runner.step(StepRequest([ScheduledSequence("t", prompt[:-1], 0, blocks)],
                            [NewSequence("t", params, len(prompt), (), is_forcing)]))
    output: list[int] = []
    per_step: list[int] = []
    forced: tuple[int, ...] = ()
    while len(output) < max_new and EOS not in output:
        tree = propose(output, forced)
        work = ScheduledSequence("t", ((prompt + output)[-1],), len(prompt) - 1 + len(output), blocks,
                                 () if tree else (0,), tree or None)
        (out,) = runner.step(StepRequest([work]))
        assert not out.error, out.error
        assert tree or len(out.token_ids) == 1
        output += out.token_ids
        per_step.append(len(out.token_ids))
        forced = out.forced_token_ids
    runner.step(StepRequest(finished_seq_ids=["t"]))
    output = output[:max_new]
    return output[:output.index(EOS) + 1] if EOS in output else output, per_step


def tree_works(runner, monkeypatch) -> list:
    """The tree works the runner's forward is given from now on (in this test), as it is given them."""
    given = []
    execute = runner.execute

    def spy(plan):
        given.extend(work for work in plan.works if work.is_tree)
        return execute(plan)

    monkeypatch.setattr(runner, "execute", spy)
    return given


def chain(token_ids) -> CandidateTree:
    return CandidateTree(tuple(token_ids), (ROOT, *range(len(token_ids) - 1)))


def test_nodes_the_grammar_forbids_are_pruned_before_the_forward(runner, tokenizer, prompt, monkeypatch):
    y, e, s = tokenizer.encode("yes")
    n = tokenizer.encode("no")[0]
    x = tokenizer.encode("x")[0]
    # root children: y (allowed), x (forbidden, with a child), n (allowed); under y: x (forbidden), e, then s
    tree = CandidateTree((y, x, y, n, x, e, s), (ROOT, ROOT, 1, ROOT, 0, 0, 5))
    params = constrained(CHOICE)
    greedy = decode(runner, prompt, params, max_new=1)
    given = tree_works(runner, monkeypatch)
    output, _ = tree_decode(runner, prompt, params, lambda out, forced: tree if not out else CandidateTree(),
                            max_new=1)
    assert output == greedy
    (work,) = given
    assert work.token_ids == (prompt[-1], y, n, e, s) and work.node_parents == (-1, 0, 0, 1, 3)
    assert len(work.sample_indices) == 5  # the forward and the sampler see 5 rows, not 8


def test_a_tree_the_grammar_forbids_whole_leaves_its_root(runner, tokenizer, prompt, monkeypatch):
    x, q = tokenizer.encode("x")[0], tokenizer.encode("q")[0]
    params = constrained(CHOICE)
    greedy = decode(runner, prompt, params, max_new=4)
    given = tree_works(runner, monkeypatch)
    output, per_step = tree_decode(runner, prompt, params, lambda out, forced: CandidateTree((x, q), (ROOT, 0)),
                                   max_new=4)
    assert output == greedy and per_step == [1] * len(greedy)
    assert given == []  # each step is the root alone: a plain step


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_greedy_trees_give_exactly_constrained_greedy(runner, prompt, name):
    structured = GRAMMARS[name]
    params = constrained(structured)
    plain = decode(runner, prompt, params)
    processor = LogitsProcessor(runner.grammars.compile(structured))
    with stock_attention(runner.model) as model, torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=MAX_NEW,
                             logits_processor=[processor], eos_token_id=EOS, pad_token_id=0)
    assert plain == out[0, len(prompt):].tolist()
    rng = random.Random(name)
    vocab = runner.grammars.vocab_size

    def oracle(output, forced):  # the right continuation after wrong siblings (mostly forbidden)
        return oracle_tree(plain[len(output):len(output) + 4], vocab) if len(output) < len(plain) else CandidateTree()

    def mixed(output, forced):  # random nodes, and the right next two tokens on every other step
        right = plain[len(output):len(output) + 2] if len(output) % 2 == 0 else []
        junk = random_tree(rng, vocab, 6)
        return CandidateTree(tuple(right) + junk.token_ids,
                             (ROOT, 0)[:len(right)] + tuple(p if p < 0 else p + len(right) for p in junk.parents))

    for propose in (oracle, mixed, lambda output, forced: chain(forced)):
        output, per_step = tree_decode(runner, prompt, params, propose, is_forcing=True)
        assert output == plain, (name, propose)
        if propose is oracle:
            assert len(per_step) < len(plain) / 2  # the right nodes survived the pruning


def test_forced_spans_come_with_the_answer_and_are_accepted(runner, tokenizer, prompt):
    """A schema of long fixed keys: with no drafter at all, the spans its grammar forces are drafted and mostly
    accepted, and the output is still exactly plain constrained greedy's."""
    params = constrained(KEYS)
    plain = decode(runner, prompt, params)
    output, per_step = tree_decode(runner, prompt, params, lambda out, forced: chain(forced), is_forcing=True)
    assert output == plain
    jsonschema.validate(json.loads(tokenizer.decode(output[:-1])), KEYS_SCHEMA)
    assert len(per_step) <= len(plain) / 2 and max(per_step) > 8


def test_the_first_answer_carries_the_forced_span_only_when_asked(runner, tokenizer, prompt):
    blocks = tuple(range(BLOCKS))
    outputs = {}
    for is_forcing in (True, False):
        seq = ScheduledSequence("f", prompt, 0, blocks, (len(prompt) - 1,))
        (out,) = runner.step(StepRequest([seq], [NewSequence("f", constrained(KEYS), len(prompt), (), is_forcing)]))
        runner.step(StepRequest(finished_seq_ids=["f"]))
        outputs[is_forcing] = out
    first = outputs[True].token_ids[0]
    text = tokenizer.decode([first, *outputs[True].forced_token_ids])
    assert '{"zebra_quux_identifier": '.startswith(text) and len(outputs[True].forced_token_ids) >= 8
    assert outputs[False].forced_token_ids == () and outputs[False].token_ids == outputs[True].token_ids


def test_forced_tokens_stop_where_the_grammar_leaves_a_choice(runner, tokenizer):
    engine: GrammarEngine = runner.grammars
    state = engine.start(KEYS)
    first = engine.forced_tokens(state)
    assert '{"zebra_quux_identifier": '.startswith(tokenizer.decode(first)) and len(first) == MAX_FORCED_TOKENS
    assert state.sync(tokenizer.encode('{"zebra_quux_identifier": ')) is None
    assert engine.forced_tokens(state) == ()  # an integer comes next: the model's choice
    assert state.sync(tokenizer.encode('{"zebra_quux_identifier": 12, "kind_of_the_record": "b')) is None
    assert tokenizer.decode(engine.forced_tokens(state)).startswith("eta_secondary_kind")  # the rest of the enum
    assert state.sync(tokenizer.encode('{"zebra_quux_identifier": 12, "kind_of_the_record": "')) is None
    assert engine.forced_tokens(state) == ()  # alpha or beta
    long_const = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps({"const": "x" * 1000}))
    assert len(engine.forced_tokens(engine.start(long_const))) == MAX_FORCED_TOKENS


SEEDS = range(12)


@pytest.mark.parametrize("structured", [JSON_SCHEMA, CHOICE], ids=["json_schema", "choice"])
def test_seeded_sampling_with_trees_gives_exactly_the_plain_constrained_tokens(runner, tokenizer, prompt,
                                                                                structured):
    """The seeded coupling of verify sampling (one uniform per output token, drawn in order) under a grammar: the
    trees hold the plain output's next tokens after a sibling (allowed or not), the forced span and random nodes,
    and every seed gives token for token what plain seeded constrained sampling gives."""
    vocab = runner.grammars.vocab_size
    for seed in SEEDS:
        params = constrained(structured, do_sample=True, temperature=1.3, top_k=60, repetition_penalty=1.2,
                             seed=seed)
        plain = decode(runner, prompt, params)
        rng = random.Random(seed)

        def propose(output, forced, plain=plain, rng=rng):
            upcoming = plain[len(output):len(output) + 3]
            if not upcoming:
                return CandidateTree()
            sibling = (upcoming[0] + 1) % vocab
            junk = random_tree(rng, vocab, 3)
            token_ids = (sibling, *upcoming) + forced + junk.token_ids
            parents = (ROOT, ROOT, *range(1, len(upcoming)))
            parents += (ROOT, *range(len(parents), len(parents) + len(forced) - 1))[:len(forced)]
            parents += tuple(p if p < 0 else p + len(parents) for p in junk.parents)
            return CandidateTree(token_ids, parents)

        output, per_step = tree_decode(runner, prompt, params, propose, is_forcing=True)
        assert output == plain, seed
        assert len(per_step) < len(plain)
        assert output[-1] == EOS  # every token allowed: a complete answer, whose text matches
        if structured is CHOICE:
            assert tokenizer.decode(output[:-1]) in CHOICES
        else:
            # strict=False: the random model's strings hold raw control characters, which plain decoding lets
            # through as well (the same tokens)
            jsonschema.validate(json.loads(tokenizer.decode(output[:-1]), strict=False), SCHEMA)


def test_steps_with_unconstrained_trees_do_no_grammar_work(runner, prompt, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("grammar work in an unconstrained step")

    monkeypatch.setattr("worker.model_runner.constrainer", refuse)
    monkeypatch.setattr("worker.grammar.GrammarState.walk", refuse)
    monkeypatch.setattr("worker.grammar.GrammarState.sync", refuse)
    monkeypatch.setattr("worker.grammar.GrammarEngine.forced_tokens", refuse)
    params = SamplingParams(do_sample=True, seed=3)
    plain = decode(runner, prompt, params, max_new=12)
    rng = random.Random(0)
    output, _ = tree_decode(runner, prompt, params, lambda out, forced: random_tree(rng, 400, 5), max_new=12)
    assert output == plain
