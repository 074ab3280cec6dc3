"""A lean decoder's layers compiled around their paged attention (worker/compiled_layers.py): one compile for every
layer and token count, logits within rounding of the eager layers, rows independent of their batch, decode steps on
static buffers (CUDA graphs on a GPU) that give the runner's other steps' logits bit for bit, and greedy
speculation that is lossless against the same runner's plain greedy decoding.

On the test device: on the CPU the compiled kernels are inductor's C++ ones, on CUDA its Triton ones."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from tests.support.devices import TEST_DEVICE
from tests.support.exact import assert_as_exact_as, exact_last_logits
from tests.worker.test_decode_graphs import logits_of_each_step, prompts
from tests.worker.test_verify import oracle_tree, random_tree, spec_decode
from tests.worker.test_model_runner import (
    PROMPT, ROOT_TOKEN, TREE, Decoder, _prefill_logits, assert_batch_invariant, logits_of, make_runner,
    prefill_rows, run_together,
)
from worker.attention_plan import graph_bucket_keys
from worker.compiled_layers import CompiledRegion
from worker.lean_decoder import LeanGemma3, before_attention

NUM_BLOCKS = 320
ARCHITECTURES = ("gemma3", "llama", "qwen3")
"""Gemma3 (four norms, query and key norms, sliding and full layers), Llama (two norms) and Qwen3 (Llama's layers
with query and key norms); Mistral and Qwen2 differ from Llama in their attention's window only."""


@pytest.fixture(scope="module", params=ARCHITECTURES)
def runners(request):
    """A runner with compiled layers and decode graphs, one with compiled layers whose eager steps pad key lengths
    as the graphs do (the reference for its logits, bit for bit), and one with eager layers."""
    model_dir = request.getfixturevalue(f"tiny_{request.param}_dir")
    graphs = make_runner(model_dir, NUM_BLOCKS, is_compiled_layers=True, is_cuda_graphs=True)
    compiled = make_runner(model_dir, NUM_BLOCKS, is_compiled_layers=True, is_cuda_graphs=False)
    compiled.path = dataclasses.replace(compiled.path, key_bucket=graph_bucket_keys)
    eager = make_runner(model_dir, NUM_BLOCKS, is_compiled_layers=False, is_cuda_graphs=False)
    return graphs, compiled, eager


def test_the_layers_run_compiled(runners):
    graphs, compiled, eager = runners
    for runner in (graphs, compiled):
        assert isinstance(runner.path.decode.before_attention, CompiledRegion)
        assert isinstance(runner.path.decode.after_attention, CompiledRegion)
    assert not isinstance(eager.path.decode.before_attention, CompiledRegion)


def test_one_compile_serves_every_layer_and_token_count(tiny_gemma3_dir):
    """Prefills of 1 to 11 tokens, decode steps of 1 to 5 sequences and a tree, through every layer (sliding and
    full): each region's code compiled at most once more (none if another runner here compiled it already)."""
    codes = (before_attention.__code__, LeanGemma3.after_attention.__code__)
    before = [len(_debug_get_cache_entry_list(code)) for code in codes]
    runner = make_runner(tiny_gemma3_dir, NUM_BLOCKS, is_compiled_layers=True)
    for num_tokens in range(1, 12):
        _prefill_logits(runner, "p", PROMPT[:num_tokens], [0, 1, 2])
    for num_sequences in range(1, 6):
        logits_of_each_step(runner, prompts(num_sequences)[:num_sequences], 2)
    blocks = (4, 5, 6, 7, 8)
    new = NewSequence("t", SamplingParams(), len(PROMPT))
    runner.step(StepRequest([ScheduledSequence("t", PROMPT, 0, blocks)], [new]))
    logits_of(runner, StepRequest([ScheduledSequence("t", (ROOT_TOKEN,), len(PROMPT), blocks, draft=TREE)]))
    runner.step(StepRequest(finished_seq_ids=["t"]))
    after = [len(_debug_get_cache_entry_list(code)) for code in codes]
    assert [a - b for a, b in zip(after, before)] in ([0, 0], [1, 1])
    assert after[0] >= 1 and after[1] >= 1


def test_logits_are_the_eager_layers_within_rounding(runners):
    _, compiled, eager = runners
    tokens = PROMPT + [3, 4, 5, 6]
    got, expected = _prefill_logits(compiled, "a", tokens, [0, 1, 2, 3, 4]), _prefill_logits(eager, "a", tokens,
                                                                                                [0, 1, 2, 3, 4])
    assert_as_exact_as(got, expected, exact_last_logits(eager.config.model, prefill_rows(tokens)))


def test_batch_invariance(runners):
    for runner in runners[:2]:
        assert_batch_invariant(runner)


