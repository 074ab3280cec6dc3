"""Pure scheduler tests: no model, no network. tests/support/fakes.py's FakeWorker plays the model.

The fake model's rule is next token = (last token + 1) % VOCAB, so every
expected output is known in advance; the fake also keeps each sequence's
"KV cache" and checks the scheduler's accounting the way a real worker would.
"""

from __future__ import annotations

import pytest

from protos.segserve.v1.generate import FinishReason, GenerateComplete, TokenChunk
from protos.segserve.v1.sampling import InvalidParameter, SamplingParams, StoppingCriteria
from protos.segserve.v1.step import StepRequest
from protos.segserve.v1.step_result import SequenceOutput, StepResult
from protos.segserve.v1.tree import CandidateTree
from scheduler.outputs import RequestEvent
from scheduler.scheduler import RequestRejected, Scheduler
from scheduler.sequence import Sequence
from tests.support.fakes import FakeWorker, InjectedFailure, increment, prompt_logprob

VOCAB = 100
EOS = 99


def make_scheduler(**overrides) -> Scheduler:
    args = dict(num_kv_blocks=64, block_size=4, max_model_len=512, eos_token_ids=[EOS], max_num_seqs=8,
                max_num_batched_tokens=64,
                is_block_table_delta=True)  # as for the real worker (and the fake, which offers them)
    args.update(overrides)
    return Scheduler(**args)


def make_seq(request_id: str, prompt: list[int], max_tokens: int = 4, sampling: SamplingParams | None = None,
             **stopping) -> Sequence:
    return Sequence(request_id, prompt, sampling or SamplingParams(), StoppingCriteria(max_tokens, **stopping))


def make_worker(block_size: int = 4) -> FakeWorker:
    return FakeWorker(increment(VOCAB), VOCAB, [EOS], block_size=block_size)


def expected_output(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + 1 + i) % VOCAB for i in range(n)]


def collect_events(events: list[RequestEvent], results: dict) -> None:
    """Accumulate {request_id: (tokens, finish reason)} from a step's events."""
    for item in events:
        tokens, reason = results.get(item.request_id, ([], None))
        if isinstance(item.event, TokenChunk):
            tokens = tokens + list(item.event.token_ids)
        else:
            assert reason is None, f"{item.request_id} ended twice"
            reason = item.event.finish_reason
        results[item.request_id] = (tokens, reason)


def run_step(scheduler: Scheduler, worker: FakeWorker, results: dict) -> StepRequest:
    """One schedule -> step -> postprocess (fail_step when the worker fails the step); accumulates
    {request_id: (tokens, finish reason)} in results."""
    request = scheduler.schedule().request
    assert request.num_scheduled_tokens <= scheduler.max_num_batched_tokens
    assert len(request.sequences) <= scheduler.max_num_seqs
    try:
        events = scheduler.postprocess(request, worker.step_sync(request))
    except InjectedFailure as exc:
        events = scheduler.fail_step(request, str(exc))
    collect_events(events, results)
    return request


def run_to_completion(scheduler: Scheduler, worker: FakeWorker, results: dict | None = None,
                      max_steps: int = 1000) -> dict:
    """Drive the scheduler until idle; returns {request_id: (tokens, finish reason)}."""
    results = {} if results is None else results
    for _ in range(max_steps):
        if not scheduler.has_work:
            assert worker.problems == []
            return results
        run_step(scheduler, worker, results)
    raise AssertionError("scheduler did not finish")


def test_budget_and_max_num_seqs_are_respected():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2)
    for i in range(3):
        scheduler.add(make_seq(f"r{i}", [10 + i] * 5, max_tokens=3))
    worker, results = make_worker(), {}
    first = run_step(scheduler, worker, results)
    assert [(s.seq_id, len(s.token_ids)) for s in first.sequences] == [("r0", 5), ("r1", 3)]
    assert [n.seq_id for n in first.new_sequences] == ["r0", "r1"]
    assert len(scheduler.waiting) == 1
    run_to_completion(scheduler, worker, results)
    assert all(len(s.sequences) <= 2 and s.num_scheduled_tokens <= 8 for s in worker.requests)
    for i in range(3):
        assert results[f"r{i}"] == (expected_output([10 + i], 3), FinishReason.LENGTH)


