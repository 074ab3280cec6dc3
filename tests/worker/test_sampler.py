"""worker.sampler against transformers' own logits processors and hand-written reference formulas."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

import worker.sampler as sampler
import worker.warpers as warpers
from protos.segserve.v1.sampling import SamplingParams
from worker.sampler import SampleRow, apply_logit_bias, apply_penalties, draw, make_generator, sample, warp

VOCAB = 64


def row(history=(), num_prompt=0, generator=None, **params) -> SampleRow:
    return SampleRow(SamplingParams(**params), list(history), num_prompt, generator)


def reference(logits: torch.Tensor, r: SampleRow, warped: bool) -> torch.Tensor:
    """One row, processed as transformers does; logit bias, frequency / presence by the OpenAI formulas.
    [V] -> [V]."""
    p = r.params
    scores = logits.float()[None].clone()  # [1, V]
    ids = torch.tensor([list(r.token_ids)], dtype=torch.long)  # [1, L]
    for token, bias in p.logit_bias.items():  # added to the raw logits, before anything else
        scores[0, token] += bias
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(float(p.repetition_penalty))(ids, scores)
    for token, count in collections.Counter(r.token_ids[r.num_prompt_tokens :]).items():
        scores[0, token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    if warped:
        steps = [
            (p.temperature != 1.0, lambda: TemperatureLogitsWarper(float(p.temperature))),
            (p.top_k > 0, lambda: TopKLogitsWarper(p.top_k)),
            (p.top_p < 1.0, lambda: TopPLogitsWarper(p.top_p)),
            (p.typical_p < 1.0, lambda: TypicalLogitsWarper(p.typical_p)),
        ]
        for is_on, make in steps:
            if is_on:
                scores = make()(ids, scores)
    return scores[0]


def assert_same_scores(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), "different tokens filtered"
    finite = ~torch.isinf(expected)
    torch.testing.assert_close(actual[finite], expected[finite], rtol=1e-6, atol=1e-6)


MIXED_ROWS = [  # one batch, every row its own parameters and history
    row(),
    row(range(10), 4, repetition_penalty=1.3),
    row([5, 5, 5, 9, 9, 1], 2, frequency_penalty=0.7, presence_penalty=-0.4),
    row([3, 3, 8, 8, 8], 1, repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=1.1),
    row(do_sample=True, temperature=0.6),
    row([2, 2, 7], 1, do_sample=True, top_k=5, repetition_penalty=1.5),
    row(do_sample=True, temperature=1.4, top_p=0.7),
    row(do_sample=True, typical_p=0.6),
    row([1, 2, 3], 0, do_sample=True, temperature=0.9, top_k=20, top_p=0.8, typical_p=0.9, presence_penalty=2.0),
    row(do_sample=True, top_k=VOCAB + 10),
    row(do_sample=True, top_k=VOCAB - 1),
    row([4, 4, 9], 1, logit_bias={4: 3.5, 9: -2.0, 17: 0.25}, repetition_penalty=1.4, frequency_penalty=0.3),
    row([6], 0, do_sample=True, top_k=10, temperature=0.7, logit_bias={6: 5.0, 60: -100.0}),
]


def test_mixed_batch_matches_transformers_row_by_row():
    logits = torch.randn(len(MIXED_ROWS), VOCAB, generator=torch.Generator().manual_seed(0)) * 3  # [N, V]
    penalized = logits.clone()
    apply_logit_bias(penalized, [r.params for r in MIXED_ROWS])
    apply_penalties(penalized, MIXED_ROWS)
    for i, r in enumerate(MIXED_ROWS):
        assert_same_scores(penalized[i], reference(logits[i], r, warped=False))
    warped = warp(penalized.clone(), [r.params for r in MIXED_ROWS])
    for i, r in enumerate(MIXED_ROWS):
        expected = reference(logits[i], r, warped=True)
        assert_same_scores(warped[i], expected)
        assert_same_scores(warp(penalized[i : i + 1].clone(), [r.params])[0], expected)  # batch of one


def test_penalties_come_from_each_rows_own_history():
    # Two tree nodes of one sequence: same prompt, different paths; each sees only its own tokens.
    logits = torch.full((2, VOCAB), 2.0)
    rows = [row([1, 2, 3], 2, repetition_penalty=2.0, frequency_penalty=0.5), row([1, 2, 4, 4], 2, repetition_penalty=2.0, frequency_penalty=0.5)]
    apply_penalties(logits, rows)
    assert logits[0, [1, 2]].tolist() == [1.0, 1.0] and logits[0, 3].item() == 0.5 and logits[0, 4].item() == 2.0
    assert logits[1, 3].item() == 2.0 and logits[1, 4].item() == 1.0 - 2 * 0.5


def test_prompt_tokens_are_not_counted_by_frequency_or_presence():
    logits = torch.zeros(1, VOCAB)
    apply_penalties(logits, [row([7, 7, 7, 8], 3, frequency_penalty=1.0, presence_penalty=10.0)])
    assert logits[0, 7].item() == 0.0 and logits[0, 8].item() == -11.0


@pytest.mark.parametrize("num_candidates", [1, 3, 1024])
def test_top_p_candidate_path_and_full_sort_match_transformers(monkeypatch, num_candidates):
    monkeypatch.setattr(warpers, "_TOP_P_CANDIDATES", num_candidates)
    gen = torch.Generator().manual_seed(1)
    scales = torch.tensor([0.3, 1.0, 4.0, 12.0, 1.0, 1.0])[:, None]  # flat rows need the full sort
    logits = torch.randn(6, VOCAB, generator=gen) * scales  # [6, V]
    params = [SamplingParams(do_sample=True, top_p=p) for p in (0.9, 0.5, 0.95, 0.3, 1.0, 0.999)]
    warped = warp(logits.clone(), params)
    for i, p in enumerate(params):
        assert_same_scores(warped[i], reference(logits[i], SampleRow(p, [], 0, None), warped=True))


def test_top_p_on_the_real_vocabulary_size_matches_transformers():
    # Nuclei of 4, 1195, 11878 and 160390 tokens: settled by 1024 candidates, by 16384 (2 rows), by the full sort.
    scales = torch.tensor([[6.0], [3.0], [3.0], [1.0]])
    logits = torch.randn(4, 262_144, generator=torch.Generator().manual_seed(2)) * scales  # [4, V]
    params = [
        SamplingParams(do_sample=True, top_p=0.5),
        SamplingParams(do_sample=True, top_p=0.9, temperature=0.7),
        SamplingParams(do_sample=True, top_p=0.9),
        SamplingParams(do_sample=True, top_p=0.9),
    ]
    warped = warp(logits.clone(), params)
    for i, p in enumerate(params):
        assert_same_scores(warped[i], reference(logits[i], SampleRow(p, [], 0, None), warped=True))


def test_greedy_is_argmax_of_penalized_logits_and_scores_the_logit():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[0, 5] = logits[0, 9] = 10.0  # a tie: torch.argmax takes the first
    logits[1, 11] = 10.0  # the favourite is penalized below the runner-up
    logits[1, 12] = 8.0
    rows = [row(), row([11], 1, repetition_penalty=2.0), row(temperature=0.1, top_k=1, top_p=0.1)]
    out = sample(logits, rows)
    assert out.token_ids == [5, 12, int(logits[2].argmax())]
    assert out.scores == pytest.approx([10.0, 8.0, logits[2].max().item()])
    assert out.top_logprobs == [None, None, None]


def test_plain_greedy_rows_take_a_shorter_way_to_the_same_tokens_and_scores(monkeypatch):
    """Rows that only take the argmax (most decode steps) skip processing: the same tokens (the first of tied maxima)
    and float32 scores as the same rows beside one asking for top log-probabilities, which takes the full path."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(4))
    logits[0, 5] = logits[0, 9] = 10.0
    for dtype in (torch.float32, torch.bfloat16):
        full = sample(logits.to(dtype), [row() for _ in range(3)] + [row(num_top_logprobs=2)])
        with monkeypatch.context() as patch:
            patch.setattr(sampler, "_processed", None)  # the full path would call it
            plain = sample(logits.to(dtype), [row() for _ in range(4)])
        assert plain.token_ids == full.token_ids and plain.token_ids[0] == 5
        assert plain.scores == full.scores
        assert plain.score_tensor.dtype == torch.float32
        assert plain.top_logprobs == [None] * 4


