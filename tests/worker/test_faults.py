"""Fault isolation: a fault tied to one sequence fails that sequence alone, in the same step.

Eight sequences decode together on the tiny Gemma3; at one step one of them is broken (non-finite
logits at its row, a sampler exception at its row, an invalid tree, an out-of-vocabulary token).
It gets an error output and no tokens, and the seven others produce exactly the tokens they
produce decoding alone. A failure of the whole step (out of memory in the forward) is a gRPC
status instead, and the server keeps serving. A forward that overflowed fails its sequence even
where it samples nothing, and leaves no NaN in the blocks that later sequences take.
"""

from __future__ import annotations

import contextlib
import dataclasses

import grpc
import pytest
import torch

import worker.faults
from protos.segserve.v1 import common_pb2, worker_pb2_grpc
from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from protos.segserve.v1.step_result import StepResult
from protos.segserve.v1.tree import CandidateTree
from tests.worker.test_model_runner import make_runner
from worker.kv_cache import KVCacheShape, PagedKVCache
from worker.server import WorkerServicer, start_server

SEQ_IDS = [f"s{i}" for i in range(8)]
PROMPTS = {s: [1, 10 + 7 * i, 20 + 3 * i, 30 + i, 40 + 5 * i, 50 + i, 60 + 2 * i] for i, s in enumerate(SEQ_IDS)}
BLOCKS = {s: tuple(range(5 * i, 5 * i + 5)) for i, s in enumerate(SEQ_IDS)}
NUM_STEPS = 6
FAULT_STEP = 2
FAULTY = "s3"
GREEDY = {s: SamplingParams() for s in SEQ_IDS}
SEEDED = {s: SamplingParams(do_sample=True, temperature=0.9, top_p=0.95, seed=100 + i) for i, s in enumerate(SEQ_IDS)}


@pytest.fixture(scope="module")
def runner(tiny_gemma3_dir):
    return make_runner(tiny_gemma3_dir)


def no_fault(step: int, works: list[ScheduledSequence]):
    return works, contextlib.nullcontext()


def drive(runner, seq_ids: list[str], params: dict[str, SamplingParams], fault=no_fault
          ) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Decode seq_ids together for NUM_STEPS steps (prefill, then one token per step); a sequence that
    fails is finished in the next step. fault(step, works) -> (works, context to run the step in)."""
    tokens, errors = {s: [] for s in seq_ids}, {}
    new = [NewSequence(s, params[s], len(PROMPTS[s])) for s in seq_ids]
    for step in range(NUM_STEPS):
        works = [_work(s, tokens[s]) for s in seq_ids if s not in errors]
        works, context = fault(step, works)
        with context:
            outputs = runner.step(StepRequest(works, new, finished_seq_ids=list(errors)))
        new = []
        assert [o.seq_id for o in outputs] == [w.seq_id for w in works]
        for out in outputs:
            if out.error:
                assert out.token_ids == () and out.scores == ()
                errors[out.seq_id] = out.error
            else:
                tokens[out.seq_id] += out.token_ids
    runner.step(StepRequest(finished_seq_ids=seq_ids))
    return tokens, errors


def _work(seq_id: str, tokens: list[int]) -> ScheduledSequence:
    prompt = PROMPTS[seq_id]
    if not tokens:
        return ScheduledSequence(seq_id, prompt, 0, BLOCKS[seq_id], sample_indices=(len(prompt) - 1,))
    return ScheduledSequence(seq_id, (tokens[-1],), len(prompt) + len(tokens) - 1, BLOCKS[seq_id],
                             sample_indices=(0,))


@contextlib.contextmanager
def forward_hook(module, hook):
    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def non_finite_logits(runner, value: float):
    """At FAULT_STEP, one entry of the faulty sequence's logits row becomes `value` (NaN or inf)."""
    def fault(step, works):
        if step != FAULT_STEP:
            return works, contextlib.nullcontext()
        row = [w.seq_id for w in works].index(FAULTY)  # one sampled row per sequence in a decode step

        def hook(module, args, output):
            output[0, row, 5] = value  # the logits [1, N, V]

        return works, forward_hook(runner.model.lm_head, hook)  # the output head: under either forward
    return fault


def broken_work(change):
    """At FAULT_STEP, the faulty sequence's work is sent changed."""
    def fault(step, works):
        if step == FAULT_STEP:
            works = [change(w) if w.seq_id == FAULTY else w for w in works]
        return works, contextlib.nullcontext()
    return fault


