"""Automatic prefix caching as pure logic: the block manager's hash chain, LRU and refcounts, then the
scheduler with tests/support/fakes.py's FakeWorker, whose paged KV cache holds the token computed in every slot and
fails any step whose KV read back differs from the tokens it knows (a wrongly shared, overwritten or
evicted block can never pass unnoticed), and whose positional rule makes any wrong KV change the output.
"""

from __future__ import annotations

import pytest

from protos.segserve.v1.generate import FinishReason, GenerateComplete
from protos.segserve.v1.sampling import SamplingParams, StoppingCriteria
from scheduler.block_manager import BlockManager, hash_block
from scheduler.scheduler import Scheduler
from scheduler.sequence import Sequence
from tests.support.fake_drafter import FakeDrafter
from tests.support.fakes import FakeWorker, InjectedFailure, positional, reference
from tests.scheduler.test_scheduler import collect_events
from tests.scheduler.test_spec import make_speculator, step

VOCAB = 97
EOS = 96
RULE = positional(VOCAB)
BLOCK = 4


def make_scheduler(**overrides) -> Scheduler:
    args = dict(num_kv_blocks=64, block_size=BLOCK, max_model_len=512, eos_token_ids=[EOS], max_num_seqs=8,
                max_num_batched_tokens=64,
                is_block_table_delta=True)  # as for the real worker (and the fake, which offers them)
    args.update(overrides)
    return Scheduler(**args)


def make_worker(scheduler: Scheduler) -> FakeWorker:
    return FakeWorker(RULE, VOCAB, [EOS], num_kv_blocks=scheduler.block_manager.num_total_blocks,
                      block_size=BLOCK, max_model_len=512)


def make_seq(request_id: str, prompt: list[int], max_tokens: int = 6, **sampling) -> Sequence:
    return Sequence(request_id, prompt, SamplingParams(**sampling), StoppingCriteria(max_tokens, ignore_eos=True))


def expected(prompt: list[int], max_tokens: int = 6) -> list[int]:
    return reference(RULE, prompt, max_tokens)


def run(scheduler: Scheduler, worker: FakeWorker, seqs: list[Sequence], results: dict | None = None) -> dict:
    """Add seqs, drive to idle (a failed step goes through fail_step); {request_id: (tokens, reason)}."""
    results = {} if results is None else results
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(1000):
        if not scheduler.has_work:
            break
        request = scheduler.schedule().request
        try:
            events = scheduler.postprocess(request, worker.step_sync(request))
        except InjectedFailure as exc:
            events = scheduler.fail_step(request, str(exc))
        collect_events(events, results)
        for item in events:
            if isinstance(item.event, GenerateComplete):
                results.setdefault("complete", {})[item.request_id] = item.event
    assert not scheduler.has_work and worker.problems == []
    assert scheduler.block_manager.num_used_blocks == 0, "every request ended: no block may stay referenced"
    return results


def first_work(worker: FakeWorker, seq_id: str):
    return next(work for request in worker.requests for work in request.sequences if work.seq_id == seq_id)


def computed_tokens(worker: FakeWorker, seq_id: str) -> int:
    """Tokens the worker computed for a sequence over all of its steps."""
    return sum(len(work.token_ids) for request in worker.requests for work in request.sequences
               if work.seq_id == seq_id)


# -- the block manager alone --------------------------------------------------------------------------------


def committed(manager: BlockManager, request_id: str, tokens: list[int]) -> Sequence:
    """A sequence admitted with whatever prefix is cached, all of its tokens computed and hashed."""
    seq = Sequence(request_id, tokens)
    prefix = manager.cached_prefix(seq)
    manager.admit(seq, prefix, len(tokens) - len(prefix) * manager.block_size)
    seq.num_computed_tokens = len(tokens)
    manager.commit(seq)
    return seq


