"""Pure scheduler tests: no model, no network. A fake worker plays the model.

The fake model's rule is next token = (last token + 1) % VOCAB, so every
expected output is known in advance; the fake also keeps each sequence's
"KV cache" and checks the scheduler's accounting the way a real worker would.
"""

from __future__ import annotations

import pytest

from scheduler.outputs import SampledTokens, SchedulerOutput
from scheduler.scheduler import RequestRejected, Scheduler
from scheduler.sequence import Sequence, SequenceStatus, StoppingCriteria

VOCAB = 100
EOS = 99


def make_scheduler(**overrides) -> Scheduler:
    args = dict(num_kv_blocks=64, block_size=4, max_model_len=512, eos_token_ids=[EOS], max_num_seqs=8,
                max_num_batched_tokens=64)
    args.update(overrides)
    return Scheduler(**args)


def make_seq(request_id: str, prompt: list[int], max_new_tokens: int = 4, **stopping) -> Sequence:
    return Sequence(request_id, prompt, stopping=StoppingCriteria(max_new_tokens=max_new_tokens, **stopping))


def expected_output(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + 1 + i) % VOCAB for i in range(n)]


class FakeWorker:
    """Checks each StepRequest like a worker would and samples (last token + 1) % VOCAB."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.kv: dict[str, list[int]] = {}
        self.known: set[str] = set()
        self.steps: list[SchedulerOutput] = []

    def step(self, output: SchedulerOutput) -> dict[str, SampledTokens]:
        self.steps.append(output)
        for seq_id in output.finished_seq_ids:
            assert seq_id in self.known, f"released {seq_id} the worker never saw"
            self.known.discard(seq_id)
            self.kv.pop(seq_id, None)
        for new in output.new_sequences:
            assert new.seq_id not in self.known
            self.known.add(new.seq_id)
        used_blocks: set[int] = set()
        sampled = {}
        for work in output.scheduled:
            assert work.seq_id in self.known
            if work.num_computed_tokens == 0:
                self.kv[work.seq_id] = []  # a (re)start: recompute from scratch
            cache = self.kv[work.seq_id]
            assert len(cache) == work.num_computed_tokens
            cache.extend(work.token_ids)
            assert len(work.block_table) * self.block_size >= len(cache)
            assert used_blocks.isdisjoint(work.block_table), "two sequences share a KV block"
            used_blocks.update(work.block_table)
            if work.sample_indices:
                assert work.sample_indices == [len(work.token_ids) - 1]
                sampled[work.seq_id] = SampledTokens([(work.token_ids[-1] + 1) % VOCAB], [1.5])
        return sampled


def run_step(scheduler: Scheduler, worker: FakeWorker, results: dict) -> SchedulerOutput:
    """One schedule -> step -> postprocess; accumulates {request_id: (tokens, finish status)} in results."""
    output = scheduler.schedule()
    assert output.num_scheduled_tokens <= scheduler.max_num_batched_tokens
    assert len(output.scheduled) <= scheduler.max_num_seqs
    for out in scheduler.postprocess(output, worker.step(output)):
        tokens, _ = results.get(out.request_id, ([], None))
        results[out.request_id] = (tokens + out.token_ids, out.finish_status)
    return output


def run_to_completion(scheduler: Scheduler, worker: FakeWorker, results: dict | None = None) -> dict:
    """Drive the scheduler until idle; returns {request_id: (tokens, finish status)}."""
    results = {} if results is None else results
    for _ in range(1000):
        if not scheduler.has_work:
            return results
        run_step(scheduler, worker, results)
    raise AssertionError("scheduler did not finish")


def test_budget_and_max_num_seqs_are_respected():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=2)
    for i in range(3):
        scheduler.add(make_seq(f"r{i}", [10 + i] * 5, max_new_tokens=3))
    worker, results = FakeWorker(4), {}
    first = run_step(scheduler, worker, results)
    assert [(s.seq_id, len(s.token_ids)) for s in first.scheduled] == [("r0", 5), ("r1", 3)]
    assert [n.seq_id for n in first.new_sequences] == ["r0", "r1"]
    assert len(scheduler.waiting) == 1
    run_to_completion(scheduler, worker, results)
    assert all(len(s.scheduled) <= 2 and s.num_scheduled_tokens <= 8 for s in worker.steps)
    for i in range(3):
        assert results[f"r{i}"] == (expected_output([10 + i], 3), SequenceStatus.FINISHED_LENGTH)


def test_long_prompt_is_prefilled_in_chunks_and_sampled_only_at_its_end():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    prompt = list(range(1, 21))
    scheduler.add(make_seq("long", prompt, max_new_tokens=2))
    worker = FakeWorker(4)
    chunks = []
    while scheduler.has_work:
        output = scheduler.schedule()
        (work,) = output.scheduled
        chunks.append((work.num_computed_tokens, len(work.token_ids), work.sample_indices))
        scheduler.postprocess(output, worker.step(output))
    assert chunks == [(0, 8, []), (8, 8, []), (16, 4, [3]), (20, 1, [0])]
    assert worker.kv["long"] == prompt + [21]


def test_new_request_joins_the_running_batch_at_a_step_boundary():
    scheduler = make_scheduler()
    worker, results = FakeWorker(4), {}
    scheduler.add(make_seq("a", [1, 2, 3], max_new_tokens=5))
    for _ in range(2):
        run_step(scheduler, worker, results)
    scheduler.add(make_seq("b", [40, 41], max_new_tokens=2))
    output = run_step(scheduler, worker, results)
    assert [(s.seq_id, s.token_ids) for s in output.scheduled] == [("a", [5]), ("b", [40, 41])]
    assert [n.seq_id for n in output.new_sequences] == ["b"]
    run_to_completion(scheduler, worker, results)
    assert results["a"] == (expected_output([3], 5), SequenceStatus.FINISHED_LENGTH)
    assert results["b"] == (expected_output([41], 2), SequenceStatus.FINISHED_LENGTH)
    assert scheduler.requests == {} and scheduler.block_manager.num_used_blocks == 0


def test_preemption_when_blocks_run_short_then_everything_finishes_correctly():
    # 8 blocks x 4 = 32 slots; each request needs 6 + 10 - 1 = 15 slots (4 blocks): 3 cannot fit together.
    scheduler = make_scheduler(num_kv_blocks=8, block_size=4)
    worker = FakeWorker(4)
    prompts = {f"r{i}": [10 * i + j for j in range(6)] for i in range(3)}
    for request_id, prompt in prompts.items():
        scheduler.add(make_seq(request_id, prompt, max_new_tokens=10))
    results = run_to_completion(scheduler, worker)
    assert scheduler.num_preemptions > 0
    for request_id, prompt in prompts.items():
        assert results[request_id] == (expected_output(prompt, 10), SequenceStatus.FINISHED_LENGTH)
    # Preempted sequences restart at 0 without being released or re-announced to the worker.
    restarts = [(i, w.seq_id) for i, step in enumerate(worker.steps) for w in step.scheduled
                if w.num_computed_tokens == 0 and i > 0 and len(w.token_ids) > 6]
    assert restarts, "a preempted sequence was never recomputed"
    for i, seq_id in restarts:
        assert seq_id not in [n.seq_id for n in worker.steps[i].new_sequences]
        assert all(seq_id not in s.finished_seq_ids for s in worker.steps[:i + 1])
    assert scheduler.block_manager.num_used_blocks == 0


def test_preemption_takes_the_most_recently_admitted_and_requeues_it_first():
    scheduler = make_scheduler(num_kv_blocks=4, block_size=4, max_num_batched_tokens=16)
    worker = FakeWorker(4)
    scheduler.add(make_seq("old", [1] * 8, max_new_tokens=8))
    scheduler.add(make_seq("new", [2] * 8, max_new_tokens=8))
    scheduler.add(make_seq("later", [3] * 3, max_new_tokens=1))
    results = {}
    run_step(scheduler, worker, results)  # old: 2 blocks, new: 2 blocks; "later" waits
    output = run_step(scheduler, worker, results)  # old's 9th token needs a 3rd block: "new" goes
    assert [s.seq_id for s in output.scheduled] == ["old"]
    assert [s.request_id for s in scheduler.waiting] == ["new", "later"]
    new = scheduler.requests["new"]
    assert new.num_computed_tokens == 0 and new.block_table == [] and new.num_tokens == 9
    assert "new" not in output.finished_seq_ids and scheduler.num_preemptions == 1
    run_to_completion(scheduler, worker, results)
    assert results["new"] == (expected_output([2], 8), SequenceStatus.FINISHED_LENGTH)


def test_eos_ends_generation_unless_ignore_eos():
    scheduler = make_scheduler()
    scheduler.add(make_seq("eos", [96], max_new_tokens=10))
    scheduler.add(make_seq("ignore", [96], max_new_tokens=5, ignore_eos=True))
    results = run_to_completion(scheduler, FakeWorker(4))
    assert results["eos"] == ([97, 98, 99], SequenceStatus.FINISHED_EOS_TOKEN)
    assert results["ignore"] == ([97, 98, 99, 0, 1], SequenceStatus.FINISHED_LENGTH)


def test_stop_token_and_max_new_tokens():
    scheduler = make_scheduler()
    scheduler.add(make_seq("stop", [10], max_new_tokens=10, stop_token_ids=(13, 50)))
    scheduler.add(make_seq("length", [10], max_new_tokens=2))
    results = run_to_completion(scheduler, FakeWorker(4))
    assert results["stop"] == ([11, 12, 13], SequenceStatus.FINISHED_STOP_TOKEN)
    assert results["length"] == ([11, 12], SequenceStatus.FINISHED_LENGTH)


def test_context_length_from_max_model_len_and_from_kv_capacity():
    scheduler = make_scheduler(max_model_len=10)
    scheduler.add(make_seq("ctx", [1] * 6, max_new_tokens=100))
    assert run_to_completion(scheduler, FakeWorker(4))["ctx"] == ([2, 3, 4, 5], SequenceStatus.FINISHED_CONTEXT_LENGTH)
    # 3 blocks x 4 = 12 slots: 12 tokens computed, a 13th sampled, nothing more can ever run.
    small = make_scheduler(num_kv_blocks=3, block_size=4)
    small.add(make_seq("kv", [1] * 6, max_new_tokens=100))
    tokens, status = run_to_completion(small, FakeWorker(4))["kv"]
    assert (len(tokens), status) == (7, SequenceStatus.FINISHED_CONTEXT_LENGTH)


def test_requests_that_can_never_fit_are_rejected():
    scheduler = make_scheduler(num_kv_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(RequestRejected, match="prompt_token_ids"):
        scheduler.add(make_seq("kv", [1] * 17))  # more than the whole cache
    with pytest.raises(RequestRejected, match="prompt_token_ids"):
        make_scheduler(max_model_len=8).add(make_seq("ctx", [1] * 8))
    with pytest.raises(RequestRejected, match="empty"):
        scheduler.add(make_seq("empty", []))
    scheduler.add(make_seq("ok", [1] * 16))
    with pytest.raises(RequestRejected, match="already live"):
        scheduler.add(make_seq("ok", [1]))
    assert list(scheduler.requests) == ["ok"] and len(scheduler.waiting) == 1


def test_abort_frees_blocks_at_once_and_releases_the_id_on_the_next_step():
    scheduler = make_scheduler()
    worker = FakeWorker(4)
    scheduler.add(make_seq("a", [1] * 9, max_new_tokens=10))
    scheduler.add(make_seq("b", [2] * 3, max_new_tokens=10))
    output = scheduler.schedule()
    scheduler.postprocess(output, worker.step(output))
    used = scheduler.block_manager.num_used_blocks
    scheduler.add(make_seq("never-run", [3], max_new_tokens=1))
    assert scheduler.abort("a") and scheduler.abort("never-run")
    assert scheduler.block_manager.num_used_blocks == used - 3
    assert not scheduler.abort("a")
    output = scheduler.schedule()
    assert output.finished_seq_ids == ["a"]  # "never-run" was never sent to the worker
    assert [s.seq_id for s in output.scheduled] == ["b"]
    scheduler.postprocess(output, worker.step(output))
    assert scheduler.schedule().finished_seq_ids == []


def test_abort_while_its_step_runs_is_skipped_by_postprocess():
    scheduler = make_scheduler()
    worker = FakeWorker(4)
    scheduler.add(make_seq("a", [1, 2], max_new_tokens=10))
    scheduler.add(make_seq("b", [5, 6], max_new_tokens=1))
    output = scheduler.schedule()
    sampled = worker.step(output)
    scheduler.abort("a")
    results = scheduler.postprocess(output, sampled)
    assert [r.request_id for r in results] == ["b"]
    assert scheduler.block_manager.num_used_blocks == 0 and not scheduler.has_work


def test_several_sampled_tokens_per_step_stop_at_the_first_stop_condition():
    scheduler = make_scheduler()
    scheduler.add(make_seq("spec", [1, 2], max_new_tokens=10, stop_token_ids=(7,)))
    output = scheduler.schedule()
    sampled = {"spec": SampledTokens([5, 7, 8], [0.1, 0.2, 0.3])}
    (result,) = scheduler.postprocess(output, sampled)
    assert (result.token_ids, result.scores) == ([5, 7], [0.1, 0.2])
    assert result.finish_status is SequenceStatus.FINISHED_STOP_TOKEN
    assert result.num_generated_tokens == 2 and result.num_prompt_tokens == 2


def test_failed_step_is_discarded_and_its_requests_can_be_aborted():
    scheduler = make_scheduler()
    scheduler.add(make_seq("a", [1], max_new_tokens=3))
    output = scheduler.schedule()
    assert scheduler.discard(output) == ["a"]
    scheduler.abort("a")
    assert scheduler.block_manager.num_used_blocks == 0
    assert scheduler.schedule().is_empty


def test_metrics_follow_the_request_timeline():
    now = [0.0]
    scheduler = make_scheduler(clock=lambda: now[0], max_num_batched_tokens=4)
    worker = FakeWorker(4)
    scheduler.add(Sequence("m", [1] * 6, stopping=StoppingCriteria(max_new_tokens=3), arrival_time=0.0))
    scheduler.add(Sequence("n", [2], stopping=StoppingCriteria(max_new_tokens=1), arrival_time=0.0))
    finals = {}
    while scheduler.has_work:
        now[0] += 0.5
        output = scheduler.schedule()
        now[0] += 0.5
        for result in scheduler.postprocess(output, worker.step(output)):
            if result.is_finished:
                finals[result.request_id] = result.metrics
    # m: prefill 4 + 2 (steps 1-2), tokens at t=2, 3, 4. n waits for step 2 (t=1.5), token at t=2.
    m, n = finals["m"], finals["n"]
    assert (m.queue_wait_us, m.first_token_us, m.decode_us, m.max_batch_size) == (500_000, 2_000_000, 2_000_000, 2)
    assert (n.queue_wait_us, n.first_token_us, n.decode_us, n.max_batch_size) == (1_500_000, 2_000_000, 0, 2)