def failing_sampler(runner, monkeypatch):
    """From FAULT_STEP on, the sampler raises whenever the faulty sequence's row is in its batch, after
    it has sampled every row. Its rows are those holding its state's params (a row without penalties
    carries no history to tell it by)."""
    real = worker.faults.sample
    prompt = PROMPTS[FAULTY]

    def flaky(logits, rows, uniform=None):
        out = real(logits, rows, uniform)
        state = runner._states.get(FAULTY)
        if (state is not None and len(state.history) >= len(prompt) + FAULT_STEP
                and any(r.params is state.params for r in rows)):
            raise RuntimeError("injected sampler failure")
        return out

    monkeypatch.setattr(worker.faults, "sample", flaky)
    return no_fault


@pytest.fixture(scope="module")
def solo(runner):
    """Each sequence decoded alone: greedy and seeded sampling."""
    return {name: {s: drive(runner, [s], params)[0][s] for s in SEQ_IDS}
            for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


FAULTS = {
    "nan-logits": (lambda runner, mp: non_finite_logits(runner, float("nan")), "non-finite logits"),
    "inf-logits": (lambda runner, mp: non_finite_logits(runner, float("inf")), "non-finite logits"),
    "sampler-exception": (lambda runner, mp: failing_sampler(runner, mp), "injected sampler failure"),
    "invalid-tree": (lambda runner, mp: broken_work(lambda w: dataclasses.replace(
        w, sample_indices=(), draft=CandidateTree((1, 2), (-1, 5)))), "invalid draft tree"),
    "out-of-vocab-token": (lambda runner, mp: broken_work(lambda w: dataclasses.replace(
        w, token_ids=(100_000,))), "token_ids"),
}


# Every fault under greedy decoding; under seeded sampling the faults that reach the sampler (the
# others are refused before it, so sampling changes nothing for them).
CASES = [(kind, "greedy") for kind in FAULTS] + [("nan-logits", "seeded"), ("sampler-exception", "seeded")]


@pytest.mark.parametrize(("kind", "sampling"), CASES)
def test_a_faulty_sequence_fails_alone(runner, solo, monkeypatch, kind, sampling):
    make_fault, message = FAULTS[kind]
    params = GREEDY if sampling == "greedy" else SEEDED
    tokens, errors = drive(runner, SEQ_IDS, params, make_fault(runner, monkeypatch))
    assert list(errors) == [FAULTY] and message in errors[FAULTY] and repr(FAULTY) in errors[FAULTY]
    assert tokens[FAULTY] == solo[sampling][FAULTY][:FAULT_STEP]
    for seq_id in SEQ_IDS:
        if seq_id != FAULTY:
            assert tokens[seq_id] == solo[sampling][seq_id], seq_id
    # The worker is left consistent: the faulty sequence was finished, every sequence decodes afresh.
    monkeypatch.undo()
    assert drive(runner, SEQ_IDS, params) == (solo[sampling], {})


def test_the_non_finite_mask_flags_rows_that_cannot_be_sampled():
    logits = torch.randn(6, 300)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("-inf")  # one token masked out, as some models do: a normal row
    logits[3, 299] = float("inf")
    logits[4, 1], logits[4, 2] = float("inf"), float("-inf")
    logits[5, :] = float("-inf")  # nothing left to sample
    assert worker.faults.non_finite_mask(logits).tolist() == [False, True, False, True, True, True]
    assert worker.faults.non_finite_mask(torch.empty(0, 300)).tolist() == []


def test_isolation_keeps_greedy_batch_on_its_fast_path(runner, monkeypatch):
    """No fault: the sampler is called once per step for the whole batch (no row-by-row retries)."""
    calls = []
    real = worker.faults.sample
    monkeypatch.setattr(worker.faults, "sample",
                        lambda logits, rows, uniform=None: calls.append(len(rows)) or real(logits, rows, uniform))
    drive(runner, SEQ_IDS, GREEDY)
    assert calls == [len(SEQ_IDS)] * NUM_STEPS


@pytest.fixture
async def stub(runner):
    server, port = await start_server(WorkerServicer(runner), "127.0.0.1", 0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield worker_pb2_grpc.WorkerStub(channel)
    await server.stop(grace=None)


@pytest.mark.parametrize("error, code", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)"),
     grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RuntimeError("the forward broke (injected)"), grpc.StatusCode.INTERNAL),
])
async def test_a_failed_forward_fails_the_step_and_the_server_keeps_serving(runner, solo, stub, monkeypatch,
                                                                            error, code):
    seq_id = "s0"
    request = StepRequest([_work(seq_id, [])], [NewSequence(seq_id, GREEDY[seq_id], len(PROMPTS[seq_id]))]).to_pb()

    def broken_forward(plan):
        raise error

    monkeypatch.setattr(runner, "execute", broken_forward)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Step(request)
    assert err.value.code() == code and "injected" in err.value.details()
    monkeypatch.undo()
    assert (await stub.Health(common_pb2.HealthRequest())).ready
    # The scheduler retries the same work; the answer is what it would have been.
    (out,) = StepResult.from_pb(await stub.Step(request)).outputs
    assert not out.error and list(out.token_ids) == solo["greedy"][seq_id][:1]
    await stub.Step(StepRequest(finished_seq_ids=[seq_id]).to_pb())