def test_sampling_scores_and_top_logprobs_are_under_the_final_distribution():
    logits = torch.randn(len(MIXED_ROWS), VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    rows = [SampleRow(SamplingParams(**{**r.params.__dict__, "num_top_logprobs": 1 + i % 4}), r.token_ids, r.num_prompt_tokens, make_generator(i, "cpu")) for i, r in enumerate(MIXED_ROWS)]
    out = sample(logits, rows)
    for i, r in enumerate(rows):
        processed = reference(logits[i], r, warped=r.params.do_sample)  # [V]
        expected = torch.log_softmax(processed, dim=-1)  # [V]
        score = expected if r.params.do_sample else processed  # greedy scores the logit itself
        assert out.scores[i] == pytest.approx(score[out.token_ids[i]].item(), abs=1e-5)
        ids, logprobs = out.top_logprobs[i]
        values, top_ids = torch.topk(expected, r.params.num_top_logprobs)
        assert ids == top_ids.tolist() and logprobs == pytest.approx(values.tolist(), abs=1e-5)
        assert not math.isinf(expected[out.token_ids[i]]), "drew a filtered token"


def test_log_probabilities_are_accurate_on_the_real_vocabulary_size():
    # float32 softmax alone is off by ~2e-5 here; logits near 20 have a float32 ulp of ~2e-6.
    logits = torch.randn(2, 262_144, generator=torch.Generator().manual_seed(9)) * 4.3  # [2, V]
    rows = [row(num_top_logprobs=3), row([], 0, make_generator(0, "cpu"), do_sample=True, num_top_logprobs=3)]
    out = sample(logits, rows)
    exact = torch.log_softmax(logits.double(), dim=-1)  # [2, V]
    for i in range(2):
        ids, logprobs = out.top_logprobs[i]
        assert logprobs == pytest.approx(exact[i, ids].tolist(), abs=5e-6)
    assert out.scores[1] == pytest.approx(exact[1, out.token_ids[1]].item(), abs=5e-6)


def test_top_logprobs_only_for_rows_that_ask_and_capped_at_vocab():
    logits = torch.randn(3, 8)
    out = sample(logits, [row(num_top_logprobs=20), row(), row(do_sample=True, num_top_logprobs=2)])
    assert len(out.top_logprobs[0][0]) == 8 and out.top_logprobs[1] is None and len(out.top_logprobs[2][1]) == 2
    assert sum(math.exp(v) for v in out.top_logprobs[0][1]) == pytest.approx(1.0, abs=1e-5)


def _seeded_stream(seed: int, neighbours: list[SampleRow], position: int, steps: int = 12) -> list[int]:
    """Draw `steps` tokens for one seeded row placed among `neighbours` (other logits) at `position`."""
    gen = make_generator(seed, "cpu")
    target = torch.randn(VOCAB, generator=torch.Generator().manual_seed(5))  # [V]
    tokens: list[int] = []
    for step in range(steps):
        rows = list(neighbours)
        rows.insert(position, row(tokens, 0, gen, do_sample=True, temperature=1.5, repetition_penalty=1.2))
        logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(step))  # [N, V]
        logits[position] = target
        tokens.append(sample(logits, rows).token_ids[position])
    return tokens


