"""Architectures beyond the lean decoders' (tests/support/architectures.py): greedy output is transformers'
`generate` with speculation (through the scheduler, the drafter and the worker) and without it, GPT-OSS's
attention sinks included; multi-head latent attention (DeepSeek-V3) is refused at start-up, saying why; an attention
keyword the worker does not implement is an error."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_spec_lossless import TINY_PROMPTS, check_lossless, reference
from tests.support.architectures import build_architecture
from tests.support.devices import TEST_DEVICE
from worker import attention
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner

SERVED = ("phi3", "gemma2", "olmo", "granite", "qwen3_moe", "gpt_oss", "gpt2", "gpt_neox")
REFUSED = {"deepseek_v3": (ValueError, "multi-head latent attention .* is not supported yet")}


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


def test_an_attention_keyword_the_worker_does_not_implement_is_an_error():
    module = torch.nn.Module()
    attention.check_attention_kwargs(module, {"position_ids": None, "sliding_window": 8, "dropout": 0.0})
    with pytest.raises(attention.UnsupportedAttention, match="Module passes s_aux, window_bias to its attention"):
        attention.check_attention_kwargs(module, {"s_aux": torch.zeros(2), "window_bias": 1})
    with pytest.raises(attention.UnsupportedAttention, match="passes dropout"):
        attention.check_attention_kwargs(module, {"dropout": 0.1})
    attention.check_attention_kwargs(module, {"s_aux": torch.zeros(2)}, implemented=frozenset({"s_aux"}))
