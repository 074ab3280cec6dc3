"""Prompt log-probabilities from the worker against a plain transformers forward over the prompt."""

from __future__ import annotations

import pytest
import torch

from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from protos.segserve.v1.tree import CandidateTree
from tests.worker.test_model_runner import PROMPT, make_runner, stock_attention

LONG_PROMPT = PROMPT + [200, 201, 5, 77, 140, 3, 9, 33]  # 19 tokens: past tiny Gemma3's window of 8
BLOCKS = tuple(range(8))


@pytest.fixture(scope="module")
def runner(tiny_gemma3_dir):
    return make_runner(tiny_gemma3_dir)


@pytest.fixture(scope="module")
def reference(runner) -> torch.Tensor:
    """log_softmax of model(prompt).logits: [P, V]; row i - 1 scores prompt token i."""
    with stock_attention(runner.model), torch.inference_mode():
        logits = runner.model(input_ids=torch.tensor([LONG_PROMPT], device=runner.device), use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def prefill(runner, seq_id: str, chunks: list[int], num_top: int | None, num_computed: int = 0,
            is_new: bool = True) -> list:
    """Send LONG_PROMPT from num_computed in chunks of these sizes (sampling at the prompt's end);
    returns this sequence's output of every step (None where it had none)."""
    new = [NewSequence(seq_id, SamplingParams(num_prompt_logprobs=num_top), len(LONG_PROMPT))] if is_new else []
    outputs, start = [], num_computed
    for size in chunks:
        tokens = LONG_PROMPT[start:start + size]
        is_last = start + size == len(LONG_PROMPT)
        work = ScheduledSequence(seq_id, tokens, start, BLOCKS, sample_indices=(size - 1,) if is_last else ())
        # a neighbour that asks for nothing shares every step
        other = ScheduledSequence("n", (7, 8), 0, (20,), sample_indices=(1,))
        result = {o.seq_id: o for o in runner.step(StepRequest(
            [work, other], new + [NewSequence("n", SamplingParams(), 2)], finished_seq_ids=["n"]))}
        assert result["n"].prompt_logprobs is None
        outputs.append(result.get(seq_id))
        new, start = [], start + size
    return outputs


def assert_matches(reference: torch.Tensor, got, start: int, num_top: int) -> None:
    assert got.start == start
    expected = [reference[i - 1, LONG_PROMPT[i]].item() for i in range(start, start + len(got.logprobs))]
    assert list(got.logprobs) == pytest.approx(expected, abs=1e-4)
    if num_top == 0:
        assert got.top_logprobs == ()
        return
    assert len(got.top_logprobs) == len(got.logprobs)
    for i, top in enumerate(got.top_logprobs, start):
        values, ids = reference[i - 1].topk(num_top)
        assert list(top.token_ids) == ids.tolist() and list(top.logprobs) == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("chunks", [[19], [3, 4, 2, 10], [1, 1, 5, 12], [18, 1]])
@pytest.mark.parametrize("num_top", [0, 3])
def test_prompt_logprobs_match_a_plain_forward(runner, reference, chunks, num_top):
    outputs = prefill(runner, "p", chunks, num_top)
    runner.step(StepRequest(finished_seq_ids=["p"]))
    assert all(o is not None and not o.error for o in outputs)  # every chunk answers, sampled or not
    assert [len(o.token_ids) for o in outputs] == [0] * (len(chunks) - 1) + [1]
    next_index = 1
    for out in outputs:  # contiguous, each token once, all of 1 .. P - 1 in the end
        assert_matches(reference, out.prompt_logprobs, next_index, num_top)
        next_index += len(out.prompt_logprobs.logprobs)
    assert next_index == len(LONG_PROMPT)


def test_a_tree_rooted_at_the_last_prompt_token_reports_it(runner, reference):
    (chunk,) = prefill(runner, "t", [len(LONG_PROMPT) - 1], 0)
    root = len(LONG_PROMPT) - 1
    tree = ScheduledSequence("t", (LONG_PROMPT[-1],), root, BLOCKS, draft=CandidateTree((5, 6), (-1, 0)))
    (out,) = runner.step(StepRequest([tree]))
    runner.step(StepRequest(finished_seq_ids=["t"]))
    assert_matches(reference, chunk.prompt_logprobs, 1, 0)
    assert len(chunk.prompt_logprobs.logprobs) == root - 1
    assert_matches(reference, out.prompt_logprobs, root, 0)
    assert len(out.prompt_logprobs.logprobs) == 1 and len(out.token_ids) >= 1


def test_a_recomputed_prompt_is_not_reported_twice(runner, reference):
    """After a preemption the prompt is recomputed from 0: only tokens not reported yet come back."""
    first = prefill(runner, "r", [6, 5], 2)
    assert first[-1].prompt_logprobs.start + len(first[-1].prompt_logprobs.logprobs) == 11
    again = prefill(runner, "r", [4, 15], 2, is_new=False)  # preempted: starts over at 0
    runner.step(StepRequest(finished_seq_ids=["r"]))
    assert again[0].prompt_logprobs.logprobs == ()
    assert_matches(reference, again[1].prompt_logprobs, 11, 2)
    assert len(again[1].prompt_logprobs.logprobs) == len(LONG_PROMPT) - 11


def test_only_sequences_that_ask_keep_extra_logits_rows(runner):
    work = ScheduledSequence("k", LONG_PROMPT, 0, BLOCKS, sample_indices=(len(LONG_PROMPT) - 1,))
    plain = runner.update_states(StepRequest([work], [NewSequence("k", SamplingParams(), len(LONG_PROMPT))]))
    assert runner.execute(plain).shape[0] == 1
    asking = runner.update_states(StepRequest([work], [NewSequence("k", SamplingParams(num_prompt_logprobs=0),
                                                                     len(LONG_PROMPT))]))
    assert runner.execute(asking).shape[0] == 1 + len(LONG_PROMPT) - 1
    runner.step(StepRequest(finished_seq_ids=["k"]))
