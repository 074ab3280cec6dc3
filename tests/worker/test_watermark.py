"""Green-list watermarking: the sampler applies transformers' processor last, and its detector
finds the watermark in text sampled with it and not in text sampled without."""

from __future__ import annotations

import json

import torch
from transformers import PretrainedConfig, WatermarkLogitsProcessor

from protos.segserve.v1.sampling import SamplingParams
from tests.support.devices import TEST_DEVICE
from tests.worker.test_model_runner import gemma3_runner  # noqa: F401 (fixture)
from worker.sampler import SampleRow, make_generator, sample, warp
from worker.watermark import WATERMARKING, detect

VOCAB = 1000


def reference_processor() -> WatermarkLogitsProcessor:
    return WatermarkLogitsProcessor(VOCAB, "cpu", greenlist_ratio=WATERMARKING.greenlist_ratio,
                                    bias=WATERMARKING.bias, hashing_key=WATERMARKING.hashing_key,
                                    seeding_scheme=WATERMARKING.seeding_scheme,
                                    context_width=WATERMARKING.context_width)


def test_greedy_and_sampling_rows_match_the_processor_applied_last():
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB) * 0.5
    original = logits.clone()
    histories = [[5, 17, 3], [9], [5, 17, 3], [42, 7]]
    params = [SamplingParams(watermark=True, num_top_logprobs=5),
              SamplingParams(watermark=False, num_top_logprobs=5),
              SamplingParams(do_sample=True, temperature=0.7, top_k=50, watermark=True, num_top_logprobs=5, seed=1),
              SamplingParams(do_sample=True, top_p=0.9, watermark=True, num_top_logprobs=5, seed=2)]
    rows = [SampleRow(p, h, 1, make_generator(p.seed, "cpu")) for p, h in zip(params, histories)]
    out = sample(logits, rows)
    assert torch.equal(logits, original)  # the input is never modified
    processor = reference_processor()
    for i, (p, history) in enumerate(zip(params, histories)):
        final = logits[i:i + 1].clone()
        if p.do_sample:
            final = warp(final, [p])
        if p.watermark:
            final = processor(torch.tensor([history]), final)
        expected = torch.log_softmax(final, dim=-1)[0]
        ids, values = out.top_logprobs[i]
        assert ids == expected.topk(5).indices.tolist()
        torch.testing.assert_close(torch.tensor(values), expected.topk(5).values, rtol=1e-4, atol=1e-4)
        if not p.do_sample:
            assert out.token_ids[i] == int(final.argmax())


def test_runner_greedy_with_watermark_matches_generate_with_watermarking_config(gemma3_runner, tiny_gemma3_dir):
    """Through the worker (packed batch with an unwatermarked neighbour, on the test device) vs transformers'
    generate() on the CPU, whose green lists are the detector's."""
    from transformers import AutoModelForCausalLM

    from tests.worker.test_model_runner import PROMPT, Decoder, run_together

    decoders = [Decoder("w", PROMPT, list(range(1, 11)), params=SamplingParams(watermark=True)),
                Decoder("p", PROMPT, list(range(11, 21)))]
    got = run_together(gemma3_runner, decoders, 20)
    model = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])
        marked = model.generate(ids, do_sample=False, max_new_tokens=20, watermarking_config=WATERMARKING)
        plain = model.generate(ids, do_sample=False, max_new_tokens=20)
    assert got["w"] == marked[0, len(PROMPT):].tolist()
    assert got["p"] == plain[0, len(PROMPT):].tolist()
    assert got["w"] != got["p"]


def generate(is_watermarked: bool, num_tokens: int, seed: int) -> list[int]:
    """Sample from a fixed random 'model' (logits from a hash of the last token) with the real sampler, on the test
    device (the detector runs on the CPU)."""
    generator = make_generator(seed, TEST_DEVICE)
    params = SamplingParams(do_sample=True, watermark=is_watermarked, seed=seed)
    tokens = [1]
    for _ in range(num_tokens):
        logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(tokens[-1] * 7919 + 13)) * 2.0
        logits = logits.to(TEST_DEVICE)
        tokens.append(sample(logits, [SampleRow(params, tokens, 1, generator)]).token_ids[0])
    return tokens[1:]


def test_the_detector_finds_the_watermark_only_where_it_was_applied():
    config = PretrainedConfig(vocab_size=VOCAB, bos_token_id=0)
    for seed in (1, 2, 3):
        marked = detect(generate(True, 200, seed), config)
        plain = detect(generate(False, 200, seed), config)
        assert marked["is_watermarked"] and marked["z_score"] > 6 and marked["green_fraction"] > 0.45, marked
        assert not plain["is_watermarked"] and abs(plain["z_score"]) < 4, plain


def test_cli_detect_prints_json(tiny_gemma3_dir, capsys):
    from segserve.cli import main

    assert main(["watermark", "detect", "--model", str(tiny_gemma3_dir), "--text", "the quick brown fox jumps"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {"z_score", "green_fraction", "p_value", "is_watermarked", "num_tokens_scored"}
    assert result["num_tokens_scored"] > 0