@pytest.mark.parametrize("is_sampled", [True, False], ids=["sampling-step", "prefill-chunk"])
def test_a_sequence_that_overflowed_leaves_no_nan_in_blocks_others_take_later(runner, is_sampled):
    """A forward that goes non-finite fails its sequence, also in a prefill chunk that samples nothing (its
    keys and values are checked); the KV it wrote must not fail the next owner of its blocks, whose attention
    reads the slots past its own tokens (masked, but a NaN value still counts)."""
    size = runner.kv_cache.block_size
    clean = [1, 12, 23, 34][:max(1, size // 2)]  # half a block: the rest of it is read, masked
    expected = runner.step(StepRequest([ScheduledSequence("fresh", clean, 0, (40,), sample_indices=[len(clean) - 1])],
                                       [NewSequence("fresh", SamplingParams(), len(clean))]))[0]
    embeddings = runner.model.get_input_embeddings().weight
    poison, saved = 7, embeddings[7].clone()
    with torch.no_grad():
        embeddings[poison] = float("nan")  # a sequence holding this token overflows from its position on
    broken = [poison] + [5] * (3 * size - 1)
    try:
        (out,) = runner.step(StepRequest(
            [ScheduledSequence("broken", broken, 0, (41, 42, 43), sample_indices=[len(broken) - 1] * is_sampled)],
            [NewSequence("broken", SamplingParams(), len(broken) + (not is_sampled))], finished_seq_ids=["fresh"]))
    finally:
        with torch.no_grad():
            embeddings[poison] = saved
    assert out.error.endswith("non-finite logits (NaN or infinity)" if is_sampled
                              else "non-finite keys or values (NaN or infinity)"), out.error
    # block 41 goes to a new sequence, whose tokens leave the broken sequence's last slots in it
    (reused,) = runner.step(StepRequest(
        [ScheduledSequence("reused", clean, 0, (41,), sample_indices=[len(clean) - 1])],
        [NewSequence("reused", SamplingParams(), len(clean))], finished_seq_ids=["broken"]))
    assert not reused.error and reused.token_ids == expected.token_ids and reused.scores == expected.scores
    runner.step(StepRequest(finished_seq_ids=["reused"]))


def test_clearing_a_block_sets_only_its_non_finite_values_to_zero():
    cache = PagedKVCache(KVCacheShape(num_layers=2, num_kv_heads=2, head_dim=3), num_blocks=4, block_size=2,
                         dtype=torch.float32, device="cpu")
    for layer in range(2):
        cache.keys[layer].normal_()
        cache.values[layer].normal_()
        cache.keys[layer][1, 0, 1, 2] = float("nan")
        cache.values[layer][1, 1, 0, 0] = float("-inf")
        cache.values[layer][3, 0, 0, 0] = float("nan")  # a block not cleared keeps its NaN
    before = [t.clone() for t in (*cache.keys, *cache.values)]
    cache.clear_non_finite(torch.tensor([1, 2]))
    for layer in range(2):
        assert cache.keys[layer][1, 0, 1, 2] == 0 and cache.values[layer][1, 1, 0, 0] == 0
        assert cache.values[layer][3, 0, 0, 0].isnan()
    for old, new in zip(before, (*cache.keys, *cache.values)):
        is_finite = old.isfinite()
        assert torch.equal(new[is_finite], old[is_finite])  # every finite value untouched