def test_seeded_sampling_is_reproducible_and_batch_invariant():
    alone = _seeded_stream(7, [], 0)
    others = [row(do_sample=True), row(), row([1, 2], 0, make_generator(99, "cpu"), do_sample=True, top_p=0.5)]
    assert _seeded_stream(7, others, 2) == alone
    assert _seeded_stream(7, others[:1], 0) == alone
    assert _seeded_stream(8, [], 0) != alone


def test_make_generator():
    assert make_generator(None, "cpu") is None
    a, b = make_generator(2**64 - 1, "cpu"), make_generator(2**64 - 1, "cpu")
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


@pytest.mark.parametrize(
    "params",
    [dict(temperature=0.7, top_k=12, top_p=0.9), dict(typical_p=0.7, repetition_penalty=1.3, frequency_penalty=0.4)],
)
def test_draws_follow_the_processed_distribution(params):
    num_draws, vocab = 4000, 16
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(6)) * 1.5  # [V]
    history = [0, 1, 1, 2]
    expected = torch.softmax(reference(logits, row(history, 1, do_sample=True, **params), warped=True), dim=-1)
    gen = make_generator(123, "cpu")  # one generator shared by all rows: drawn row after row
    rows = [row(history, 1, gen, do_sample=True, **params)] * num_draws
    drawn = torch.tensor(sample(logits.expand(num_draws, vocab), rows).token_ids)
    empirical = torch.bincount(drawn, minlength=vocab).float() / num_draws
    total_variation = 0.5 * (empirical - expected).abs().sum().item()
    # Expected TV for 4000 draws over <= 16 outcomes is ~0.02; a wrong distribution is far above 0.05.
    assert total_variation < 0.05
    assert empirical[expected == 0].sum() == 0, "drew a filtered token"


