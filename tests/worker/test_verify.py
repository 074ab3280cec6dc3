"""Tree verification in the worker: lossless greedy decoding, packed vs naive verification, the wire.

Trees are `CandidateTree`s (protos/segserve/v1/tree.py: parent -1 = the root); `tree_step` sends one
after its root the way the scheduler does.
"""

from __future__ import annotations

import random

import grpc
import pytest
import torch

from protos.segserve.v1 import worker_pb2, worker_pb2_grpc
from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from protos.segserve.v1.step_result import StepResult
from protos.segserve.v1.tree import CandidateTree
from tests.worker.test_model_runner import PROMPT, make_runner, reference_greedy, stock_attention
from worker.attention_plan import tree_sees
from worker.server import WorkerServicer, start_server
from worker.verify import TreeWalk, kv_moves, step_paths
from worker.work import expand

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


def tree_step(seq_id: str, root: int, tree: CandidateTree, num_computed: int, blocks: list[int]
              ) -> ScheduledSequence:
    return ScheduledSequence(seq_id, (root,), num_computed, tuple(blocks), draft=tree)


def spec_decode(runner, prompt: list[int], num_new: int, propose, params: SamplingParams = SamplingParams(),
                seq_id: str = "s", blocks: list[int] | None = None) -> tuple[list[int], int]:
    """Prefill prompt[:-1], then verify one tree per step rooted at the last token; (output, steps)."""
    blocks = blocks or list(range(3, 3 + 16))
    runner.step(StepRequest([ScheduledSequence(seq_id, prompt[:-1], 0, blocks)],
                            [NewSequence(seq_id, params, len(prompt))]))
    output, num_computed, root, num_steps = [], len(prompt) - 1, prompt[-1], 0
    while len(output) < num_new:
        (out,) = runner.step(StepRequest([tree_step(seq_id, root, propose(prompt + output), num_computed, blocks)]))
        assert not out.error and len(out.token_ids) == len(out.scores) >= 1
        output += out.token_ids
        num_computed += len(out.token_ids)
        root, num_steps = output[-1], num_steps + 1
    runner.step(StepRequest(finished_seq_ids=[seq_id]))
    return output[:num_new], num_steps


def random_tree(rng: random.Random, vocab_size: int, size: int = 8) -> CandidateTree:
    tokens = [rng.randrange(vocab_size) for _ in range(size)]
    return CandidateTree(tokens, [rng.randrange(-1, i) for i in range(size)])


def oracle_tree(true_next: list[int], vocab_size: int) -> CandidateTree:
    """The true continuation as a chain, each level placed after a wrong sibling that has a wrong child,
    so accepted nodes sit at indices far from their depths (their KV must move)."""
    token_ids, parents, parent = [], [], -1
    for depth, token in enumerate(true_next):
        wrong = (token + 1 + depth) % vocab_size
        token_ids += [wrong, (wrong * 7 + 3) % vocab_size, token]
        n = len(parents)
        parents += [parent, n, parent]
        parent = n + 2
    return CandidateTree(token_ids, parents)


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


def test_logit_bias_and_penalties_apply_at_every_tree_node(gemma3_runner):
    """Verification runs the same per-row processing as plain decoding: the outputs are identical."""
    from tests.worker.test_model_runner import Decoder, run_together

    runner, vocab = gemma3_runner, gemma3_runner.info().vocab_size
    params = SamplingParams(logit_bias={17: 6.0, 250: 4.0, 99: -3.0}, repetition_penalty=1.3)
    plain = run_together(runner, [Decoder("p", PROMPT, list(range(3, 19)), params=params)], NUM_NEW + 4)["p"]
    assert 17 in plain or 250 in plain  # the bias matters here
    propose = lambda context: oracle_tree(plain[len(context) - len(PROMPT):][:3], vocab)
    got, num_steps = spec_decode(runner, PROMPT, NUM_NEW, propose, params)
    assert got == plain[:NUM_NEW] and num_steps <= NUM_NEW // 3


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


