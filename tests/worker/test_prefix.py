"""The worker side of prefix caching: a sequence announced with its prompt may start its first step past a
prefix another sequence computed (sharing those KV blocks), with the same tokens as computing it all. And block
tables sent as deltas, which keep the worker's view of a sequence's blocks between steps."""

from __future__ import annotations

from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from tests.worker.test_model_runner import PROMPT, make_runner, reference_greedy

NUM_NEW = 6


def decode(runner, seq_id: str, prompt: list[int], num_computed: int, blocks: list[int],
           params: SamplingParams, announced_prompt: tuple[int, ...]) -> list[int]:
    """Announce, compute prompt[num_computed:] (the rest is in `blocks` already), then greedy-decode."""
    new = [NewSequence(seq_id, params, len(prompt), announced_prompt)]
    work = ScheduledSequence(seq_id, prompt[num_computed:], num_computed, blocks, sample_indices=[len(prompt) - 1 -
                                                                                                   num_computed])
    output = []
    for _ in range(NUM_NEW):
        (out,) = runner.step(StepRequest([work], new))
        assert not out.error, out.error
        output += out.token_ids
        new = []
        work = ScheduledSequence(seq_id, [output[-1]], len(prompt) + len(output) - 1, blocks, sample_indices=[0])
    runner.step(StepRequest(finished_seq_ids=[seq_id]))
    return output


def test_a_first_step_past_a_shared_cached_prefix_decodes_like_a_full_prefill(tiny_gemma3_dir):
    runner = make_runner(tiny_gemma3_dir)  # block size 4: PROMPT's first 8 tokens fill blocks 0 and 1
    greedy = SamplingParams()
    full = decode(runner, "full", PROMPT, 0, [0, 1, 2, 3, 4], greedy, tuple(PROMPT))
    assert full == reference_greedy(runner.model, PROMPT, NUM_NEW)
    # Blocks 0 and 1 still hold the prompt's first 8 tokens: a new sequence reads them and writes its own.
    assert decode(runner, "cached", PROMPT, 8, [0, 1, 10, 11, 12], greedy, tuple(PROMPT)) == full
    # Penalties see the whole prompt, cached part included: same tokens as a full prefill with the penalty.
    penalized = SamplingParams(repetition_penalty=1.8, frequency_penalty=0.5)
    expected = decode(runner, "p-full", PROMPT, 0, [20, 21, 22, 23, 24], penalized, tuple(PROMPT))
    assert decode(runner, "p-cached", PROMPT, 8, [20, 21, 30, 31, 32], penalized, tuple(PROMPT)) == expected


def test_a_step_past_tokens_the_worker_never_learned_is_still_refused(tiny_gemma3_dir):
    runner = make_runner(tiny_gemma3_dir)
    work = ScheduledSequence("s", PROMPT[8:], 8, [0, 1, 2], sample_indices=[len(PROMPT) - 9])
    (out,) = runner.step(StepRequest([work], [NewSequence("s", SamplingParams(), len(PROMPT))]))
    assert "num_computed_tokens=8" in out.error and out.token_ids == ()


def test_block_tables_sent_as_deltas_decode_like_whole_tables(tiny_gemma3_dir):
    """A scheduler that keeps count sends each step only the blocks the worker lacks: none while a block has
    room, one when the sequence crosses into the next."""
    runner = make_runner(tiny_gemma3_dir)  # block size 4
    assert runner.info().block_table_deltas
    blocks, sent, output = [40, 41, 42], 0, []
    work = ScheduledSequence("d", PROMPT, 0, tuple(blocks), sample_indices=[len(PROMPT) - 1])
    new = [NewSequence("d", SamplingParams(), len(PROMPT), tuple(PROMPT))]
    for step in range(NUM_NEW + 4):
        sent = len(blocks)
        (out,) = runner.step(StepRequest([work], new))
        assert not out.error, out.error
        output += out.token_ids
        new = []
        num_tokens = len(PROMPT) + len(output)
        if num_tokens > 4 * len(blocks):
            blocks.append(43 + step)
        work = ScheduledSequence("d", [output[-1]], num_tokens - 1, tuple(blocks[sent:]), sample_indices=[0],
                                 block_table_start=sent)
    assert len(blocks) > 4  # the sequence did cross into new blocks
    assert output == reference_greedy(runner.model, PROMPT, NUM_NEW + 4)
    # a delta past the table the worker holds is refused for that sequence alone, naming the field
    (out,) = runner.step(StepRequest([ScheduledSequence("d", [output[-1]], len(PROMPT) + len(output) - 1, (),
                                                        sample_indices=[0], block_table_start=len(blocks) + 1)]))
    assert "block_table_start" in out.error and out.token_ids == ()
