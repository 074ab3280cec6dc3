"""The worker's lean decoders (worker/lean_decoder.py): bit-identical logits to transformers' forward on every kind
of step (on the CPU; within float32 rounding on CUDA), for Gemma3, Llama and Llama's kin (Mistral, Qwen2, Qwen3),
and used only where one exists."""

from __future__ import annotations

import dataclasses
import pytest
import torch
from transformers import AutoModelForCausalLM

from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from protos.segserve.v1.tree import CandidateTree
from worker.forward_path import transformers_decode
from worker.fused_norm import is_known_norm
from worker.lean_decoder import LEAN_DECODERS, lean_decoder
from tests.support.devices import TEST_DEVICE
from tests.worker.test_model_runner import ARCHITECTURES, gemma3_runner, make_runner  # noqa: F401 (fixtures)

PROMPTS = {"a": [1, 50, 60, 70, 80, 90, 100, 33, 21, 7, 140, 200, 201, 202, 203], "b": [9, 8, 7, 6, 5, 4, 3]}
TREE = CandidateTree((12, 250, 31, 99, 140, 5, 64), (-1, -1, 0, 0, 1, 2, 5))


def steps() -> list[StepRequest]:
    """Two prompts prefilled in chunks (every prompt row kept), decodes side by side, then a tree beside a decode
    (two attention groups) past the tiny model's sliding window of 8 keys."""
    blocks = {"a": (20, 3, 44, 9, 30, 1), "b": (7, 12, 50)}
    new = [NewSequence(seq_id, SamplingParams(), len(prompt)) for seq_id, prompt in PROMPTS.items()]
    a, b = PROMPTS["a"], PROMPTS["b"]
    return [
        StepRequest([ScheduledSequence("a", a[:9], 0, blocks["a"], sample_indices=list(range(9))),
                     ScheduledSequence("b", b[:3], 0, blocks["b"], sample_indices=[2])], new),
        StepRequest([ScheduledSequence("a", a[9:], 9, blocks["a"], sample_indices=list(range(6))),
                     ScheduledSequence("b", b[3:], 3, blocks["b"], sample_indices=[3])]),
        StepRequest([ScheduledSequence("a", [77], 15, blocks["a"], sample_indices=[0]),
                     ScheduledSequence("b", [78], 7, blocks["b"], sample_indices=[0])]),
        StepRequest([ScheduledSequence("a", [79], 16, blocks["a"], draft=TREE),
                     ScheduledSequence("b", [80], 8, blocks["b"], sample_indices=[0])]),
    ]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def varied_runner(request, tmp_path_factory):
    """A runner of each architecture whose norms all have weights of their own: a tiny model's are all equal (0 or
    1), under which norms mixed up with one another would go unnoticed."""
    out = tmp_path_factory.mktemp(f"varied-{request.param}")
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(f"tiny_{request.param}_dir"),
                                                 dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            if is_known_norm(module):
                module.weight.normal_(0.0, 0.5, generator=generator)
    model.save_pretrained(out)
    return make_runner(out)


def test_the_lean_forward_gives_transformers_logits_bit_for_bit(varied_runner):
    runner = varied_runner
    lean = runner.path
    assert type(lean.decode) is LEAN_DECODERS[type(runner.model).__name__]  # the default
    stock = dataclasses.replace(lean, decode=transformers_decode(runner.model))
    try:
        for request in steps():
            plan = runner.update_states(request)
            runner.path = lean
            expected_rows = plan.num_sample_rows
            lean_logits = runner.execute(plan)
            lean_non_finite = plan.non_finite_tokens.clone()
            runner.path = stock  # transformers' forward, on the same plan (it writes the same keys and values)
            stock_logits = runner.execute(plan)
            assert lean_logits.shape[0] >= expected_rows > 0
            if TEST_DEVICE == "cpu":
                assert torch.equal(lean_logits, stock_logits)
            else:  # a CUDA F.rms_norm is one kernel, which may round a weighted norm otherwise than norm, then weight
                torch.testing.assert_close(lean_logits, stock_logits)
            assert torch.equal(lean_non_finite, plan.non_finite_tokens)
    finally:
        runner.path = lean
        runner.step(StepRequest(finished_seq_ids=list(PROMPTS)))


def test_the_default_gemma3_runner_never_calls_transformers_forward(gemma3_runner, monkeypatch):  # noqa: F811
    def refuse(*args, **kwargs):
        raise AssertionError("transformers' forward was called")

    monkeypatch.setattr(type(gemma3_runner.model), "forward", refuse)
    request = StepRequest([ScheduledSequence("c", [5, 6, 7], 0, (2,), sample_indices=[2])],
                          [NewSequence("c", SamplingParams(), 3)])
    try:
        (output,) = gemma3_runner.step(request)
        assert not output.error and len(output.token_ids) == 1
    finally:
        gemma3_runner.step(StepRequest(finished_seq_ids=["c"]))


def test_other_models_and_the_flag_off_keep_transformers_forward(tiny_gemma3_dir):
    class GPT2LMHeadModel(torch.nn.Module):  # a class with no lean decoder
        pass

    assert lean_decoder(GPT2LMHeadModel()) is None
    off = make_runner(tiny_gemma3_dir, is_lean_decoder=False)
    assert not off.choice.is_lean and off.path.graphs is None
    (output,) = off.step(StepRequest([ScheduledSequence("d", [5, 6, 7], 0, (2,), sample_indices=[2])],
                                     [NewSequence("d", SamplingParams(), 3)]))
    assert not output.error
