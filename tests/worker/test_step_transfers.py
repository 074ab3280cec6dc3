"""The step after the forward waits for the device once: one host transfer, whatever it samples.

Counted, not timed: every Tensor.cpu / tolist / item / __bool__ during postprocess (on a GPU each
is a host-device sync). Also the pieces that make it possible: uniforms drawn up front (worker/draws.py)
that keep a seeded sequence on its plain-decoding stream, a sampler that does not raise on rows it
cannot sample, and the lazy per-row history of tree nodes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from protos.segserve.v1.tree import CandidateTree
from tests.worker.test_model_runner import PROMPT, make_runner
from worker.draws import SeededDraws
from worker.sampler import PrefixedHistory, SampleRow, apply_penalties, sample
from worker.verify import step_paths
from worker.work import expand


@contextlib.contextmanager
def counting_host_reads(monkeypatch, counts: dict[str, int]):
    """Counts calls of the Tensor methods that read a value back to the host."""
    with monkeypatch.context() as patch:
        for name in ("cpu", "tolist", "item", "__bool__"):
            real = getattr(torch.Tensor, name)

            def counted(self, *args, _real=real, _name=name, **kwargs):
                counts[_name] = counts.get(_name, 0) + 1
                return _real(self, *args, **kwargs)

            patch.setattr(torch.Tensor, name, counted)
        yield


PARAMS = {
    "greedy": SamplingParams(),
    "greedy-top": SamplingParams(num_top_logprobs=3),
    "seeded": SamplingParams(do_sample=True, temperature=0.8, top_k=40, seed=3, num_top_logprobs=2),
    "unseeded": SamplingParams(do_sample=True, temperature=1.2),
}


def test_a_step_reads_the_device_once(tiny_gemma3_dir, monkeypatch):
    runner = make_runner(tiny_gemma3_dir)
    ids = list(PARAMS)
    blocks = {s: tuple(range(8 * i, 8 * i + 8)) for i, s in enumerate(ids)}
    counts_per_step: list[dict[str, int]] = []
    real_postprocess = runner.postprocess

    def postprocess(plan, logits):
        counts: dict[str, int] = {}
        with counting_host_reads(monkeypatch, counts):
            outputs = real_postprocess(plan, logits)
        counts_per_step.append(counts)
        return outputs

    monkeypatch.setattr(runner, "postprocess", postprocess)
    # the prefill samples its last two positions (a plain work with two rows), then one tree step, one plain step
    prefill = [ScheduledSequence(s, PROMPT[:-1], 0, blocks[s], sample_indices=(8, 9)) for s in ids]
    runner.step(StepRequest(prefill, [NewSequence(s, PARAMS[s], len(PROMPT)) for s in ids]))
    tree = CandidateTree((5, 6, 7, 8, 9, 10), (-1, -1, 0, 2, 1, 4))
    trees = [ScheduledSequence(s, (PROMPT[-1],), len(PROMPT) - 1, blocks[s], draft=tree) for s in ids]
    outputs = runner.step(StepRequest(trees))
    assert [out.error for out in outputs] == [""] * len(ids)
    plain = [ScheduledSequence(s, (out.token_ids[-1],), len(PROMPT) - 1 + len(out.token_ids), blocks[s],
                               sample_indices=(0,)) for s, out in zip(ids, outputs)]
    assert all(not out.error for out in runner.step(StepRequest(plain)))
    runner.step(StepRequest(finished_seq_ids=ids))
    assert counts_per_step[:3] == [{"cpu": 1}] * 3


@pytest.mark.parametrize("is_batched", [True, False])
@pytest.mark.parametrize("num_used", [0, 1, 3, 5])
def test_seeded_draws_follow_one_rand_per_token_and_rewind_to_the_used_ones(is_batched, num_used):
    generator = torch.Generator().manual_seed(11)
    draws = SeededDraws(generator, 5, torch.device("cpu"), is_batched=is_batched)
    reference = torch.Generator().manual_seed(11)
    assert torch.equal(draws.uniform, torch.cat([torch.rand(1, generator=reference) for _ in range(5)]))
    draws.keep(num_used)
    reference.manual_seed(11)
    for _ in range(num_used):
        torch.rand(1, generator=reference)
    assert torch.equal(generator.get_state(), reference.get_state())


def test_rows_with_non_finite_logits_do_not_raise():
    """The caller discards their tokens; on a GPU an out-of-range index would abort the process."""
    logits = torch.randn(4, 64)
    logits[0, 3] = float("nan")
    logits[1, :] = float("-inf")
    logits[2, 7] = float("inf")
    rows = [SampleRow(SamplingParams(do_sample=True, top_p=0.9, top_k=5, typical_p=0.8, num_top_logprobs=2), [1, 2],
                      0, torch.Generator().manual_seed(i)) for i in range(4)]
    out = sample(logits, rows)
    assert len(out.token_ids) == 4 and all(0 <= t < 64 for t in out.token_ids)


def visible_tokens(work, index: int) -> list[int]:
    """The step's tokens that token `index` sees, itself included, walked back from it to the root: the reference
    step_paths builds from the parents' paths instead."""
    if not work.is_tree:
        return list(work.token_ids[: index + 1])
    path = []
    while index >= 0:
        path.append(work.token_ids[index])
        index = work.node_parents[index]
    return path[::-1]


def test_row_histories_read_like_the_copied_history():
    history = [1, 2, 3, 4, 5, 99, 98]  # only the first num_computed (5) tokens are real
    work = expand(ScheduledSequence("w", (9,), 5, (0, 1), draft=CandidateTree((10, 11, 12, 13), (-1, -1, 1, 2))))
    paths = step_paths(work)
    for index in range(5):
        expected = history[:5] + visible_tokens(work, index)
        view = PrefixedHistory(history, 5, paths[index])
        assert len(view) == len(expected) and list(view) == expected
        assert view[2:] == expected[2:] and view[-1] == expected[-1] and view[5] == expected[5]
    plain = expand(ScheduledSequence("p", (7, 8, 9), 5, (0, 1), sample_indices=(1, 2)))
    assert [list(path) for path in step_paths(plain)] == [[7, 8], [7, 8, 9]]


def test_penalties_read_a_shared_prefix_like_copied_histories():
    """Tree nodes share their sequence's tokens (PrefixedHistory): penalized as if each had its own copy."""
    context, paths = [4, 9, 9, 2, 7, 7, 7], [(5,), (5, 9), (5, 6), (5, 9, 7, 60)]
    params = dict(repetition_penalty=1.7, frequency_penalty=0.4, presence_penalty=0.3)
    shared = [SampleRow(SamplingParams(**params), PrefixedHistory(context + [0, 0], 7, p), 3, None) for p in paths]
    copied = [SampleRow(SamplingParams(**params), context + list(p), 3, None) for p in paths]
    logits = torch.randn(len(paths), 64, generator=torch.Generator().manual_seed(0))
    expected, got = logits.clone(), logits.clone()
    apply_penalties(expected, copied)
    apply_penalties(got, shared)
    assert torch.equal(got, expected) and not torch.equal(got, logits)
