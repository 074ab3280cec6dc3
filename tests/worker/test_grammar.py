"""Structured outputs on the worker (worker/grammar.py): constrained greedy and sampled decoding through the model
runner, against xgrammar's own transformers logits processor, across recomputes, moves and multi-step decoding."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer
from xgrammar.contrib.hf import LogitsProcessor

from common.grammar import choice_grammar
from protos.segserve.v1.sampling import SamplingParams, StructuredKind, StructuredOutput
from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from protos.segserve.v1.tree import CandidateTree
from tests.worker.test_model_runner import make_runner, stock_attention
from worker.grammar import GrammarEngine, GrammarError, GrammarState
from worker.grammar_masks import GrammarMasks

EOS = 2  # the tiny models' tokenizer: <pad>, <bos>, <eos>
BLOCKS_PER_JOB = 40  # 160 tokens at block size 4
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                       "maximum": 120},
                   "ok": {"type": "boolean"}},
    "required": ["name", "age", "ok"],
}
JSON_SCHEMA = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))
REGEX = StructuredOutput(StructuredKind.REGEX, r"[0-9]{3}-[a-z]{2,5}")
CHOICES = ["yes", "no", 'maybe "so"']
CHOICE = StructuredOutput(StructuredKind.CHOICE, json.dumps(CHOICES))
MAX_NEW = 120


@pytest.fixture(scope="module")
def runner(tiny_gemma3_dir):
    return make_runner(tiny_gemma3_dir, num_kv_blocks=4 * BLOCKS_PER_JOB)


@pytest.fixture(scope="module")
def tokenizer(tiny_gemma3_dir):
    return AutoTokenizer.from_pretrained(tiny_gemma3_dir)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.encode('User: give me a record. Assistant: {"name": "Ada", "age": 36}')


@dataclass
class Job:
    """One sequence driven the way the scheduler drives it: its whole uncomputed tail, sampled at its end."""

    seq_id: str
    prompt: list[int]
    params: SamplingParams
    slot: int
    """Which BLOCKS_PER_JOB blocks it uses."""
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    is_new: bool = True
    max_new: int = MAX_NEW

    @property
    def is_done(self) -> bool:
        return len(self.output) >= self.max_new or (bool(self.output) and self.output[-1] == EOS)

    def work(self) -> ScheduledSequence:
        tokens = (self.prompt + self.output)[self.num_computed:]
        blocks = range(self.slot * BLOCKS_PER_JOB, (self.slot + 1) * BLOCKS_PER_JOB)
        return ScheduledSequence(self.seq_id, tokens, self.num_computed, tuple(blocks), (len(tokens) - 1,))


def step_jobs(runner, jobs: list[Job], num_steps: int = 1) -> dict[str, str]:
    """Step the jobs not done until each is; the errors by seq_id (a failed job stops)."""
    errors: dict[str, str] = {}
    while going := [j for j in jobs if not j.is_done and j.seq_id not in errors]:
        new = [NewSequence(j.seq_id, j.params, len(j.prompt), tuple(j.prompt + j.output)) for j in going if j.is_new]
        works = [j.work() for j in going]
        steps = num_steps if all(len(w.token_ids) == 1 for w in works) else 1
        outputs = {o.seq_id: o for o in runner.step(StepRequest(works, new, num_steps=steps))}
        for job, work in zip(going, works):
            job.is_new = False
            out = outputs[job.seq_id]
            if out.error:
                errors[job.seq_id] = out.error
                continue
            assert len(out.token_ids) == steps
            job.num_computed += len(work.token_ids) + steps - 1
            for token in out.token_ids:
                if not job.is_done:
                    job.output.append(token)
    return errors


def finish(runner, jobs: list[Job]) -> None:
    runner.step(StepRequest(finished_seq_ids=[j.seq_id for j in jobs]))


def decode(runner, prompt: list[int], params: SamplingParams, num_steps: int = 1, max_new: int = MAX_NEW
           ) -> list[int]:
    job = Job("solo", prompt, params, 0, max_new=max_new)
    assert step_jobs(runner, [job], num_steps) == {}
    finish(runner, [job])
    return job.output


def text_of(tokenizer, output: list[int]) -> str:
    assert output[-1] == EOS, f"no EOS within {MAX_NEW} tokens: {output}"
    return tokenizer.decode(output[:-1])


def constrained(structured: StructuredOutput, **fields) -> SamplingParams:
    return SamplingParams(structured_output=structured, **fields)


def test_json_schema_greedy_parses_and_validates(runner, tokenizer, prompt):
    text = text_of(tokenizer, decode(runner, prompt, constrained(JSON_SCHEMA)))
    jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_and_choice_constrain_greedy_output(runner, tokenizer, prompt):
    assert re.fullmatch(REGEX.spec, text_of(tokenizer, decode(runner, prompt, constrained(REGEX))))
    assert text_of(tokenizer, decode(runner, prompt, constrained(CHOICE))) in CHOICES


def test_json_object_and_ebnf_grammar(runner, tokenizer, prompt):
    # JSON_OBJECT: any object; the random model may not close it within MAX_NEW tokens, so check a short one
    grammar = StructuredOutput(StructuredKind.GRAMMAR, 'root ::= "(" [a-c]+ ")" | "none"')
    assert re.fullmatch(r"\([a-c]+\)|none", text_of(tokenizer, decode(runner, prompt, constrained(grammar))))
    output = decode(runner, prompt, constrained(StructuredOutput(StructuredKind.JSON_OBJECT)), max_new=40)
    text = tokenizer.decode([t for t in output if t != EOS])
    assert text.startswith("{")
    if output[-1] == EOS:
        assert isinstance(json.loads(text), dict)


def test_sampled_rows_draw_only_allowed_tokens(runner, tokenizer, prompt):
    for seed in range(4):
        params = constrained(CHOICE, do_sample=True, temperature=1.5, seed=seed, repetition_penalty=1.3,
                             logit_bias={5: 50.0})
        assert text_of(tokenizer, decode(runner, prompt, params)) in CHOICES


@pytest.mark.parametrize("structured", [JSON_SCHEMA, REGEX, CHOICE], ids=["json_schema", "regex", "choice"])
def test_greedy_equals_transformers_with_xgrammar_processor(runner, prompt, structured):
    got = decode(runner, prompt, constrained(structured))
    processor = LogitsProcessor(runner.grammars.compile(structured))
    with stock_attention(runner.model) as model, torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=MAX_NEW,
                             logits_processor=[processor], eos_token_id=EOS, pad_token_id=0)
    assert got == out[0, len(prompt):].tolist()


def test_unconstrained_neighbour_is_unaffected(runner, prompt):
    alone = decode(runner, prompt, SamplingParams(), max_new=30)
    jobs = [Job("free", prompt, SamplingParams(), 0, max_new=30), Job("json", prompt, constrained(JSON_SCHEMA), 1)]
    assert step_jobs(runner, jobs) == {}
    finish(runner, jobs)
    assert jobs[0].output == alone
    assert jobs[1].output == decode(runner, prompt, constrained(JSON_SCHEMA))


@pytest.mark.parametrize("num_steps", [3, 8])
def test_multi_step_decoding_advances_the_grammar(runner, prompt, num_steps):
    params = constrained(JSON_SCHEMA)
    assert decode(runner, prompt, params, num_steps=num_steps) == decode(runner, prompt, params)


def test_recompute_and_move_continue_the_grammar(runner, prompt):
    params = constrained(JSON_SCHEMA)
    whole = decode(runner, prompt, params)
    assert len(whole) > 12
    # preempted after 10 tokens, recomputed from 0 on the same worker (not re-announced)
    job = Job("preempted", prompt, params, 0, max_new=10)
    assert step_jobs(runner, [job]) == {}
    job.num_computed, job.max_new = 0, MAX_NEW
    assert step_jobs(runner, [job]) == {}
    assert job.output == whole
    # recomputed with its last 4 tokens dropped (as a scheduler drops tokens it did not keep): the matcher replays
    job = Job("rewound", prompt, params, 1, max_new=10)
    assert step_jobs(runner, [job]) == {}
    job.output, job.num_computed, job.max_new = job.output[:6], 0, MAX_NEW
    assert step_jobs(runner, [job]) == {}
    assert job.output == whole
    # moved to this worker after 10 tokens: its NewSequence carries them after the prompt
    moved = Job("moved", prompt, params, 2, output=whole[:10])
    assert step_jobs(runner, [moved]) == {}
    assert moved.output == whole
    finish(runner, [job, moved])


def test_a_spec_that_does_not_compile_fails_its_sequence_alone(runner, prompt):
    alone = decode(runner, prompt, SamplingParams(), max_new=5)
    bad = StructuredOutput(StructuredKind.REGEX, "([a-z]")
    jobs = [Job("bad", prompt, constrained(bad), 0), Job("fine", prompt, SamplingParams(), 1, max_new=5)]
    errors = step_jobs(runner, jobs)
    finish(runner, jobs)
    assert set(errors) == {"bad"} and "does not compile" in errors["bad"] and "'bad'" in errors["bad"]
    assert jobs[1].output == alone


@pytest.mark.parametrize("is_sampled", [False, True])
def test_a_grammar_that_allows_no_token_fails_its_sequence_and_draws_nothing(runner, prompt, is_sampled):
    # the router refuses a grammar that matches no text; one that reaches the worker must not yield a token
    alone = decode(runner, prompt, SamplingParams(), max_new=5)
    endless = StructuredOutput(StructuredKind.GRAMMAR, "root ::= root")
    sampling = constrained(endless, do_sample=is_sampled, seed=3) if is_sampled else constrained(endless)
    jobs = [Job("endless", prompt, sampling, 0), Job("fine", prompt, SamplingParams(), 1, max_new=5)]
    errors = step_jobs(runner, jobs)
    finish(runner, jobs)
    assert set(errors) == {"endless"} and "allows no token of this model here" in errors["endless"]
    assert jobs[0].output == [] and jobs[1].output == alone


def test_no_span_is_forced_from_inside_a_multi_byte_character(runner, tokenizer):
    engine: GrammarEngine = runner.grammars
    state = engine.start(StructuredOutput(StructuredKind.JSON_SCHEMA, '{"const": "東京"}'))
    first_byte = tokenizer.convert_tokens_to_ids("æ")  # the byte-level token of 0xE6, 東's first byte
    assert state.sync(tokenizer.encode('"', add_special_tokens=False) + [first_byte]) is None
    assert engine.forced_tokens(state) == ()  # the matcher's jump-forward text would start mid-character
    whole = engine.start(StructuredOutput(StructuredKind.JSON_SCHEMA, '{"const": "東京"}'))
    assert whole.sync([]) is None and tokenizer.decode(engine.forced_tokens(whole)) == '"東京"'


def test_after_its_stop_token_the_matcher_allows_only_stop_tokens(runner, tokenizer):
    engine: GrammarEngine = runner.grammars
    state = engine.start(CHOICE)
    output = tokenizer.encode("yes") + [EOS, EOS]
    assert state.sync(output) is None and state.matcher.is_terminated()
    masks = GrammarMasks(engine.vocab_size, torch.device("cpu"))
    bitmask = masks.rows(1)
    state.fill(bitmask, 0)
    logits = torch.zeros(1, engine.vocab_size)
    masks.apply(logits, [0], bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]
    assert engine.start(CHOICE).sync(tokenizer.encode("nope")) is not None  # a token the grammar refuses


def test_masks_match_xgrammars_kernel_and_leave_other_rows(runner, tokenizer):
    engine: GrammarEngine = runner.grammars
    states: list[GrammarState] = [engine.start(REGEX), engine.start(JSON_SCHEMA), engine.start(CHOICE)]
    states[1].sync(tokenizer.encode('{"name": "A'))
    rows = [4, 1, 2]  # a run of two rows and one alone
    logits = torch.randn(5, engine.vocab_size)
    expected = logits.clone()
    bitmask = xgr.allocate_token_bitmask(5, engine.vocab_size)  # xgrammar's: bitmask row i masks logits row i
    for row, state in zip(rows, states):
        state.fill(bitmask, row)
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
    masks = GrammarMasks(engine.vocab_size, torch.device("cpu"))
    masks.rows(1)  # a smaller buffer first: rows() grows it
    ours = masks.rows(3)
    for j, state in enumerate(states):
        state.fill(ours, j)
    by_index = logits.clone()
    masks.apply(logits, rows, ours)  # the CPU's way
    masks.apply_by_index(by_index, rows, ours)  # a GPU's way
    assert torch.equal(logits, expected) and torch.equal(by_index, expected)
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[3]).all()
    half = torch.randn(5, engine.vocab_size).bfloat16()  # numpy has no bfloat16: xgrammar's kernel writes it
    expected = half.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
    masks.apply(half, rows, ours)
    assert torch.equal(half, expected)


def test_choice_grammar_escapes_every_choice(runner, tokenizer):
    choices = ['say "hi"', "back\\slash", "new\nline", "東京"]
    assert choice_grammar(choices).startswith('root ::= "say \\"hi\\"" | ')
    engine: GrammarEngine = runner.grammars
    structured = StructuredOutput(StructuredKind.CHOICE, json.dumps(choices))
    for choice in choices:
        state = engine.start(structured)
        assert state.sync(tokenizer.encode(choice) + [EOS]) is None and state.matcher.is_terminated()


def test_a_model_without_a_tokenizer_refuses_structured_outputs(tmp_path):
    state = GrammarEngine(tmp_path, 40, [0]).start(CHOICE)  # its compile fails on the engine's pool
    with pytest.raises(GrammarError, match="tokenizer"):
        state.sync([])
    assert "tokenizer" in state.compile_problem()


def test_steps_without_constrained_rows_do_no_grammar_work(runner, prompt, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("grammar work in an unconstrained step")

    monkeypatch.setattr("worker.model_runner.constrainer", refuse)
    monkeypatch.setattr("worker.grammar_masks.GrammarMasks.apply", refuse)
    monkeypatch.setattr("worker.grammar.GrammarState.walk", refuse)
    monkeypatch.setattr("worker.grammar.GrammarEngine.forced_tokens", refuse)
    assert len(decode(runner, prompt, SamplingParams(do_sample=True, seed=1), max_new=5)) == 5
