"""Every architecture the worker is known to serve or refuse (tests/support/architectures.py), never wrong.

Served ones: the start-up self-check passes, each takes the path the matrix says (a lean decoder or transformers'
own modules), and greedy output is transformers' `generate` with speculation (through the scheduler, the drafter and
the worker) and without it. A model with state besides the KV cache (LFM2's convolutions, the Mamba mixers of Jamba,
Falcon-H1, Bamba and Granite 4.0, Qwen3-Next's gated delta rule) is served with speculation, a tree's accepted path
leaving its state, and without shared prefixes, which the scheduler then never sends. Refused ones fail at start-up
with an error that says why: attention that never calls the attention interface (Bloom). Mutations (sinks dropped,
an attention keyword unknown, state not carried) are caught. The docs' table of architectures (docs/engine.md) is
this matrix, rendered by architecture_table()."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from protos.segserve.v1 import scheduler_pb2
from protos.segserve.v1.generate import FinishReason, GenerateComplete
from tests.e2e.test_spec_lossless import (
    TINY_PROMPTS,
    check_lossless,
    corpus_texts,
    reference,
    speculative_stack,
)
from tests.scheduler.test_service import collect, generate_request
from tests.support.architectures import DISPLAY_NAMES, LEAN, build_architecture
from tests.support.devices import TEST_DEVICE
from worker import attention, sequence_state
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner
from worker.self_check import SelfCheckFailed

PLAIN = ("phi3", "gemma2", "olmo", "granite", "qwen3_moe", "gpt_oss", "gpt2", "gpt_neox", "deepseek_v2", "deepseek_v3",
         "lfm2", "jamba", "falcon_h1", "qwen3_next", "bamba", "granitemoehybrid")
"""Served through transformers' own modules under the paged attention."""
NO_PREFIXES = ("lfm2", "jamba", "falcon_h1", "qwen3_next", "bamba", "granitemoehybrid")
"""Served without shared prefixes: state besides the KV cache runs from token to token, and none is kept for a
prefix (worker/sequence_state.py)."""
NOTES = {"gemma3": "sliding window, normed queries and keys", "llama": "grouped-query attention",
         "mistral": "sliding window", "qwen2": "biased projections, sliding window",
         "qwen3": "normed queries and keys, sliding window", "phi3": "fused projections",
         "gemma2": "soft-capped attention and logits, sliding window", "olmo": "non-parametric norms",
         "granite": "embedding, residual and logit multipliers", "qwen3_moe": "mixture of experts",
         "gpt_oss": "attention sinks, sliding window, mixture of experts", "gpt2": "learned positions",
         "gpt_neox": "partial rotary, parallel residual",
         "deepseek_v2": "multi-head latent attention (keys and values cached expanded), mixture of experts",
         "deepseek_v3": "multi-head latent attention (the latent cached), mixture of experts",
         "lfm2": "short convolutions, their state carried per sequence; no KV cache in their layers",
         "jamba": "Mamba layers (state carried per sequence; no KV cache in them), mixture of experts",
         "falcon_h1": "attention and a Mamba-2 mixer side by side in every layer, the mixer's state carried per "
                      "sequence",
         "qwen3_next": "gated delta rule layers (state carried per sequence; no KV cache in them), gated attention",
         "bamba": "Mamba-2 layers (state carried per sequence; no KV cache in them)",
         "granitemoehybrid": "Mamba-2 layers (state carried per sequence; no KV cache in them)"}