@pytest.mark.parametrize("num_sequences", [1, 3, 13])
def test_decode_steps_on_static_buffers_give_the_runners_logits(runners, num_sequences):
    """Batches padded to 1, 4 and 16 rows (graphs replayed on CUDA): every row's logits are those of the same
    compiled layers' eager step, bit for bit."""
    graphs, compiled, _ = runners
    batch = prompts(num_sequences)
    for step, (want, have) in enumerate(zip(logits_of_each_step(compiled, batch, 6),
                                            logits_of_each_step(graphs, batch, 6))):
        assert torch.equal(want, have), f"decode step {step}"
    assert min(key[0] for key in graphs.path.graphs.keys) == 2  # one sequence goes padded to two rows, as two tokens


def test_greedy_speculation_is_lossless(runners):
    """Trees verified in eager steps accept what the runner's plain greedy decoding (on the graphs) chose: random
    trees, and oracle chains of its own continuation, which must be accepted in full."""
    graphs = runners[0]
    num_new, vocab = 16, graphs.info().vocab_size
    plain = run_together(graphs, [Decoder("p", PROMPT, list(range(3, 19)))], num_new + 4)["p"]
    rng = random.Random(0)
    got, _ = spec_decode(graphs, PROMPT, num_new, lambda _: random_tree(rng, vocab))
    assert got == plain[:num_new]
    propose = lambda context: oracle_tree(plain[len(context) - len(PROMPT):][:3], vocab)
    got, num_steps = spec_decode(graphs, PROMPT, num_new, propose)
    assert got == plain[:num_new] and num_steps <= num_new // 3


def test_two_runners_of_one_class_each_run_their_own_weights(tiny_gemma3_dir, tmp_path):
    """The compiled code is shared by every runner of the class (the weights are its inputs): each still computes
    with its own."""
    from tests.support.tiny_models import build_tiny_gemma3

    other_dir = build_tiny_gemma3(tmp_path / "other", seed=1)
    for model_dir in (tiny_gemma3_dir, other_dir):
        compiled = make_runner(model_dir, 16, is_compiled_layers=True)
        eager = make_runner(model_dir, 16, is_compiled_layers=False, is_cuda_graphs=False)
        exact = exact_last_logits(model_dir, prefill_rows(PROMPT))
        assert_as_exact_as(_prefill_logits(compiled, "a", PROMPT, [0, 1, 2]),
                           _prefill_logits(eager, "a", PROMPT, [0, 1, 2]), exact)


def _scaled_rows(calls, x):
    return x * calls + x.sum(-1, keepdim=True)


def test_a_region_takes_one_token_as_two_and_compiles_again_for_inputs_of_another_kind():
    """One token goes through the code compiled for any count, and comes back as one; a later call of another dtype
    gets code of its own (dynamo refuses to compile under the stance that skips guards: the region then calls
    again with every guard)."""
    region = CompiledRegion(_scaled_rows, (1,), (1,), "test")
    many = torch.randn(1, 5, 4, device=TEST_DEVICE)
    for x in (many, many[:, :1], many.double()):
        got = region(2.0, x)
        assert got.shape == x.shape and got.dtype == x.dtype
        torch.testing.assert_close(got, _scaled_rows(2.0, x))


def test_a_region_that_cannot_be_compiled_runs_eagerly_from_then_on(monkeypatch, caplog):
    """As without a C compiler for Triton's launcher: the worker is slower, not failed, and says so."""
    region = CompiledRegion(_scaled_rows, (1,), (1,), "test")

    def fail(*args):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(region, "_compiled", fail)
    x = torch.randn(1, 3, 4, device=TEST_DEVICE)
    with caplog.at_level("ERROR", logger="worker.compiled_layers"):
        for tokens in (x, x[:, :1], x):
            assert torch.equal(region(2.0, tokens), _scaled_rows(2.0, tokens))
    assert [record.getMessage() for record in caplog.records] == [
        "the layers' test could not be compiled, so they run eagerly: RuntimeError: Failed to find C compiler"]


def test_compiled_code_is_kept_per_instruction_set_unless_the_deployment_names_a_cache(monkeypatch):
    """Inductor's cache does not tell kernels compiled under ATEN_CPU_CAPABILITY=avx2 from the machine's own: one
    folder per capability, so a run under the AVX2 variables (docs/development.md) cannot abort a later run."""
    from worker.loading import keep_compiled_code_per_isa

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    own = os.path.join(default_cache_dir(), torch._C._get_cpu_capability().lower())
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    keep_compiled_code_per_isa()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == own
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what torch writes there once asked
    keep_compiled_code_per_isa()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == own
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/srv/inductor")
    keep_compiled_code_per_isa()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/srv/inductor"