def test_long_prompt_is_prefilled_in_chunks_and_sampled_only_at_its_end():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    prompt = list(range(1, 21))
    scheduler.add(make_seq("long", prompt, max_tokens=2))
    worker = make_worker()
    chunks = []
    while scheduler.has_work:
        request = scheduler.schedule().request
        (work,) = request.sequences
        chunks.append((work.num_computed_tokens, len(work.token_ids), work.sample_indices))
        scheduler.postprocess(request, worker.step_sync(request))
    assert chunks == [(0, 8, ()), (8, 8, ()), (16, 4, (3,)), (20, 1, (0,))]
    assert worker.kv["long"] == prompt + [21]


def test_new_request_joins_the_running_batch_at_a_step_boundary():
    scheduler = make_scheduler()
    worker, results = make_worker(), {}
    scheduler.add(make_seq("a", [1, 2, 3], max_tokens=5))
    for _ in range(2):
        run_step(scheduler, worker, results)
    scheduler.add(make_seq("b", [40, 41], max_tokens=2))
    output = run_step(scheduler, worker, results)
    assert [(s.seq_id, s.token_ids) for s in output.sequences] == [("a", (5,)), ("b", (40, 41))]
    assert [n.seq_id for n in output.new_sequences] == ["b"]
    run_to_completion(scheduler, worker, results)
    assert results["a"] == (expected_output([3], 5), FinishReason.LENGTH)
    assert results["b"] == (expected_output([41], 2), FinishReason.LENGTH)
    assert scheduler.requests == {} and scheduler.block_manager.num_used_blocks == 0


def test_preemption_when_blocks_run_short_then_everything_finishes_correctly():
    # 8 blocks x 4 = 32 slots; each request needs 6 + 10 - 1 = 15 slots (4 blocks): 3 cannot fit together.
    scheduler = make_scheduler(num_kv_blocks=8, block_size=4)
    worker = make_worker()
    prompts = {f"r{i}": [10 * i + j for j in range(6)] for i in range(3)}
    for request_id, prompt in prompts.items():
        scheduler.add(make_seq(request_id, prompt, max_tokens=10))
    results = run_to_completion(scheduler, worker)
    assert scheduler.num_preemptions > 0
    for request_id, prompt in prompts.items():
        assert results[request_id] == (expected_output(prompt, 10), FinishReason.LENGTH)
    # Preempted sequences restart at 0 without being released or re-announced to the worker.
    restarts = [(i, w.seq_id) for i, step in enumerate(worker.requests) for w in step.sequences
                if w.num_computed_tokens == 0 and i > 0 and len(w.token_ids) > 6]
    assert restarts, "a preempted sequence was never recomputed"
    for i, seq_id in restarts:
        assert seq_id not in [n.seq_id for n in worker.requests[i].new_sequences]
        assert all(seq_id not in s.finished_seq_ids for s in worker.requests[:i + 1])
    assert scheduler.block_manager.num_used_blocks == 0


def test_preemption_takes_the_most_recently_admitted_and_requeues_it_first():
    scheduler = make_scheduler(num_kv_blocks=4, block_size=4, max_num_batched_tokens=16)
    worker = make_worker()
    scheduler.add(make_seq("old", [1] * 8, max_tokens=8))
    scheduler.add(make_seq("new", [2] * 8, max_tokens=8))
    scheduler.add(make_seq("later", [3] * 3, max_tokens=1))
    results = {}
    run_step(scheduler, worker, results)  # old: 2 blocks, new: 2 blocks; "later" waits
    output = run_step(scheduler, worker, results)  # old's 9th token needs a 3rd block: "new" goes
    assert [s.seq_id for s in output.sequences] == ["old"]
    assert [s.request_id for s in scheduler.waiting] == ["new", "later"]
    new = scheduler.requests["new"]
    assert new.num_computed_tokens == 0 and new.block_table == [] and new.num_tokens == 9
    assert "new" not in output.finished_seq_ids and scheduler.num_preemptions == 1
    run_to_completion(scheduler, worker, results)
    assert results["new"] == (expected_output([2], 8), FinishReason.LENGTH)


def test_eos_ends_generation_unless_ignore_eos():
    scheduler = make_scheduler()
    scheduler.add(make_seq("eos", [96], max_tokens=10))
    scheduler.add(make_seq("ignore", [96], max_tokens=5, ignore_eos=True))
    results = run_to_completion(scheduler, make_worker())
    assert results["eos"] == ([97, 98, 99], FinishReason.EOS_TOKEN)
    assert results["ignore"] == ([97, 98, 99, 0, 1], FinishReason.LENGTH)