def naive_verify(model, context: list[int], tree: CandidateTree) -> list[int]:
    """The naive form: every prefix of every root-to-leaf candidate appended to the context and run
    as its own input; keep the longest prefix the target's argmax agrees with, plus its next token."""
    paths = [[]]
    for i, parent in enumerate(tree.parents):
        paths.append((paths[parent + 1] if parent >= 0 else []) + [tree.token_ids[i]])
    leaves = [p for i, p in enumerate(paths) if i == 0 or (i - 1) not in tree.parents]
    best: list[int] = []
    with stock_attention(model), torch.inference_mode():
        def argmax_after(prefix: list[int]) -> int:
            return int(model(input_ids=torch.tensor([context + prefix], device=model.device), use_cache=False).logits[0, -1].argmax())
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
        tree = CandidateTree()
        for i in range(7):
            parent = rng.randrange(-1, i)
            depth = 1 if parent < 0 else tree.depths[parent] + 1
            on_greedy_path = all(tree.token_ids[a] == greedy[tree.depths[a] - 1] for a in _ancestors(tree, parent))
            is_true = on_greedy_path and rng.random() < 0.7
            token = greedy[depth - 1] if is_true else rng.randrange(400)
            tree = CandidateTree(tree.token_ids + (token,), tree.parents + (parent,))
        seq_id = f"n{trial}"
        runner.step(StepRequest([ScheduledSequence(seq_id, context[:-1], 0, list(range(20, 26)))],
                                [NewSequence(seq_id, SamplingParams(), len(context))]))
        (out,) = runner.step(StepRequest([tree_step(seq_id, context[-1], tree, len(context) - 1,
                                                    list(range(20, 26)))], finished_seq_ids=[]))
        runner.step(StepRequest(finished_seq_ids=[seq_id]))
        assert list(out.token_ids) == naive_verify(runner.model, context, tree)
        total_accepted += len(out.token_ids) - 1
    assert total_accepted >= 3  # the comparison covered accepted paths, not only rejections


def _ancestors(tree: CandidateTree, node: int) -> list[int]:
    chain = []
    while node >= 0:
        chain.append(node)
        node = tree.parents[node]
    return chain


def test_walk_descends_on_agreement_and_moves_kv_to_depth():
    # root 9 -> {node 1: 10, node 2: 11}; 2 -> {3: 12}; 3 -> {4: 13}
    work = expand(ScheduledSequence("w", (9,), 5, (0, 1, 2), draft=CandidateTree((10, 11, 12, 13), (-1, -1, 1, 2))))
    assert work.node_depths == (0, 1, 1, 2, 3) and work.positions == (5, 6, 6, 7, 8)
    assert tree_sees(work.node_parents)[4].tolist() == [True, False, True, True, True]
    assert work.sample_indices == (0, 1, 2, 3, 4) and step_paths(work)[4] == (9, 11, 12, 13)
    walk = TreeWalk(work)
    for token in (11, 12, 50):
        walk.offer(token)
    assert walk.is_done and walk.accepted_nodes == [2, 3]
    assert kv_moves(walk.accepted_nodes, work.node_depths) == [(2, 1), (3, 2)]
    # Duplicate siblings: the walk follows the one that has the matching child.
    duplicates = expand(ScheduledSequence("w", (9,), 0, (0,), draft=CandidateTree((10, 10, 12), (-1, -1, 1))))
    walk = TreeWalk(duplicates)
    walk.offer(10)
    walk.offer(12)
    assert walk.accepted_nodes == [1, 3] and not walk.is_done


@pytest.mark.parametrize("tree, extra, message", [
    (CandidateTree((2, 3), (-1, 2)), {}, "draft 1 has parent 2"),
    (CandidateTree((2, 3), (-1,)), {}, "2 draft tokens but 1 parents"),
    (CandidateTree((2, 3), (-1, 0)), {"sample_indices": (0,)}, "no sample_indices"),
])
def test_bad_trees_fail_their_sequence(gemma3_runner, tree, extra, message):
    seq = ScheduledSequence("bad", (1,), 0, (0,), draft=tree, **extra)
    (out,) = gemma3_runner.step(StepRequest([seq], [NewSequence("bad", SamplingParams(), 1)]))
    gemma3_runner.step(StepRequest(finished_seq_ids=["bad"]))
    assert message in out.error and out.token_ids == ()


async def test_grpc_accepts_a_tree_step(gemma3_runner):
    servicer = WorkerServicer(gemma3_runner)
    server, port = await start_server(servicer, "127.0.0.1", 0)
    context = PROMPT
    reference = reference_greedy(gemma3_runner.model, context, 3)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            new = NewSequence("g", SamplingParams(), len(context))
            prefill = ScheduledSequence("g", context[:-1], 0, (40, 41, 42, 43))
            await stub.Step(StepRequest([prefill], [new]).to_pb())
            # a wrong child of the root, then the true next two tokens under the root
            tree = CandidateTree(((reference[0] + 1) % 400, reference[0], reference[1]), (-1, -1, 1))
            work = tree_step("g", context[-1], tree, len(context) - 1, [40, 41, 42, 43])
            reply = StepResult.from_pb(await stub.Step(StepRequest([work]).to_pb()))
            await stub.Step(worker_pb2.StepRequest(finished_seq_ids=["g"]))
    finally:
        await server.stop(grace=None)
    assert list(reply.outputs[0].token_ids) == reference
    assert len(reply.outputs[0].scores) == 3
