"""Grammar work off the step's critical path (worker/grammar_masks.py, worker/grammar.py): a step's masks are filled on
the runner's grammar thread while a long CPU forward runs (after a short one, on the step's thread), and a new
sequence's grammar compiles on the engine's pool from the moment it arrives, the step waiting for it only where its
first masked row needs it. Outputs stay exactly those of constrained decoding (tests/worker/test_grammar.py and
test_grammar_trees.py check them against xgrammar's own logits processor); these tests check the order of things
and that a failure stays with its sequence."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from protos.segserve.v1.sampling import SamplingParams, StructuredKind, StructuredOutput
from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from protos.segserve.v1.tree import CandidateTree
from tests.worker.test_grammar import (  # noqa: F401 (fixtures)
    CHOICE,
    CHOICES,
    JSON_SCHEMA,
    REGEX,
    Job,
    constrained,
    decode,
    finish,
    prompt,
    step_jobs,
    text_of,
    tokenizer,
)
from tests.worker.test_grammar_trees import KEYS, chain, tree_decode
from worker.grammar import GrammarError

WAIT_S = 20  # far beyond any step of the tiny model: a wait that long is a deadlock


@pytest.fixture(scope="module")
def runner(tiny_gemma3_dir):
    from tests.worker.test_model_runner import make_runner

    return make_runner(tiny_gemma3_dir, num_kv_blocks=160)


@pytest.fixture
def beside(runner, monkeypatch):
    """Every fill on the grammar thread, beside the forward, however short the forward (on the CPU)."""
    from worker import model_runner

    if runner.device.type != "cpu":
        pytest.skip("on a GPU the fill runs after the forward's launch, on the step's thread")
    monkeypatch.setattr(model_runner, "OVERLAP_MIN_FORWARD_S", 0.0)


def around_forward(runner, monkeypatch, before) -> None:
    """Call before() at the start of every forward of the runner (its graphs or its decode)."""
    if runner.path.graphs is not None:
        run = runner.path.graphs.run
        monkeypatch.setattr(runner.path.graphs, "run", lambda *args: (before(), run(*args))[1])
    decode = runner.path.decode
    around = dataclasses.replace(runner.path, decode=lambda *args: (before(), decode(*args))[1])
    monkeypatch.setattr(runner, "path", around)


def test_masks_are_filled_on_the_grammar_thread_while_the_forward_runs(runner, prompt, monkeypatch, beside):
    """The forward waits for the fill to have run: were the fill after the forward (or on the step's thread), the
    forward would wait in vain."""
    from worker import model_runner

    plain = decode(runner, prompt, constrained(JSON_SCHEMA), max_new=12)
    filled, threads, waits = threading.Event(), [], []
    fill_masks = model_runner.fill_masks

    def fill(*args):
        threads.append(threading.current_thread())
        result = fill_masks(*args)
        filled.set()
        return result

    def forward():
        waits.append(filled.wait(WAIT_S))
        filled.clear()

    monkeypatch.setattr(model_runner, "fill_masks", fill)
    around_forward(runner, monkeypatch, forward)
    assert decode(runner, prompt, constrained(JSON_SCHEMA), max_new=12) == plain
    assert len(threads) == 12 and all(waits) and len(waits) == 12
    assert all(thread is not threading.main_thread() and thread.name.startswith("grammar-masks")
               for thread in threads)


def test_a_slow_fill_is_waited_for_by_sampling_forced_spans_and_the_next_step(runner, prompt, monkeypatch, beside):
    """A fill still running when the forward ends: sampling waits for it, and so do the forced spans and the next
    step's pruning, which use the same matchers; the tokens are those of a quick fill."""
    from worker import model_runner

    params = constrained(KEYS)
    plain = decode(runner, prompt, params)
    fill_masks = model_runner.fill_masks

    def slow_fill(*args):
        time.sleep(0.02)  # the tiny model's forward takes about a millisecond
        return fill_masks(*args)

    monkeypatch.setattr(model_runner, "fill_masks", slow_fill)
    assert decode(runner, prompt, params) == plain
    output, per_step = tree_decode(runner, prompt, params, lambda out, forced: chain(forced), is_forcing=True)
    assert output == plain and max(per_step) > 1


def test_a_step_whose_forward_fails_waits_for_its_fill(runner, prompt, monkeypatch, beside):
    """The step raises only once its fill is done: the matchers are the next step's."""
    from worker import model_runner

    fill_masks, ended = model_runner.fill_masks, []

    def slow_fill(*args):
        time.sleep(0.05)
        result = fill_masks(*args)
        ended.append(True)
        return result

    def failing_forward():
        raise RuntimeError("the forward failed")

    blocks = tuple(range(40))
    work = ScheduledSequence("f", prompt, 0, blocks, (len(prompt) - 1,))
    with monkeypatch.context() as patch:
        patch.setattr(model_runner, "fill_masks", slow_fill)
        around_forward(runner, patch, failing_forward)
        with pytest.raises(RuntimeError, match="the forward failed"):
            runner.step(StepRequest([work], [NewSequence("f", constrained(CHOICE), len(prompt))]))
        assert ended == [True]  # at once: the step waited for its fill
    (out,) = runner.step(StepRequest([work]))
    runner.step(StepRequest(finished_seq_ids=["f"]))
    assert not out.error and out.token_ids == tuple(decode(runner, prompt, constrained(CHOICE), max_new=1))


def test_after_a_short_forward_the_fill_runs_on_the_steps_thread(runner, prompt, monkeypatch):
    """A forward too short to hide a fill (OVERLAP_MIN_FORWARD_S) is followed by it, on the step's thread; one that
    took longer has the next step's fill beside it, on the grammar thread."""
    from worker import model_runner

    plain = decode(runner, prompt, constrained(JSON_SCHEMA), max_new=6)
    events, fill_masks = [], model_runner.fill_masks

    def fill(*args):
        events.append(("fill", threading.current_thread() is threading.main_thread()))
        return fill_masks(*args)

    slow = []

    def forward():
        if slow:  # 20 ms: every fill after the first step's goes beside the forward
            time.sleep(0.02)
        events.append(("forward", True))

    monkeypatch.setattr(model_runner, "fill_masks", fill)
    around_forward(runner, monkeypatch, forward)
    with monkeypatch.context() as patch:
        patch.setattr(model_runner, "OVERLAP_MIN_FORWARD_S", float("inf"))
        assert decode(runner, prompt, constrained(JSON_SCHEMA), max_new=6) == plain
    assert events == [("forward", True), ("fill", True)] * 6
    if runner.device.type != "cpu":
        return
    events.clear()
    slow.append(True)
    assert decode(runner, prompt, constrained(JSON_SCHEMA), max_new=6) == plain
    assert events[2:] == [("fill", False), ("forward", True)] * 5


def test_steps_without_constrained_rows_start_no_fill(runner, prompt, monkeypatch, beside):
    def refuse(*args, **kwargs):
        raise AssertionError("a fill started for a step without constrained rows")

    monkeypatch.setattr(runner._grammar_thread, "submit", refuse)
    assert len(decode(runner, prompt, SamplingParams(do_sample=True, seed=1), max_new=5)) == 5


class HeldCompiles:
    """The runner's grammar compiles, held until release(); counts them by spec."""

    def __init__(self, runner, monkeypatch):
        self.released, self.started, self.specs = threading.Event(), threading.Event(), []
        compile = runner.grammars.compile

        def held(structured):
            self.specs.append(structured.spec)
            self.started.set()
            assert self.released.wait(WAIT_S), "the compile was never released"
            return compile(structured)

        monkeypatch.setattr(runner.grammars, "compile", held)

    def release(self) -> None:
        self.released.set()


def test_a_compile_runs_during_the_prefill_and_is_waited_for_at_the_first_masked_row(runner, prompt, monkeypatch):
    """A constrained sequence's prefill runs in chunks while its grammar compiles: the unsampled chunk does not wait
    for it, and the step that samples its first token waits, off the critical path, and masks it correctly."""
    params = constrained(REGEX)
    plain = decode(runner, prompt, params)
    held = HeldCompiles(runner, monkeypatch)
    compiling = []

    def before():  # the first forward (the unsampled chunk) leaves the compile held, the next one releases it
        compiling.append(not held.released.is_set())
        if len(compiling) > 1:
            held.release()

    around_forward(runner, monkeypatch, before)
    blocks, half = tuple(range(40)), len(prompt) // 2
    first = runner.step(StepRequest([ScheduledSequence("c", prompt[:half], 0, blocks, ())],
                                    [NewSequence("c", params, len(prompt))]))
    assert first == [] and compiling == [True]  # the first chunk ran, and its step ended, with the compile held
    assert held.started.wait(WAIT_S)
    job = Job("c", prompt, params, 0, num_computed=half, is_new=False)
    assert step_jobs(runner, [job]) == {}
    finish(runner, [job])
    assert compiling[:2] == [True, True]  # the sampled step's forward started with the compile still held
    assert job.output == plain and held.specs == [REGEX.spec]


def test_sequences_with_the_same_spec_share_one_compile(runner, prompt, monkeypatch):
    spec = StructuredOutput(StructuredKind.REGEX, "[0-4]{2}-[a-e]{1,3}")
    plain = decode(runner, prompt, constrained(spec), max_new=4)
    held = HeldCompiles(runner, monkeypatch)
    around_forward(runner, monkeypatch, held.release)  # held through the first step's planning
    early = runner.grammars.start(spec)  # a compile started before the sequences arrive
    jobs = [Job(f"s{k}", prompt, constrained(spec), k, max_new=4) for k in range(3)]
    assert step_jobs(runner, jobs) == {}
    finish(runner, jobs)
    assert held.specs == [spec.spec]
    assert all(job.output == plain for job in jobs) and early.sync(plain) is None


@pytest.mark.parametrize("is_compiled_first", [False, True], ids=["compiling-in-the-step", "compiled-before"])
def test_a_compile_error_fails_only_its_sequence_with_the_same_message(runner, prompt, monkeypatch,
                                                                       is_compiled_first):
    """The error of a compile still running when the sequence's sampled step starts comes from the fill (the work ran
    in the forward); one that ended before keeps the work out of the forward. Either way: the compile's message,
    for that sequence alone."""
    bad = StructuredOutput(StructuredKind.REGEX, "([a-z]")
    with pytest.raises(GrammarError) as raised:
        runner.grammars.compile(bad)
    alone = decode(runner, prompt, constrained(CHOICE), max_new=1)
    held = HeldCompiles(runner, monkeypatch)
    forwarded = []
    execute = runner.execute

    def spy(plan):
        forwarded.append({work.seq_id for work in plan.works})
        return execute(plan)

    monkeypatch.setattr(runner, "execute", spy)
    half = len(prompt) // 2
    assert runner.step(StepRequest([ScheduledSequence("bad", prompt[:half], 0, tuple(range(40)), ())],
                                   [NewSequence("bad", constrained(bad), len(prompt))])) == []
    if is_compiled_first:
        held.release()
        grammar, deadline = runner._states["bad"].grammar, time.monotonic() + WAIT_S
        while grammar.compile_problem() is None and time.monotonic() < deadline:
            time.sleep(0.005)
    else:
        around_forward(runner, monkeypatch, held.release)
    outputs = runner.step(StepRequest([ScheduledSequence("bad", prompt[half:], half, tuple(range(40)),
                                                         (len(prompt) - half - 1,)),
                                       ScheduledSequence("fine", prompt, 0, tuple(range(40, 80)),
                                                         (len(prompt) - 1,))],
                                      [NewSequence("fine", constrained(CHOICE), len(prompt))]))
    ran = forwarded[-1]
    runner.step(StepRequest(finished_seq_ids=["bad", "fine"]))
    errors = {out.seq_id: out.error for out in outputs}
    assert errors == {"bad": f"sequence 'bad': {raised.value}", "fine": ""}
    assert outputs[1].token_ids == tuple(alone)
    assert ran == ({"fine"} if is_compiled_first else {"bad", "fine"})


def test_an_output_that_breaks_its_grammar_fails_its_sequence_alone(runner, tokenizer, prompt):
    """A sequence moved here with an output its grammar refuses fails in the fill; its neighbour is unaffected."""
    alone = decode(runner, prompt, constrained(CHOICE))
    jobs = [Job("broken", prompt, constrained(CHOICE), 0, output=tokenizer.encode("nope")),
            Job("fine", prompt, constrained(CHOICE), 1)]
    errors = step_jobs(runner, jobs)
    finish(runner, jobs)
    assert set(errors) == {"broken"} and "does not match its structured_output" in errors["broken"]
    assert jobs[1].output == alone and text_of(tokenizer, alone) in CHOICES


def test_is_ended_follows_the_matchers_termination_through_syncs_and_walks(runner, tokenizer):
    """GrammarState.is_ended stands for xgrammar's is_terminated() (not called per row: each call hands the GIL
    over): after syncs, replays, and at every node of a walk, stop tokens inside the tree included."""
    from tests.worker.test_grammar import EOS

    state = runner.grammars.start(CHOICE)
    yes, no = tokenizer.encode("yes"), tokenizer.encode("no")
    checked = []

    def agrees(node=None):
        checked.append(node)
        assert state.is_ended is state.matcher.is_terminated(), node

    for output in ([], yes[:1], yes, yes + [EOS], yes + [EOS, EOS], no, no + [EOS]):
        assert state.sync(output) is None
        agrees()
    assert state.sync(yes[:-1]) is None and not state.is_ended
    # the root's next token ends "yes", then EOS (the grammar ends), then EOS again or a refused token
    token_ids = (yes[-2], yes[-1], EOS, EOS, yes[0], no[0], EOS)
    parents = (-1, 0, 1, 2, 2, 0, 1)
    allowed = state.walk(token_ids, parents, agrees)
    assert allowed == [True, True, True, True, False, False, True]
    assert checked[-5:] == [0, 1, 2, 3, 6]
    agrees()
    assert not state.is_ended and state.sync(yes + [EOS]) is None and state.is_ended


def test_trees_past_the_grammars_end_are_masked_on_the_grammar_thread(runner, tokenizer, prompt, monkeypatch):
    """Nodes after the stop token (only stop tokens are allowed there) get their rows written on the grammar
    thread, outside the step's inference mode, into the runner's reused bitmask (made by a step's own thread)."""
    from tests.worker.test_grammar import EOS
    from worker import model_runner

    params = constrained(CHOICE)
    plain = decode(runner, prompt, params)
    assert plain[-1] == EOS

    def past_the_end(output, forced):  # the right rest of the output, then EOS twice more
        return chain(plain[len(output):] + [EOS, EOS]) if len(output) < len(plain) else CandidateTree()

    monkeypatch.setattr(model_runner, "OVERLAP_MIN_FORWARD_S", float("inf"))  # filled on the step's thread
    assert tree_decode(runner, prompt, params, past_the_end)[0] == plain
    monkeypatch.setattr(model_runner, "OVERLAP_MIN_FORWARD_S", 0.0)  # beside the forward, in the same bitmask
    assert tree_decode(runner, prompt, params, past_the_end)[0] == plain