def test_stop_token_and_max_tokens():
    scheduler = make_scheduler()
    scheduler.add(make_seq("stop", [10], max_tokens=10, stop_token_ids=(13, 50)))
    scheduler.add(make_seq("length", [10], max_tokens=2))
    results = run_to_completion(scheduler, make_worker())
    assert results["stop"] == ([11, 12, 13], FinishReason.STOP_TOKEN)
    assert results["length"] == ([11, 12], FinishReason.LENGTH)


def test_context_length_from_max_model_len_and_from_kv_capacity():
    scheduler = make_scheduler(max_model_len=10)
    scheduler.add(make_seq("ctx", [1] * 6, max_tokens=100))
    assert run_to_completion(scheduler, make_worker())["ctx"] == ([2, 3, 4, 5], FinishReason.CONTEXT_LENGTH)
    # 3 blocks x 4 = 12 slots: 12 tokens computed, a 13th sampled, nothing more can ever run.
    small = make_scheduler(num_kv_blocks=3, block_size=4)
    small.add(make_seq("kv", [1] * 6, max_tokens=100))
    tokens, status = run_to_completion(small, make_worker())["kv"]
    assert (len(tokens), status) == (7, FinishReason.CONTEXT_LENGTH)


def test_requests_that_can_never_fit_are_rejected():
    scheduler = make_scheduler(num_kv_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(RequestRejected, match="prompt_token_ids"):
        scheduler.add(make_seq("kv", [1] * 17))  # more than the whole cache
    with pytest.raises(RequestRejected, match="prompt_token_ids"):
        make_scheduler(max_model_len=8).add(make_seq("ctx", [1] * 8))
    scheduler.add(make_seq("ok", [1] * 16))
    with pytest.raises(RequestRejected, match="already live") as info:
        scheduler.add(make_seq("ok", [1]))
    assert isinstance(info.value, InvalidParameter) and info.value.field == "request_id"
    assert list(scheduler.requests) == ["ok"] and len(scheduler.waiting) == 1


def test_abort_frees_blocks_at_once_and_releases_the_id_on_the_next_step():
    scheduler = make_scheduler()
    worker = make_worker()
    scheduler.add(make_seq("a", [1] * 9, max_tokens=10))
    scheduler.add(make_seq("b", [2] * 3, max_tokens=10))
    output = scheduler.schedule().request
    scheduler.postprocess(output, worker.step_sync(output))
    used = scheduler.block_manager.num_used_blocks
    scheduler.add(make_seq("never-run", [3], max_tokens=1))
    assert scheduler.abort("a") and scheduler.abort("never-run")
    assert scheduler.block_manager.num_used_blocks == used - 3
    assert not scheduler.abort("a")
    output = scheduler.schedule().request
    assert output.finished_seq_ids == ["a"]  # "never-run" was never sent to the worker
    assert [s.seq_id for s in output.sequences] == ["b"]
    scheduler.postprocess(output, worker.step_sync(output))
    assert scheduler.schedule().request.finished_seq_ids == []


def test_abort_while_its_step_runs_is_skipped_by_postprocess():
    scheduler = make_scheduler()
    worker = make_worker()
    scheduler.add(make_seq("a", [1, 2], max_tokens=10))
    scheduler.add(make_seq("b", [5, 6], max_tokens=1))
    output = scheduler.schedule().request
    sampled = worker.step_sync(output)
    scheduler.abort("a")
    results = scheduler.postprocess(output, sampled)
    assert {r.request_id for r in results} == {"b"}
    assert scheduler.block_manager.num_used_blocks == 0 and not scheduler.has_work


def test_several_sampled_tokens_per_step_stop_at_the_first_stop_condition():
    scheduler = make_scheduler()
    scheduler.add(make_seq("spec", [1, 2], max_tokens=10, stop_token_ids=(7,)))
    request = scheduler.schedule().request
    scheduler.postprocess(request, StepResult([SequenceOutput("spec", (3,), (0.5,))]))
    request = scheduler.finish_plan(scheduler.schedule(), {"spec": CandidateTree((4, 7), (-1, 0))})
    result = StepResult([SequenceOutput("spec", (4, 7, 8), (0.1, 0.2, 0.3))])  # both drafts + the target's own
    chunk, complete = (item.event for item in scheduler.postprocess(request, result))
    assert (chunk.token_ids, chunk.scores) == ((4, 7), (0.1, 0.2))
    assert complete.finish_reason is FinishReason.STOP_TOKEN
    assert complete.num_generated_tokens == 3 and complete.num_prompt_tokens == 2


def test_failed_step_is_discarded_and_its_requests_can_be_aborted():
    scheduler = make_scheduler()
    scheduler.add(make_seq("a", [1], max_tokens=3))
    output = scheduler.schedule().request
    assert scheduler.discard(output) == ["a"]
    scheduler.abort("a")
    assert scheduler.block_manager.num_used_blocks == 0
    assert scheduler.schedule().request.sequences == []


def test_metrics_follow_the_request_timeline():
    now = [0.0]
    scheduler = make_scheduler(clock=lambda: now[0], max_num_batched_tokens=4)
    worker = make_worker()
    scheduler.add(Sequence("m", [1] * 6, stopping=StoppingCriteria(max_tokens=3), arrival_time=0.0))
    scheduler.add(Sequence("n", [2], stopping=StoppingCriteria(max_tokens=1), arrival_time=0.0))
    finals = {}
    while scheduler.has_work:
        now[0] += 0.5
        output = scheduler.schedule().request
        now[0] += 0.5
        for item in scheduler.postprocess(output, worker.step_sync(output)):
            if isinstance(item.event, GenerateComplete):
                finals[item.request_id] = item.event
    # m: prefill 4 + 2 (steps 1-2), tokens at t=2, 3, 4. n waits for step 2 (t=1.5), token at t=2.
    m, n = finals["m"], finals["n"]
    assert (m.queue_wait_us, m.first_token_us, m.decode_us, m.max_batch_size) == (500_000, 2_000_000, 2_000_000, 2)
    assert (n.queue_wait_us, n.first_token_us, n.decode_us, n.max_batch_size) == (1_500_000, 2_000_000, 0, 2)


# Faults: one sequence's error output, whole-step failures, malformed answers.

PROMPTS = {f"r{i}": [10 * i + j for j in range(1 + i % 3)] for i in range(8)}


def test_block_tables_go_as_deltas_to_a_worker_that_keeps_them_and_whole_to_one_that_does_not():
    """The fake worker reads every sequence's KV back through the tables it rebuilds from the deltas, so a
    delta that misses a change to a table (here the preemptions) changes the tokens or fails the step."""
    prompts = {f"r{i}": [10 * i + j for j in range(6)] for i in range(4)}
    results, num_entries = {}, {}
    for is_delta in (True, False):
        scheduler = make_scheduler(num_kv_blocks=10, is_block_table_delta=is_delta)  # short of blocks: preemptions
        worker = FakeWorker(increment(VOCAB), VOCAB, [EOS], block_size=4, block_table_deltas=is_delta)
        add_all(scheduler, prompts, max_tokens=12)
        results[is_delta] = run_to_completion(scheduler, worker)
        assert scheduler.num_preemptions > 0
        num_entries[is_delta] = worker.num_table_entries
        starts = [work.block_table_start for step in worker.requests for work in step.sequences]
        assert any(starts) if is_delta else not any(starts)
    assert results[True] == results[False] == {
        request_id: (expected_output(prompt, 12), FinishReason.LENGTH) for request_id, prompt in prompts.items()}
    assert num_entries[True] * 3 < num_entries[False], num_entries  # decode steps send no entries, mostly


def add_all(scheduler: Scheduler, prompts: dict[str, list[int]], max_tokens: int = 6) -> None:
    for request_id, prompt in prompts.items():
        scheduler.add(make_seq(request_id, prompt, max_tokens=max_tokens))


def assert_idle(scheduler: Scheduler) -> None:
    assert (len(scheduler.running), len(scheduler.waiting), scheduler.block_manager.num_used_blocks) == (0, 0, 0)
    assert scheduler.requests == {}


def test_an_error_output_ends_that_request_alone_after_its_streamed_tokens():
    scheduler, worker = make_scheduler(), make_worker()
    worker.sequence_errors["r3"] = 2  # two tokens, then non-finite logits
    add_all(scheduler, PROMPTS)
    events: list[RequestEvent] = []
    while scheduler.has_work:
        request = scheduler.schedule().request
        events += scheduler.postprocess(request, worker.step_sync(request))
    results: dict = {}
    collect_events(events, results)
    for request_id, prompt in PROMPTS.items():
        if request_id != "r3":
            assert results[request_id] == (expected_output(prompt, 6), FinishReason.LENGTH)
    assert results["r3"] == (expected_output(PROMPTS["r3"], 2), FinishReason.ERROR)
    (complete,) = [e.event for e in events if e.request_id == "r3" and e.is_terminal]
    assert complete.error_message == "non-finite logits for r3" and complete.num_generated_tokens == 2
    assert_idle(scheduler)
    scheduler.add(make_seq("next", [1], max_tokens=1))
    run_to_completion(scheduler, worker)
    assert "r3" in worker.released  # the worker drops the failed sequence's state


def test_a_failed_step_preempts_its_sequences_in_order_and_halves_the_batch_cap():
    scheduler, worker = make_scheduler(), make_worker()
    add_all(scheduler, PROMPTS)
    scheduler.add(make_seq("late", [5], max_tokens=6))  # max_num_seqs = 8: "late" waits
    results: dict = {}
    run_step(scheduler, worker, results)  # prefills
    worker.step_failures.append("RESOURCE_EXHAUSTED")
    failed = run_step(scheduler, worker, results)
    assert [w.seq_id for w in failed.sequences] == list(PROMPTS)
    assert [seq.request_id for seq in scheduler.waiting] == list(PROMPTS) + ["late"]
    assert all(seq.num_computed_tokens == 0 and seq.block_table == [] for seq in scheduler.waiting)
    assert scheduler.running == [] and scheduler.block_manager.num_used_blocks == 0
    assert (scheduler.num_seqs_cap, scheduler.num_failed_steps) == (4, 1)
    retry = run_step(scheduler, worker, results)
    assert [w.seq_id for w in retry.sequences] == list(PROMPTS)[:4]
    assert all(w.num_computed_tokens == 0 for w in retry.sequences)
    run_to_completion(scheduler, worker, results)
    for request_id, prompt in {**PROMPTS, "late": [5]}.items():
        assert results[request_id] == (expected_output(prompt, 6), FinishReason.LENGTH)
    assert max(len(r.sequences) for r in worker.requests[2:]) == 4
    assert_idle(scheduler)


def test_the_batch_cap_grows_back_by_one_per_sixteen_successful_steps():
    scheduler, worker = make_scheduler(), make_worker()
    for request_id, prompt in PROMPTS.items():
        scheduler.add(make_seq(request_id, prompt, max_tokens=60, ignore_eos=True))
    results: dict = {}
    worker.step_failures.append("RESOURCE_EXHAUSTED")
    run_step(scheduler, worker, results)
    assert scheduler.num_seqs_cap == 4
    sizes = [len(run_step(scheduler, worker, results).sequences) for _ in range(64)]
    assert sizes[:16] == [4] * 16 and sizes[16:32] == [5] * 16 and sizes[32:48] == [6] * 16
    assert scheduler.num_seqs_cap == 8
    run_to_completion(scheduler, worker, results)
    assert all(results[rid] == (expected_output(p, 60), FinishReason.LENGTH) for rid, p in PROMPTS.items())


def test_sequences_new_in_a_failed_step_are_announced_again_and_its_releases_repeated():
    scheduler, worker = make_scheduler(), make_worker()
    scheduler.add(make_seq("gone", [1], max_tokens=1))
    run_to_completion(scheduler, worker)
    scheduler.add(make_seq("a", [1, 2], max_tokens=3))
    worker.step_failures.append("INTERNAL")
    results: dict = {}
    failed = run_step(scheduler, worker, results)
    assert failed.finished_seq_ids == ["gone"] and [n.seq_id for n in failed.new_sequences] == ["a"]
    retry = run_step(scheduler, worker, results)
    assert retry.finished_seq_ids == ["gone"] and [n.seq_id for n in retry.new_sequences] == ["a"]
    run_to_completion(scheduler, worker, results)
    assert results["a"] == (expected_output([1, 2], 3), FinishReason.LENGTH)


def test_out_of_memory_past_a_batch_size_shrinks_the_batch_until_it_fits():
    scheduler, worker = make_scheduler(), make_worker()
    worker.max_batch_size = 3
    add_all(scheduler, PROMPTS, max_tokens=10)
    results = run_to_completion(scheduler, worker)
    for request_id, prompt in PROMPTS.items():
        assert results[request_id] == (expected_output(prompt, 10), FinishReason.LENGTH)
    assert scheduler.num_failed_steps > 0 and worker.max_batch <= 3
    assert_idle(scheduler)


def test_a_sequence_that_fails_the_step_again_alone_ends_with_an_error_and_the_rest_finish():
    scheduler, worker = make_scheduler(), make_worker()
    worker.poison_seq_ids.add("r5")
    add_all(scheduler, PROMPTS)
    results = run_to_completion(scheduler, worker)
    for request_id, prompt in PROMPTS.items():
        if request_id != "r5":
            assert results[request_id] == (expected_output(prompt, 6), FinishReason.LENGTH)
    assert results["r5"] == ([], FinishReason.ERROR)
    # It ended only once it had run alone: its last step held nothing else.
    last = [r for r in worker.requests if any(w.seq_id == "r5" for w in r.sequences)][-1]
    assert [w.seq_id for w in last.sequences] == ["r5"]
    assert_idle(scheduler)


def test_a_permanently_failing_worker_ends_every_request_with_an_error_in_bounded_steps():
    scheduler, worker = make_scheduler(), make_worker()
    worker.failing_code = "INTERNAL"
    add_all(scheduler, PROMPTS)
    results = run_to_completion(scheduler, worker, max_steps=50)
    assert {reason for _, reason in results.values()} == {FinishReason.ERROR} and len(results) == len(PROMPTS)
    assert len(worker.requests) <= 2 * len(PROMPTS)
    assert_idle(scheduler)


def test_max_failed_steps_bounds_the_retries_of_a_request_that_never_runs_alone():
    scheduler, worker = make_scheduler(max_failed_steps=2), make_worker()
    worker.failing_code = "RESOURCE_EXHAUSTED"
    add_all(scheduler, {"a": [1], "b": [2], "c": [3], "d": [4]})
    results = run_to_completion(scheduler, worker, max_steps=20)
    assert all(reason is FinishReason.ERROR for _, reason in results.values())
    # a and b end in a batch of 2, at their second failure; c and d at their second, alone.
    assert [len(r.sequences) for r in worker.requests] == [4, 2, 1, 1]
    assert_idle(scheduler)


def test_an_answer_that_does_not_fit_the_step_fails_the_step_and_is_retried():
    scheduler, worker = make_scheduler(), make_worker()
    add_all(scheduler, PROMPTS)
    results: dict = {}
    run_step(scheduler, worker, results)
    worker.num_malformed_answers = 1  # two tokens for one sample index
    run_step(scheduler, worker, results)
    assert scheduler.num_failed_steps == 1  # and nothing of the failed step reached a stream
    assert all(len(tokens) == 1 for tokens, _ in results.values())
    run_to_completion(scheduler, worker, results)
    for request_id, prompt in PROMPTS.items():
        assert results[request_id] == (expected_output(prompt, 6), FinishReason.LENGTH)


# Prompt log-probabilities.

def test_prompt_logprobs_stream_once_per_prompt_token_even_after_a_recomputation():
    scheduler, worker = make_scheduler(max_num_batched_tokens=8), make_worker()
    prompt = list(range(1, 21))
    scheduler.add(make_seq("echo", prompt, max_tokens=3, sampling=SamplingParams(num_prompt_logprobs=1)))
    scheduler.add(make_seq("plain", [3, 4], max_tokens=3))
    events: list[RequestEvent] = []
    for step in range(20):
        if not scheduler.has_work:
            break
        request = scheduler.schedule().request
        if step == 2:  # the prompt is recomputed from 0 after this failure
            events += scheduler.fail_step(request, "injected")
            continue
        events += scheduler.postprocess(request, worker.step_sync(request))
    chunks = [e.event for e in events if e.request_id == "echo" and isinstance(e.event, TokenChunk)]
    prompt_chunks = [c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None]
    assert len(prompt_chunks) >= 2 and any(c.token_ids == () for c in chunks)  # chunks before the first token
    covered = [index for p in prompt_chunks for index in range(p.start, p.start + len(p.logprobs))]
    assert covered == list(range(1, 20))
    logprobs = [lp for p in prompt_chunks for lp in p.logprobs]
    assert logprobs == [prompt_logprob(prompt[:i], prompt[i]) for i in range(1, 20)]
    assert all(len(top.token_ids) == 1 for p in prompt_chunks for top in p.top_logprobs)
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == expected_output(prompt, 3)
    plain = [e.event for e in events if e.request_id == "plain" and isinstance(e.event, TokenChunk)]
    assert all(c.prompt_logprobs is None and c.token_ids for c in plain)
