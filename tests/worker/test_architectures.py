"""Architectures beyond the lean decoders' (tests/support/architectures.py), served or refused, never wrong.

Served ones: the start-up self-check passes, and greedy output is transformers' `generate` with speculation
(through the scheduler, the drafter and the worker) and without it. Refused ones fail at start-up with an error that
says why: attention that never calls the attention interface (Bloom), state besides attention's keys and values
(LFM2's convolutions, Falcon-H1's Mamba mixers), multi-head latent attention (DeepSeek-V3). Mutations of the worker's
attention (sinks dropped, an attention keyword unknown) are caught."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_spec_lossless import TINY_PROMPTS, check_lossless, reference
from tests.support.architectures import DISPLAY_NAMES, build_architecture
from tests.support.devices import TEST_DEVICE
from worker import attention
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner
from worker.self_check import SelfCheckFailed

SERVED = ("phi3", "gemma2", "olmo", "granite", "qwen3_moe", "gpt_oss", "gpt2", "gpt_neox")
REFUSED_BY_SELF_CHECK = ("bloom", "lfm2", "falcon_h1")
REFUSED = {
    "bloom": (SelfCheckFailed, "its attention never calls the attention interface, so it would run unmasked"),
    "lfm2": (SelfCheckFailed, r"keeps state besides attention's keys and values \(Conv1d, Lfm2ShortConv\)"),
    "falcon_h1": (SelfCheckFailed, r"keeps state besides attention's keys and values \(Conv1d, FalconH1Mixer\)"),
    "deepseek_v3": (ValueError, "multi-head latent attention .* is not supported yet"),
}


def runner_of(model_dir, **fields) -> ModelRunner:
    runner = ModelRunner(WorkerConfig(model=str(model_dir), num_kv_blocks=256, block_size=4, dtype="float32",
                                      device=TEST_DEVICE, **fields))
    runner.warm_up()
    return runner


@pytest.fixture(scope="module", params=SERVED)
def served(request, tmp_path_factory):
    model_dir = build_architecture(request.param, tmp_path_factory.mktemp(request.param))
    return model_dir, runner_of(model_dir)


async def test_a_served_architecture_is_transformers_greedy_with_speculation(served):
    model_dir, runner = served
    assert runner.is_ready  # the self-check passed
    await check_lossless(runner, model_dir, reference(model_dir, TINY_PROMPTS, 16), "best_first", "corpus", 16)


def test_a_served_architecture_is_transformers_greedy_without_speculation(served):
    from transformers import AutoModelForCausalLM

    from tests.worker.test_model_runner import Decoder, run_together

    model_dir, runner = served
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model = model.to(runner.device).eval()
    prompts = {f"p{i}": [(11 * i + 5 * j + 3) % 300 for j in range(6 + 3 * i)] for i in range(3)}
    decoders = [Decoder(seq_id, prompt, list(range(8 * i, 8 * i + 8)), chunks=[3, len(prompt) - 3])
                for i, (seq_id, prompt) in enumerate(prompts.items())]
    outputs = run_together(runner, decoders, 12)
    for seq_id, prompt in prompts.items():
        with torch.inference_mode():
            generated = model.generate(torch.tensor([prompt], device=runner.device), do_sample=False,
                                       max_new_tokens=12, min_new_tokens=12)
        assert outputs[seq_id] == generated[0, len(prompt):].tolist(), seq_id


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_an_unsupported_architecture_is_refused_at_start_up_saying_why(name, tmp_path):
    model_dir = build_architecture(name, tmp_path / name)
    error, message = REFUSED[name]
    with pytest.raises(error, match=message):
        runner_of(model_dir)


def test_the_self_check_can_be_skipped(tmp_path):
    runner = runner_of(build_architecture("lfm2", tmp_path / "lfm2"), is_skip_self_check=True)
    assert runner.is_ready


def test_dropping_the_sinks_is_caught_by_the_self_check(tmp_path, monkeypatch):
    """The mutation check: GPT-OSS served as if it had no attention sinks."""
    model_dir = build_architecture("gpt_oss", tmp_path / "gpt_oss")
    original = attention._attend
    monkeypatch.setattr(attention, "_attend", lambda *args: original(*args[:6]))  # sinks never reach the kernel
    with pytest.raises(SelfCheckFailed, match="GptOssForCausalLM is not served.*position 0 \\(the prompt\\)"):
        runner_of(model_dir)


def test_an_attention_keyword_the_worker_does_not_implement_is_an_error():
    module = torch.nn.Module()
    attention.check_attention_kwargs(module, {"position_ids": None, "sliding_window": 8, "dropout": 0.0})
    with pytest.raises(attention.UnsupportedAttention, match="Module passes s_aux, window_bias to its attention"):
        attention.check_attention_kwargs(module, {"s_aux": torch.zeros(2), "window_bias": 1})
    with pytest.raises(attention.UnsupportedAttention, match="passes dropout"):
        attention.check_attention_kwargs(module, {"dropout": 0.1})
    attention.check_attention_kwargs(module, {"s_aux": torch.zeros(2)}, implemented=frozenset({"s_aux"}))


def architecture_lists() -> str:
    """The docs' lists of served and refused architectures (docs/engine.md), rendered from this module's matrix."""
    from worker.lean_decoder import LEAN_DECODERS

    lean = ", ".join(name.removesuffix("ForCausalLM").replace("Gemma3", "Gemma 3") for name in LEAN_DECODERS)
    served = ", ".join(DISPLAY_NAMES[name] for name in SERVED)
    by_check = ", ".join(DISPLAY_NAMES[name] for name in REFUSED_BY_SELF_CHECK)
    others = ", ".join(DISPLAY_NAMES[name] for name in REFUSED if name not in REFUSED_BY_SELF_CHECK)
    return (f"- **Served:** {served}, besides the lean decoders ({lean}).\n"
            f"- **Refused at start-up:** {by_check} (self-check), {others} (latent attention).\n")


def test_the_docs_list_the_architectures_this_matrix_checks():
    import textwrap
    from pathlib import Path

    assert set(REFUSED_BY_SELF_CHECK) == {name for name, (error, _) in REFUSED.items() if error is SelfCheckFailed}
    docs = " ".join((Path(__file__).parents[2] / "docs" / "engine.md").read_text().split())
    for line in architecture_lists().splitlines():
        assert " ".join(line.split()) in docs, textwrap.fill(line, 90)
