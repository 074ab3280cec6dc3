"""Every architecture the worker is known to serve or refuse (tests/support/architectures.py), never wrong.

Served ones: the start-up self-check passes, each takes the path the matrix says (a lean decoder or transformers'
own modules), and greedy output is transformers' `generate` with speculation (through the scheduler, the drafter
and the worker) and without it. Refused ones fail at start-up with an error that says why: attention that never
calls the attention interface (Bloom), state besides attention's keys and values (LFM2's convolutions, Falcon-H1's
Mamba mixers). Mutations of the worker's attention (sinks dropped, an attention keyword unknown) are caught. The
docs' table of architectures (docs/engine.md) is this matrix, rendered by architecture_table()."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_spec_lossless import TINY_PROMPTS, check_lossless, reference
from tests.support.architectures import DISPLAY_NAMES, LEAN, build_architecture
from tests.support.devices import TEST_DEVICE
from worker import attention
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner
from worker.self_check import SelfCheckFailed

PLAIN = ("phi3", "gemma2", "olmo", "granite", "qwen3_moe", "gpt_oss", "gpt2", "gpt_neox", "deepseek_v3")
"""Served through transformers' own modules under the paged attention."""
NOTES = {"gemma3": "sliding window, normed queries and keys", "llama": "grouped-query attention",
         "mistral": "sliding window", "qwen2": "biased projections, sliding window",
         "qwen3": "normed queries and keys, sliding window", "phi3": "fused projections",
         "gemma2": "soft-capped attention and logits, sliding window", "olmo": "non-parametric norms",
         "granite": "embedding, residual and logit multipliers", "qwen3_moe": "mixture of experts",
         "gpt_oss": "attention sinks, sliding window, mixture of experts", "gpt2": "learned positions",
         "gpt_neox": "partial rotary, parallel residual",
         "deepseek_v3": "multi-head latent attention (keys and values cached expanded), mixture of experts"}
"""What each served architecture brings that the worker's path carries."""
REFUSED = {
    "bloom": "its attention never calls the attention interface, so it would run unmasked",
    "lfm2": r"keeps state besides attention's keys and values \(Conv1d, Lfm2ShortConv\)",
    "falcon_h1": r"keeps state besides attention's keys and values \(Conv1d, FalconH1Mixer\)",
}
"""Refused at start-up by the self-check (SelfCheckFailed), with these words."""


def runner_of(model_dir, **fields) -> ModelRunner:
    runner = ModelRunner(WorkerConfig(model=str(model_dir), num_kv_blocks=256, block_size=4, dtype="float32",
                                      device=TEST_DEVICE, **fields))
    runner.warm_up()
    return runner


@pytest.fixture(scope="module", params=LEAN + PLAIN)
def served(request, tmp_path_factory):
    model_dir = build_architecture(request.param, tmp_path_factory.mktemp(request.param))
    runner = runner_of(model_dir)
    assert runner.is_lean == (request.param in LEAN)  # the path the table says
    return model_dir, runner


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
            # eos_token_id=None: neither stop at EOS nor suppress it, as the decoders here (min_new_tokens would
            # suppress it: another continuation once greedy picks EOS)
            generated = model.generate(torch.tensor([prompt], device=runner.device), do_sample=False,
                                       max_new_tokens=12, eos_token_id=None)
        assert outputs[seq_id] == generated[0, len(prompt):].tolist(), seq_id


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_an_unsupported_architecture_is_refused_at_start_up_saying_why(name, tmp_path):
    with pytest.raises(SelfCheckFailed, match=REFUSED[name]):
        runner_of(build_architecture(name, tmp_path / name))


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


def architecture_table() -> str:
    """The docs' table of architectures (docs/engine.md), rendered from this module's matrix."""
    rows = ["| Architecture | Served by | Speculation | What it brings |", "|---|---|---|---|"]
    for name in LEAN + PLAIN:
        path = "lean decoder" if name in LEAN else "transformers' modules, paged attention"
        rows.append(f"| {DISPLAY_NAMES[name]} | {path} | lossless | {NOTES.get(name, '')} |")
    for name, why in REFUSED.items():
        reason = why.replace("\\", "").split(", so")[0]
        rows.append(f"| {DISPLAY_NAMES[name]} | refused at start-up | | {reason} |")
    return "\n".join(rows) + "\n"


def test_the_docs_table_is_this_matrix():
    from pathlib import Path

    docs = (Path(__file__).parents[2] / "docs" / "engine.md").read_text()
    assert architecture_table() in docs, "docs/engine.md's table of architectures:\n" + architecture_table()
