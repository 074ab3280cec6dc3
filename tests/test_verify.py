"""Tree verification in the worker: lossless greedy decoding, packed vs naive verification, the wire.

Trees are `DraftTree`s (drafter/types.py: parent -1 = the root); `spec_decode` turns them into
draft_parents steps (parent index into token_ids, 0 = the root) the way the scheduler does.
"""

from __future__ import annotations

import random

import grpc
import pytest
import torch

from drafter.types import DraftTree
from protos.segserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.test_worker_runner import PROMPT, make_runner, reference_greedy, stock_attention
from worker.messages import InvalidRequest, NewSequence, ScheduledSequence, StepRequest
from worker.sampler import SamplingParams
from worker.server import WorkerServicer, start_server
from worker.verify import TreeLayout, TreeWalk, kv_moves

NUM_NEW = 24  # prompt (11) + 24 tokens: far past tiny Gemma3's sliding window of 8


@pytest.fixture(scope="module")
def gemma3_runner(tiny_gemma3_dir):
    return make_runner(tiny_gemma3_dir)


@pytest.fixture(scope="module")
def llama_runner(tiny_llama_dir):
    return make_runner(tiny_llama_dir)


@pytest.fixture(params=["gemma3", "llama"])
def runner(request):
    return request.getfixturevalue(f"{request.param}_runner")


def tree_step(seq_id: str, root: int, tree: DraftTree, num_computed: int, blocks: list[int]) -> ScheduledSequence:
    return ScheduledSequence(seq_id, [root] + tree.token_ids, num_computed, blocks,
                             draft_parents=[p + 1 for p in tree.parents])


def spec_decode(runner, prompt: list[int], num_new: int, propose, params: SamplingParams = SamplingParams(),
                seq_id: str = "s", blocks: list[int] | None = None) -> tuple[list[int], int]:
    """Prefill prompt[:-1], then verify one tree per step rooted at the last token; (output, steps)."""
    blocks = blocks or list(range(3, 3 + 16))
    runner.step(StepRequest([ScheduledSequence(seq_id, prompt[:-1], 0, blocks)],
                            [NewSequence(seq_id, params, len(prompt))]))
    output, num_computed, root, num_steps = [], len(prompt) - 1, prompt[-1], 0
    while len(output) < num_new:
        (out,) = runner.step(StepRequest([tree_step(seq_id, root, propose(prompt + output), num_computed, blocks)]))
        assert len(out.token_ids) == len(out.scores) >= 1
        output += out.token_ids
        num_computed += len(out.token_ids)
        root, num_steps = output[-1], num_steps + 1
    runner.step(StepRequest(finished_seq_ids=[seq_id]))
    return output[:num_new], num_steps


def random_tree(rng: random.Random, vocab_size: int, size: int = 8) -> DraftTree:
    tokens = [rng.randrange(vocab_size) for _ in range(size)]
    return DraftTree(tokens, [rng.randrange(-1, i) for i in range(size)])


def oracle_tree(true_next: list[int], vocab_size: int) -> DraftTree:
    """The true continuation as a chain, each level placed after a wrong sibling that has a wrong child,
    so accepted nodes sit at indices far from their depths (their KV must move)."""
    tree, parent = DraftTree(), -1
    for depth, token in enumerate(true_next):
        wrong = (token + 1 + depth) % vocab_size
        tree.token_ids += [wrong, (wrong * 7 + 3) % vocab_size, token]
        n = len(tree.parents)
        tree.parents += [parent, n, parent]
        parent = n + 2
    return tree


def test_greedy_with_random_trees_is_lossless(runner):
    rng, vocab = random.Random(0), runner.info().vocab_size
    got, num_steps = spec_decode(runner, PROMPT, NUM_NEW, lambda _: random_tree(rng, vocab))
    assert got == reference_greedy(runner.model, PROMPT, NUM_NEW)


def test_greedy_with_oracle_trees_is_lossless_and_accepts_several(runner):
    vocab = runner.info().vocab_size
    reference = reference_greedy(runner.model, PROMPT, NUM_NEW + 4)
    propose = lambda context: oracle_tree(reference[len(context) - len(PROMPT):][:4], vocab)
    got, num_steps = spec_decode(runner, PROMPT, NUM_NEW, propose)
    assert got == reference[:NUM_NEW]
    assert num_steps <= NUM_NEW // 4  # 5 tokens per step with 4-deep oracle chains (ceil(24 / 5) = 5)


@pytest.mark.real_model
def test_real_model_greedy_with_oracle_trees_is_lossless(default_model_dir):
    from transformers import AutoTokenizer

    runner = make_runner(default_model_dir, num_kv_blocks=8, block_size=16)
    prompt = AutoTokenizer.from_pretrained(default_model_dir)("def add(a, b):\n    return a + b\n\ndef mul(").input_ids
    reference = reference_greedy(runner.model, prompt, 10)
    vocab = runner.info().vocab_size
    propose = lambda context: oracle_tree(reference[len(context) - len(prompt):][:3], vocab)
    got, num_steps = spec_decode(runner, prompt, 6, propose, blocks=list(range(8)))
    assert got == reference[:6] and num_steps == 2