def test_draw_never_picks_zero_probability_tail(monkeypatch):
    probs = torch.tensor([[0.3, 0.7, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    monkeypatch.setattr(sampler.torch, "rand", lambda *a, **k: torch.ones(1) * (1 - 2**-24))
    assert draw(probs, [None, None]).tolist() == [1, 2]
    monkeypatch.setattr(sampler.torch, "rand", lambda *a, **k: torch.zeros(1))
    assert draw(probs, [None, None]).tolist() == [0, 2]


def test_low_precision_logits_are_not_mutated():
    logits = torch.randn(2, VOCAB).to(torch.bfloat16)
    before = logits.clone()
    rows = [row([3, 4], 1, repetition_penalty=1.5), row([3], 0, make_generator(1, "cpu"), do_sample=True, top_p=0.8)]
    out = sample(logits, rows)
    assert torch.equal(logits, before)
    assert out.token_ids[0] == int(reference(logits[0], rows[0], warped=False).argmax())
    fp32 = logits.float()
    sample(fp32, rows)
    assert torch.equal(fp32, before.float())


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        sample(torch.zeros(2, VOCAB), [row()])


def test_logit_bias_matches_transformers_sequence_bias():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(10))  # [3, V]
    biases = [{3: 2.5, 40: -7.0}, {}, {0: 100.0, 63: -100.0, 5: 0.5}]
    biased = logits.clone()
    apply_logit_bias(biased, [SamplingParams(logit_bias=b) for b in biases])
    for i, bias in enumerate(biases):
        expected = logits[i:i + 1].clone()
        if bias:
            processor = SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in bias.items()])
            expected = processor(torch.tensor([[1, 2]]), expected)
        torch.testing.assert_close(biased[i], expected[0], rtol=0, atol=1e-6)


def test_logit_bias_comes_before_penalties_and_moves_greedy_choice():
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 4.0
    rows = [row(), row([9], 0, logit_bias={9: 6.0, 7: -1.0}, repetition_penalty=2.0)]
    out = sample(logits, rows)
    # row 1: token 9 is biased to 6, then penalized to 3 (it is in the history); token 7 is at 3 too
    # and comes first, so greedy takes 7 with score 3.0, not 9.
    assert out.token_ids == [7, 7] and out.scores == pytest.approx([4.0, 3.0])
    strong = sample(logits[:1], [row(logit_bias={42: 100.0})])
    assert strong.token_ids == [42] and strong.scores == pytest.approx([100.0])
    assert torch.equal(logits, torch.zeros(2, VOCAB).index_fill_(1, torch.tensor([7]), 4.0))  # input untouched


def test_logit_bias_ignores_ids_outside_the_vocabulary():
    logits = torch.zeros(1, 8)
    apply_logit_bias(logits, [SamplingParams(logit_bias={3: 1.0, 8: 5.0, 1000: 5.0})])
    assert logits[0].tolist() == [0, 0, 0, 1, 0, 0, 0, 0]


def test_ids_outside_the_vocabulary_are_ignored():
    logits = torch.ones(2, 8)
    apply_penalties(logits, [row([-3, 8, 2, 99], 0, repetition_penalty=2.0), row([7, 8, 7], 1, frequency_penalty=1.0)])
    assert logits[0].tolist() == [1, 1, 0.5, 1, 1, 1, 1, 1] and logits[1].tolist() == [1, 1, 1, 1, 1, 1, 1, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_matches_cpu_and_seeds_reproduce_there():
    logits = torch.randn(len(MIXED_ROWS), VOCAB, generator=torch.Generator().manual_seed(8)) * 3  # [N, V]
    greedy_rows = [r for r in MIXED_ROWS if not r.params.do_sample]
    assert sample(logits[: len(greedy_rows)].cuda(), greedy_rows).token_ids == sample(logits[: len(greedy_rows)], greedy_rows).token_ids
    on_cpu = warp(logits.clone(), [r.params for r in MIXED_ROWS])
    on_gpu = warp(logits.cuda(), [r.params for r in MIXED_ROWS]).cpu()
    assert torch.equal(torch.isinf(on_cpu), torch.isinf(on_gpu))
    seeded = lambda: [row(r.token_ids, r.num_prompt_tokens, make_generator(i, "cuda"), **{**r.params.__dict__, "do_sample": True}) for i, r in enumerate(MIXED_ROWS)]
    assert sample(logits.cuda(), seeded()).token_ids == sample(logits.cuda(), seeded()).token_ids