"""What each served architecture brings that the worker's path carries."""
REFUSED = {
    "bloom": "its attention never calls the attention interface, so it would run unmasked",
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
    assert runner.choice.is_lean == (request.param in LEAN)  # the path the table says
    assert bool(runner.info().sequence_state_reason) == (request.param in NO_PREFIXES)
    return model_dir, runner


async def test_a_served_architecture_is_transformers_greedy_with_speculation(served):
    model_dir, runner = served
    assert runner.is_ready  # the self-check passed
    references = reference(model_dir, TINY_PROMPTS, 16)
    await check_lossless(runner, model_dir, references, "best_first", "corpus", 16)
    if not runner.info().sequence_state_reason:
        return
    # a model with sequence state: the same prompts twice, and the second time no prefix is shared
    async with speculative_stack(runner, model_dir, "best_first", "corpus", corpus_texts(references)) as stub:
        for _ in range(2):
            requests = [generate_request(f"r{i}", prompt_ids, max_tokens=16)
                        for i, (prompt_ids, _) in enumerate(references.values())]
            results = await asyncio.gather(*(collect(stub, r) for r in requests))
            for (tokens, last), (prompt_ids, expected) in zip(results, references.values()):
                assert isinstance(last, GenerateComplete) and last.finish_reason is not FinishReason.ERROR, last
                assert tokens == expected
        stats = await stub.GetStats(scheduler_pb2.StatsRequest())
    assert stats.num_prefix_cache_hits == 0 and stats.spec.num_accepted_tokens > 0


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
    with pytest.raises(SelfCheckFailed, match=REFUSED[name]) as refused:
        runner_of(build_architecture(name, tmp_path / name))
    assert "from layer 0 (" in str(refused.value)  # where the paths part: each one's first layer already


def test_the_self_check_can_be_skipped(tmp_path):
    runner = runner_of(build_architecture("bloom", tmp_path / "bloom"), is_self_check=False)
    assert runner.is_ready


@pytest.mark.parametrize(("name", "modules"), [("jamba", "Conv1d, JambaMambaDecoderLayer, JambaMambaMixer"),
                                               ("falcon_h1", "Conv1d, FalconH1Mixer"),
                                               ("qwen3_next", "Conv1d, Qwen3NextGatedDeltaNet"),
                                               ("bamba", "BambaMixer, Conv1d"),
                                               ("granitemoehybrid", "Conv1d, GraniteMoeHybridMambaLayer"),
                                               ("lfm2", "Conv1d, Lfm2ShortConv")])
def test_state_not_carried_is_caught_by_the_self_check(name, modules, tmp_path, monkeypatch):
    """The mutation check for state: with the stateful layers left as transformers has them (no per-sequence
    state), the worker refuses the model, naming the modules that keep it."""
    monkeypatch.setattr(sequence_state, "attach", lambda model: None)
    with pytest.raises(SelfCheckFailed, match=rf"keeps state besides attention's keys and values \({modules}\)"):
        runner_of(build_architecture(name, tmp_path / name))


@pytest.mark.parametrize("layers", [(0, 1), (1,)])
def test_dropping_the_sinks_is_caught_by_the_self_check(layers, tmp_path, monkeypatch):
    """The mutation check: GPT-OSS served as if it had no attention sinks, in every layer or in its second only;
    the error names the first layer whose output parts from transformers'."""
    model_dir = build_architecture("gpt_oss", tmp_path / "gpt_oss")
    original = attention._attend_group

    def attend_group(group, tokens_query, cache, layer, *rest):
        return original(group, tokens_query, cache, layer, *rest[:3]) if layer in layers else original(
            group, tokens_query, cache, layer, *rest)  # rest[3]: the sinks, which never reach the kernel

    monkeypatch.setattr(attention, "_attend_group", attend_group)
    with pytest.raises(SelfCheckFailed, match=f"GptOssForCausalLM is not served.*position 0 \\(the prompt\\).*"
                                              f"from layer {layers[0]} \\(GptOssDecoderLayer\\) on"):
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
        speculation = "lossless, no shared prefixes" if name in NO_PREFIXES else "lossless"
        rows.append(f"| {DISPLAY_NAMES[name]} | {path} | {speculation} | {NOTES.get(name, '')} |")
    for name, why in REFUSED.items():
        reason = why.replace("\\", "").split(", so")[0]
        rows.append(f"| {DISPLAY_NAMES[name]} | refused at start-up | | {reason} |")
    return "\n".join(rows) + "\n"


def test_the_docs_table_is_this_matrix():
    from pathlib import Path

    docs = (Path(__file__).parents[2] / "docs" / "engine.md").read_text()
    assert architecture_table() in docs, "docs/engine.md's table of architectures:\n" + architecture_table()


def test_deepseek_v3_caches_its_latent_and_deepseek_v2_the_expanded_keys_and_values(tmp_path):
    """DeepSeek-V3's KV cache holds one head per token: its latent and rotary key (kv_lora_rank + qk_rope_head_dim
    16 + 8) and the latent again as the value (16); DeepSeek-V2's, every head's expanded key (16 + 8) and value (16)."""
    from worker.kv_cache import KVCacheShape

    v3 = runner_of(build_architecture("deepseek_v3", tmp_path / "v3"))
    assert v3.kv_cache.shape == KVCacheShape(2, num_kv_heads=1, head_dim=24, value_head_dim=16)
    v2 = runner_of(build_architecture("deepseek_v2", tmp_path / "v2"))
    assert v2.latent is None and v2.kv_cache.shape == KVCacheShape(2, num_kv_heads=4, head_dim=24, value_head_dim=16)


@pytest.mark.parametrize(("name", "layer_kv_heads", "stateful"), [
    ("lfm2", (0, 2), "[0] (Lfm2ShortConv)"), ("jamba", (0, 2), "[0] (JambaMambaMixer)"),
    ("falcon_h1", (2, 2), "[0, 1] (FalconH1Mixer)"), ("qwen3_next", (0, 2), "[0] (Qwen3NextGatedDeltaNet)"),
    ("bamba", (0, 2), "[0] (BambaMixer)"), ("granitemoehybrid", (0, 2), "[0] (GraniteMoeHybridMambaLayer)")])
def test_a_model_with_sequence_state_keeps_the_accepted_paths_state(name, layer_kv_heads, stateful, tmp_path):
    """A tree step whose accepted path is neither its last node nor its first leaves the sequence the state of
    that path; a first step past a prefix (as a cached one would be) is refused whole before anything changes; the
    next steps are transformers' greedy output, through a preemption (the sequence computed again from position 0
    into other blocks) too."""
    from transformers import AutoModelForCausalLM

    from protos.segserve.v1.sampling import SamplingParams
    from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
    from protos.segserve.v1.tree import CandidateTree
    from worker.validation import InvalidRequest

    model_dir = build_architecture(name, tmp_path / name)
    runner = runner_of(model_dir)
    assert runner.kv_cache.shape.layer_kv_heads == layer_kv_heads  # no KV cache in a layer without attention
    assert [keys.numel() > 0 for keys in runner.kv_cache.keys] == [heads > 0 for heads in layer_kv_heads]
    assert runner.info().sequence_state_reason.startswith(f"its layers {stateful} keep a state")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(runner.device).eval()
    prompt = [5, 17, 42, 7, 99, 3]
    with torch.inference_mode():
        expected = model.generate(torch.tensor([prompt], device=runner.device), do_sample=False, max_new_tokens=9,
                                  eos_token_id=None)[0, len(prompt):].tolist()
    first = runner.step(StepRequest([ScheduledSequence("a", prompt, 0, (0, 1), sample_indices=[len(prompt) - 1])],
                                    [NewSequence("a", SamplingParams(), len(prompt))]))
    tokens = list(first[0].token_ids)
    if name == "lfm2":  # its one convolution layer keeps its last conv_L_cache inputs of each channel, in fp32
        config = model.config
        assert runner.sequence_states.nbytes("a") == config.hidden_size * config.conv_L_cache * 4
    # after the root: a wrong sibling first, then the right token with a wrong child: one node accepted (the
    # second of three), and the sampled token after it
    wrong = [(token + 1) % 300 for token in expected[1:3]]
    tree = CandidateTree((wrong[0], expected[1], wrong[1]), (-1, -1, 1))
    out = runner.step(StepRequest([ScheduledSequence("a", tokens[-1:], len(prompt), (0, 1, 2), draft=tree)]))
    assert list(out[0].token_ids) == expected[1:3]
    tokens += out[0].token_ids
    past_prefix = ScheduledSequence("b", prompt[4:], 4, (3,))
    with pytest.raises(InvalidRequest, match="'b' starts at token 4, where it has no saved state"):
        runner.step(StepRequest([past_prefix], [NewSequence("b", SamplingParams(), len(prompt))]))

    def decode(blocks: tuple[int, ...]) -> None:
        tokens.extend(runner.step(StepRequest([ScheduledSequence("a", tokens[-1:], len(prompt) + len(tokens) - 1,
                                                                 blocks, sample_indices=[0])]))[0].token_ids)

    for _ in range(4):
        decode((0, 1, 2, 3))
    # preempted, as the scheduler does it: everything so far computed again from position 0 (its logits are
    # transformers' at every position, so no state of before leaks in), then decoding on
    known = prompt + tokens
    logits = runner.forward(StepRequest([ScheduledSequence("a", known, 0, (4, 5, 6, 7),
                                                           sample_indices=list(range(len(known))))]))
    with torch.inference_mode():
        reference_logits = model(torch.tensor([known], device=runner.device)).logits[0].float()
    torch.testing.assert_close(logits, reference_logits, atol=1e-4, rtol=1e-4)
    tokens.append(int(logits[-1].argmax()))
    decode((4, 5, 6, 7))
    assert tokens == expected


def test_a_failed_step_forgets_the_states_it_was_updating(tmp_path):
    """Jamba: a decode step whose forward fails after its Mamba layer ran leaves no half-updated state behind: the
    sequence cannot continue from it, and computed again from position 0 (as the scheduler's preemption does) it
    decodes transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    from protos.segserve.v1.sampling import SamplingParams
    from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
    from worker.validation import InvalidRequest

    model_dir = build_architecture("jamba", tmp_path / "jamba")
    runner = runner_of(model_dir)
    prompt = [5, 17, 42, 7, 99, 3]
    token = runner.step(StepRequest([ScheduledSequence("a", prompt, 0, (0, 1), sample_indices=[len(prompt) - 1])],
                                    [NewSequence("a", SamplingParams(), len(prompt))]))[0].token_ids[-1]
    attention_layer = runner.model.model.layers[1]  # after the Mamba layer (0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_layer, "forward", lambda *_, **__: (_ for _ in ()).throw(RuntimeError("lost")))
        with pytest.raises(RuntimeError, match="lost"):
            runner.step(StepRequest([ScheduledSequence("a", [token], len(prompt), (0, 1, 2), sample_indices=[0])]))
    assert "a" not in runner.sequence_states.saved
    with pytest.raises(InvalidRequest, match="'a' starts at token 6, where it has no saved state"):
        runner.step(StepRequest([ScheduledSequence("a", [token], len(prompt), (0, 1, 2), sample_indices=[0])]))
    runner.step(StepRequest([], finished_seq_ids=["a"]))
    tokens = [token]
    known = prompt + tokens
    tokens += runner.step(StepRequest([ScheduledSequence("b", known, 0, (3, 4), sample_indices=[len(known) - 1])],
                                      [NewSequence("b", SamplingParams(), len(known))]))[0].token_ids
    for _ in range(4):
        tokens += runner.step(StepRequest([ScheduledSequence("b", tokens[-1:], len(prompt) + len(tokens) - 1,
                                                             (3, 4, 5), sample_indices=[0])]))[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(runner.device).eval()
    with torch.inference_mode():
        expected = model.generate(torch.tensor([prompt], device=runner.device), do_sample=False, max_new_tokens=6,
                                  eos_token_id=None)[0, len(prompt):].tolist()
    assert tokens == expected