def naive_verify(model, context: list[int], tree: DraftTree) -> list[int]:
    """The naive form: every prefix of every root-to-leaf candidate appended to the context and run
    as its own input; keep the longest prefix the target's argmax agrees with, plus its next token."""
    paths = [[]]
    for i, parent in enumerate(tree.parents):
        paths.append((paths[parent + 1] if parent >= 0 else []) + [tree.token_ids[i]])
    leaves = [p for i, p in enumerate(paths) if i == 0 or (i - 1) not in tree.parents]
    best: list[int] = []
    with stock_attention(model), torch.inference_mode():
        def argmax_after(prefix: list[int]) -> int:
            return int(model(input_ids=torch.tensor([context + prefix]), use_cache=False).logits[0, -1].argmax())
        for candidate in leaves:
            num_ok = 0
            while num_ok < len(candidate) and argmax_after(candidate[:num_ok]) == candidate[num_ok]:
                num_ok += 1
            accepted = candidate[:num_ok] + [argmax_after(candidate[:num_ok])]
            best = accepted if len(accepted) > len(best) else best
    return best


def test_packed_verification_matches_naive(gemma3_runner):
    """Trees whose nodes are the target's argmax about half the time, over a 15-token context."""
    runner, rng = gemma3_runner, random.Random(1)
    context = PROMPT + [200, 201, 202, 203]
    greedy = reference_greedy(runner.model, context, 6)
    total_accepted = 0
    for trial in range(6):
        tree = DraftTree()
        for i in range(7):
            parent = rng.randrange(-1, i)
            depth = 1 if parent < 0 else tree.depths[parent] + 1
            on_greedy_path = all(tree.token_ids[a] == greedy[tree.depths[a] - 1] for a in _ancestors(tree, parent))
            is_true = on_greedy_path and rng.random() < 0.7
            tree.token_ids.append(greedy[depth - 1] if is_true else rng.randrange(400))
            tree.parents.append(parent)
        seq_id = f"n{trial}"
        runner.step(StepRequest([ScheduledSequence(seq_id, context[:-1], 0, list(range(20, 26)))],
                                [NewSequence(seq_id, SamplingParams(), len(context))]))
        (out,) = runner.step(StepRequest([tree_step(seq_id, context[-1], tree, len(context) - 1,
                                                    list(range(20, 26)))], finished_seq_ids=[]))
        runner.step(StepRequest(finished_seq_ids=[seq_id]))
        assert out.token_ids == naive_verify(runner.model, context, tree)
        total_accepted += len(out.token_ids) - 1
    assert total_accepted >= 3  # the comparison covered accepted paths, not only rejections


def _ancestors(tree: DraftTree, node: int) -> list[int]:
    chain = []
    while node >= 0:
        chain.append(node)
        node = tree.parents[node]
    return chain


def test_walk_descends_on_agreement_and_moves_kv_to_depth():
    # root 0 -> {1: 'a'=10, 2: 'b'=11}; 2 -> {3: 'c'=12}; 3 -> {4: 'd'=13}
    layout = TreeLayout.from_draft_parents([0, 0, 2, 3])
    assert layout.depths == [0, 1, 1, 2, 3]
    assert layout.mask()[4].tolist() == [True, False, True, True, True]
    walk = TreeWalk([9, 10, 11, 12, 13], layout)
    for token in (11, 12, 50):
        walk.offer(token)
    assert walk.is_done and walk.accepted_nodes == [2, 3]
    assert kv_moves(walk.accepted_nodes, layout.depths) == [(2, 1), (3, 2)]
    # Duplicate siblings: the walk follows the one that has the matching child.
    duplicates = TreeLayout.from_draft_parents([0, 0, 2])
    walk = TreeWalk([9, 10, 10, 12], duplicates)
    walk.offer(10)
    walk.offer(12)
    assert walk.accepted_nodes == [1, 3] and not walk.is_done


@pytest.mark.parametrize("parents, extra, message", [
    ([0, 2], {}, "draft_parents"),
    ([0], {}, "draft_parents for 2 drafts"),
    ([0, 1], {"sample_indices": [0]}, "takes no"),
])
def test_bad_trees_are_rejected(gemma3_runner, parents, extra, message):
    seq = ScheduledSequence("bad", [1, 2, 3], 0, [0], draft_parents=parents, **extra)
    with pytest.raises(InvalidRequest, match=message):
        gemma3_runner.step(StepRequest([seq], [NewSequence("bad", SamplingParams(), 1)]))


async def test_grpc_accepts_a_draft_parents_step(gemma3_runner):
    servicer = WorkerServicer(gemma3_runner)
    server, port = await start_server(servicer, "127.0.0.1", 0)
    context = PROMPT
    reference = reference_greedy(gemma3_runner.model, context, 3)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            new = worker_pb2.NewSequence(seq_id="g", num_prompt_tokens=len(context), sampling=common_pb2.SamplingParams(
                temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0))
            prefill = worker_pb2.ScheduledSequence(seq_id="g", token_ids=context[:-1], block_table=[40, 41, 42, 43])
            await stub.Step(worker_pb2.StepRequest(new_sequences=[new], sequences=[prefill]))
            # root, a wrong child, the true next two tokens under the root
            tree = worker_pb2.ScheduledSequence(
                seq_id="g", token_ids=[context[-1], (reference[0] + 1) % 400, reference[0], reference[1]],
                num_computed_tokens=len(context) - 1, block_table=[40, 41, 42, 43], draft_parents=[0, 0, 2])
            reply = await stub.Step(worker_pb2.StepRequest(sequences=[tree], finished_seq_ids=[]))
            await stub.Step(worker_pb2.StepRequest(finished_seq_ids=["g"]))
    finally:
        await server.stop(grace=None)
    assert list(reply.outputs[0].token_ids) == reference
    assert len(reply.outputs[0].scores) == 3