def test_block_hashes_chain_the_parent_and_the_tokens():
    first = hash_block(b"", [1, 2, 3, 4])
    assert first == hash_block(b"", [1, 2, 3, 4])
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(hash_block(b"", [0, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(first, [5, 6, 7, 9])
    manager = BlockManager(8, BLOCK)
    seq = committed(manager, "a", list(range(1, 11)))
    assert seq.block_hashes == [first, hash_block(first, [5, 6, 7, 8])]  # the partial third block has none
    assert [manager.is_cached(b) for b in seq.block_table] == [True, True, False]


def test_two_sequences_share_a_prefix_with_refcounts_and_only_full_computed_blocks_are_shared():
    manager = BlockManager(8, BLOCK)
    a = committed(manager, "a", list(range(1, 12)))  # 2 full blocks + 3 tokens
    b = Sequence("b", list(range(1, 10)) + [50, 51])
    prefix = manager.cached_prefix(b)
    assert prefix == a.block_table[:2]
    manager.admit(b, prefix, b.num_tokens - 8)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]  # the tail is its own: shared blocks are never written
    assert [manager.ref_count(x) for x in a.block_table] == [2, 2, 1]
    assert manager.num_used_blocks == 4
    a_blocks = list(a.block_table)
    manager.free(a)
    assert [manager.ref_count(x) for x in b.block_table] == [1, 1, 1] and manager.num_used_blocks == 3
    manager.free(b)
    assert manager.num_used_blocks == 0 and manager.num_cached_blocks == 2  # freed blocks stay cached
    # A prompt that is exactly the cached blocks still computes its last token (its logits are needed).
    c = Sequence("c", list(range(1, 9)))
    assert manager.cached_prefix(c) == a_blocks[:1]
    # Prompt log-probabilities need every position's logits: no cached block.
    d = Sequence("d", list(range(1, 12)), SamplingParams(num_prompt_logprobs=0))
    assert manager.cached_prefix(d) == []


def test_freed_blocks_are_evicted_least_recently_freed_first_and_only_when_memory_is_needed():
    manager = BlockManager(6, 2)
    old = committed(manager, "old", [1, 2, 3, 4])  # blocks hashed [1 2] [3 4]
    new = committed(manager, "new", [7, 8, 9, 10])
    old_blocks, new_blocks = list(old.block_table), list(new.block_table)
    manager.free(old)
    manager.free(new)
    assert manager.num_free_blocks == 6 and manager.num_cached_blocks == 4
    # Uncached free blocks go first: nothing cached is evicted while they last.
    filler = Sequence("filler", [0] * 4)
    manager.allocate(filler, 4)
    assert manager.num_cached_blocks == 4 and not any(manager.is_cached(b) for b in filler.block_table)
    # Then the least recently freed: "old" (freed first; each sequence's tail before its head).
    more = Sequence("more", [0] * 2)
    manager.allocate(more, 2)
    assert more.block_table == [old_blocks[1]] and manager.num_cached_blocks == 3
    assert [manager.cached_prefix(Sequence("x", t)) for t in ([1, 2, 3, 4, 5], [7, 8, 9, 10, 11])] == [
        old_blocks[:1], new_blocks]
    # Taking a cached block back into use protects it from eviction.
    again = Sequence("again", [7, 8, 9, 10, 11])
    assert manager.can_admit(new_blocks, 1)
    manager.admit(again, new_blocks, 1)  # needs 1 new block: evicts old's head, not the revived ones
    assert again.block_table[:2] == new_blocks and manager.num_cached_blocks == 2
    assert manager.num_free_blocks == 0 and not manager.can_admit([], 1)


def test_caching_off_never_hashes_nor_shares():
    manager = BlockManager(8, BLOCK, is_prefix_caching=False)
    committed(manager, "a", list(range(1, 12)))
    assert manager.num_cached_blocks == 0
    assert manager.cached_prefix(Sequence("b", list(range(1, 12)))) == []


# -- the scheduler with the fake worker ----------------------------------------------------------------------


def test_the_same_prompt_again_computes_only_its_tail():
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    prompt = list(range(1, 23))  # 22 tokens: 5 full blocks
    results = run(scheduler, worker, [make_seq("first", prompt)])
    run(scheduler, worker, [make_seq("second", prompt)], results)
    assert results["first"][0] == results["second"][0] == expected(prompt)
    work = first_work(worker, "second")
    assert (work.num_computed_tokens, len(work.token_ids)) == (20, 2)
    assert computed_tokens(worker, "second") == computed_tokens(worker, "first") - 20
    assert results["complete"]["first"].num_cached_prompt_tokens == 0
    assert results["complete"]["second"].num_cached_prompt_tokens == 20
    manager = scheduler.block_manager
    assert (manager.num_prefix_cache_queries, manager.num_prefix_cache_hits) == (44, 20)


def test_a_cached_prompt_block_boundary_leaves_the_last_token_to_compute():
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    prompt = list(range(1, 17))  # exactly 4 blocks
    results = run(scheduler, worker, [make_seq("a", prompt), ], )
    run(scheduler, worker, [make_seq("b", prompt)], results)
    work = first_work(worker, "b")
    assert (work.num_computed_tokens, len(work.token_ids), work.sample_indices) == (12, 4, (3,))
    assert results["b"][0] == expected(prompt)


def test_n_choices_of_one_prompt_share_its_blocks():
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    for i in range(3):
        scheduler.add(make_seq(f"c{i}", prompt, max_tokens=4))
    results: dict = {}
    collect_events(scheduler.postprocess(request := scheduler.schedule().request, worker.step_sync(request)), results)
    tables = [scheduler.requests[f"c{i}"].block_table for i in range(3)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # computed in one step, then deduplicated
    assert len({t[2] for t in tables}) == 3  # each choice writes its own tail
    assert [scheduler.block_manager.ref_count(b) for b in tables[0]] == [3, 3, 1]
    assert scheduler.block_manager.num_used_blocks == 2 + 3
    run(scheduler, worker, [], results)
    assert all(results[f"c{i}"][0] == expected(prompt, 4) for i in range(3))


def test_a_three_turn_chat_reuses_the_previous_turns_blocks():
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    history, results = [3, 1, 4, 1, 5, 9, 2, 6, 5], {}
    for turn in range(3):
        seq_id = f"turn{turn}"
        run(scheduler, worker, [make_seq(seq_id, history, max_tokens=5)], results)
        assert results[seq_id][0] == expected(history, 5)
        if turn:  # everything computed last turn (all but its last sampled token), in full blocks, is reused
            work = first_work(worker, seq_id)
            assert work.num_computed_tokens == previous_computed // BLOCK * BLOCK > 0
            assert results["complete"][seq_id].num_cached_prompt_tokens == work.num_computed_tokens
        previous_computed = len(history) + 5 - 1
        history = history + results[seq_id][0] + [10 + turn, 20 + turn, 30]  # the next user message
    assert scheduler.block_manager.num_prefix_cache_hits > 0


def test_prompt_logprob_requests_take_no_cached_block_but_fill_the_cache():
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    prompt = list(range(1, 23))
    results = run(scheduler, worker, [make_seq("plain", prompt)])
    run(scheduler, worker, [make_seq("logprobs", prompt, num_prompt_logprobs=0)], results)
    assert first_work(worker, "logprobs").num_computed_tokens == 0
    assert results["complete"]["logprobs"].num_cached_prompt_tokens == 0
    manager = scheduler.block_manager
    assert (manager.num_prefix_cache_queries, manager.num_prefix_cache_hits) == (22, 0)
    run(scheduler, worker, [make_seq("after", prompt + [1])], results)
    assert first_work(worker, "after").num_computed_tokens == 20


def test_preemption_with_a_small_cache_stays_correct_and_reuses_cached_blocks():
    scheduler = make_scheduler(num_kv_blocks=14, max_num_batched_tokens=16)
    worker = make_worker(scheduler)
    shared = list(range(30, 42))  # 3 full blocks every request starts with
    prompts = {f"r{i}": shared + [i, i + 1, i + 2] for i in range(6)}
    results = run(scheduler, worker, [make_seq(k, p, max_tokens=12) for k, p in prompts.items()])
    assert scheduler.num_preemptions > 0
    assert all(results[k][0] == expected(p, 12) for k, p in prompts.items())
    assert scheduler.block_manager.num_prefix_cache_hits > 0


def test_failed_steps_keep_refcounts_right_and_outputs_lossless():
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    prompt = list(range(1, 23))
    results = run(scheduler, worker, [make_seq("warm", prompt)])
    worker.fail_once_at_batch = (3, "RESOURCE_EXHAUSTED")  # garbage lands in the step's own slots
    seqs = [make_seq(f"f{i}", prompt + [i] * (i + 1)) for i in range(3)]
    run(scheduler, worker, seqs, results)
    assert scheduler.num_failed_steps == 1
    assert all(results[seq.request_id][0] == expected(seq.prompt_token_ids) for seq in seqs)


def test_a_sequence_that_failed_leaves_nothing_in_the_cache_and_its_prefix_is_computed_again():
    """Its KV may be wrong (the real worker sets an overflowed forward's non-finite values to 0): the blocks it
    cached leave the cache, a sequence that shares them keeps reading them, and the next one computes afresh."""
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    prompt = list(range(1, 23))  # 22 tokens: 5 full blocks, hashed after its first step
    worker.sequence_errors["broken"] = 2  # two tokens, then an error output
    results = run(scheduler, worker, [make_seq("broken", prompt), make_seq("sharer", prompt + [7])])
    assert results["broken"] == (expected(prompt, 2), FinishReason.ERROR)
    assert results["sharer"][0] == expected(prompt + [7])
    manager = scheduler.block_manager
    hits = manager.num_prefix_cache_hits
    assert manager.cached_prefix(make_seq("probe", prompt)) == []  # the sharer had taken the same blocks
    run(scheduler, worker, [make_seq("after", prompt)], results)
    assert results["after"][0] == expected(prompt)
    assert manager.num_prefix_cache_hits == hits and first_work(worker, "after").num_computed_tokens == 0


def test_aborts_release_shared_blocks():
    scheduler = make_scheduler()
    worker = make_worker(scheduler)
    prompt = list(range(1, 23))
    results = run(scheduler, worker, [make_seq("warm", prompt)])
    scheduler.add(make_seq("a", prompt, max_tokens=20))
    scheduler.add(make_seq("b", prompt, max_tokens=20))
    request = scheduler.schedule().request
    collect_events(scheduler.postprocess(request, worker.step_sync(request)), results)
    assert scheduler.block_manager.num_used_blocks == 5 + 2
    assert scheduler.abort("a") and scheduler.abort("b")
    assert scheduler.block_manager.num_used_blocks == 0 and scheduler.block_manager.num_cached_blocks >= 5
    run(scheduler, worker, [make_seq("c", prompt)], results)
    assert results["c"][0] == expected(prompt)


def test_caching_off_computes_everything():
    scheduler = make_scheduler(is_prefix_caching=False)
    worker = make_worker(scheduler)
    prompt = list(range(1, 23))
    results = run(scheduler, worker, [make_seq("a", prompt), make_seq("b", prompt)])
    run(scheduler, worker, [make_seq("c", prompt)], results)
    assert first_work(worker, "c").num_computed_tokens == 0
    assert scheduler.block_manager.num_prefix_cache_queries == 0
    assert results["a"][0] == results["c"][0] == expected(prompt)


@pytest.mark.parametrize("num_right", [0, 2, 5])
async def test_speculation_with_cached_prefixes_stays_lossless(num_right):
    """Tree steps write draft KV past num_computed_tokens and trim: none of it may ever be cached."""
    drafter = FakeDrafter(RULE, VOCAB, num_right)
    speculator = make_speculator(drafter)
    scheduler = make_scheduler(on_end=speculator.forget, drafting=speculator)
    worker = make_worker(scheduler)
    prompts = {"a": [5, 6, 7, 8, 9], "b": [5, 6, 7, 8, 9, 10, 11], "c": [5, 6, 7, 8, 9] + expected([5, 6, 7, 8, 9], 20)}
    results: dict = {}
    for request_id, prompt in prompts.items():  # one after another, so each finds the earlier ones' blocks
        scheduler.add(make_seq(request_id, prompt, max_tokens=20))
        while scheduler.has_work:
            await step(scheduler, speculator, worker, results)
        assert worker.problems == [] and scheduler.block_manager.num_used_blocks == 0
    assert {k: v[0] for k, v in results.items()} == {k: expected(p, 20) for k, p in prompts.items()}
    assert sum(r.num_draft_tokens for r in worker.requests) > 0
    assert first_work(worker, "c").num_computed_tokens >= 20  # a's prompt and output, from the cache


def test_a_sequence_moved_from_a_lost_worker_may_start_past_a_prefix_that_covers_its_output():
    """The new worker's cache holds the prompt and the first outputs (another request with the same tokens ran
    there): the moved sequence starts past them, so its NewSequence must carry every token it has, not just the
    prompt, for the worker to know what it skips."""
    prompt = [5, 6, 7, 8, 9, 10]
    other = make_scheduler()
    other_worker = make_worker(other)
    run(other, other_worker, [make_seq("warm", prompt, max_tokens=8)])  # caches prompt + output blocks
    lost = make_scheduler()
    lost_worker = make_worker(lost)
    lost.add(make_seq("moved", prompt, max_tokens=8))
    for _ in range(4):  # prefill, then 3 decode steps: 4 tokens out
        lost.postprocess(request := lost.schedule().request, lost_worker.step_sync(request))
    (seq,) = lost.evict_all()
    assert seq.num_computed_tokens == 0 and len(seq.output_token_ids) == 4 and not lost.has_work
    other.resume(seq)
    results: dict = {}
    while other.has_work:
        request = other.schedule().request
        collect_events(other.postprocess(request, other_worker.step_sync(request)), results)
    assert other_worker.problems == []
    work = next(work for r in other_worker.requests if any(w.seq_id == "moved" for w in r.sequences)
                for work in r.sequences if work.seq_id == "moved")
    assert work.num_computed_tokens > len(prompt)  # it started inside its own output, from the cache
    assert seq.output_token_ids == expected(prompt, 8)
