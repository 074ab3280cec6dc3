"""Speculative sampling keeps the target distribution exactly (SPEC section 2 step 5).

The check: total-variation distance between the empirical distribution of N draws and the exact
one. Under a correct sampler E[TV] <= B = 1/2 sum_i sqrt(p_i (1 - p_i) / N) (Jensen), and TV moves
by at most 1/N when one draw changes, so P(TV > E[TV] + t) <= exp(-2 N t^2) (McDiarmid). The
threshold B + sqrt(ln(1000) / (2N)) thus fails a correct sampler with probability < 0.1% (and the
seeds are fixed), while a biased acceptance rule moves far more mass (shown below).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from tests.worker.test_verify import spec_decode, tree_step
from tests.worker.test_model_runner import PROMPT, Decoder, make_runner, run_together, stock_attention
from tests.support.tiny_models import build_small_vocab_llama
from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from protos.segserve.v1.tree import CandidateTree
from worker.verify import TreeWalk
from worker.work import expand

N = 2000
"""Draws per configuration of the worker test (each draw is a sequence decoded with trees)."""
VOCAB = 40
SMALL_PROMPT = [1, 5, 9, 13, 7, 3]


def tv_threshold(p: np.ndarray, num_draws: int) -> float:
    bound = 0.5 * np.sqrt(p * (1 - p) / num_draws).sum()
    return float(bound + math.sqrt(math.log(1000) / (2 * num_draws)))


def tv_distance(samples: np.ndarray, p: np.ndarray) -> float:
    """samples: [N] outcome indices; p: [K] exact probabilities."""
    empirical = np.bincount(samples, minlength=len(p)) / len(samples)
    return float(0.5 * np.abs(empirical - p).sum())


# --- the acceptance rule on a synthetic target, and a biased rule the check must catch -----------

def synthetic_target(prefix: tuple[int, ...], vocab: int = 5) -> np.ndarray:
    """A context-dependent distribution over 5 tokens."""
    logits = np.array([math.sin(1.7 * t + 0.9 * sum(prefix) + len(prefix)) * 2.0 for t in range(vocab)])
    return np.exp(logits) / np.exp(logits).sum()


SYNTHETIC_TREE = CandidateTree([0, 1, 2, 3, 4, 0], [-1, -1, 0, 0, 1, 2])  # wide at the root, deep on 0


def children_tokens(work) -> list[list[int]]:
    """Per node of a tree step, the tokens its children carry."""
    children: list[list[int]] = [[] for _ in work.token_ids]
    for node in range(1, len(work.token_ids)):
        children[work.node_parents[node]].append(work.token_ids[node])
    return children


def draw_first_two(rng: np.random.Generator, biased: bool) -> int:
    """One speculative draw of (t1, t2) as index t1 * 5 + t2, via TreeWalk (or a biased rule)."""
    # the root 9 is the context's last token
    work = expand(ScheduledSequence("s", (9,), 0, (0,), draft=SYNTHETIC_TREE))
    children, walk, out = children_tokens(work), TreeWalk(work), []
    while len(out) < 2:
        p = synthetic_target(tuple(out))
        liked = [] if walk.is_done else [t for t in children[walk.node] if p[t] >= 0.3]
        # The bias: take a draft the target "likes enough" instead of drawing at the node.
        token = liked[0] if biased and liked else int(rng.choice(5, p=p))
        out.append(token)
        if not walk.is_done:
            walk.offer(token)
    return out[0] * 5 + out[1]


@pytest.mark.parametrize("biased", [False, True])
def test_tv_check_passes_exact_acceptance_and_catches_a_biased_one(biased):
    rng = np.random.default_rng(0)
    exact = np.array([synthetic_target(())[a] * synthetic_target((a,))[b] for a in range(5) for b in range(5)])
    num_draws = 4000  # cheap here: no model
    samples = np.array([draw_first_two(rng, biased) for _ in range(num_draws)])
    distance, threshold = tv_distance(samples, exact), tv_threshold(exact, num_draws)
    assert threshold < 0.06  # 25 outcomes
    assert (distance > threshold) == biased, (distance, threshold)


# --- the worker on a 40-token model ----------------------------------------------------------------

@pytest.fixture(scope="module")
def small_runner(tmp_path_factory):
    model_dir = build_small_vocab_llama(tmp_path_factory.mktemp("small-vocab"))
    return make_runner(model_dir, num_kv_blocks=5 * N + 8)


def exact_tables(model, penalty: float) -> list[torch.Tensor]:
    """Plain sampling's next-token probabilities after 0, 1 and 2 generated tokens: [V], [V, V], [V, V, V]."""
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    tables = []
    with stock_attention(model), torch.inference_mode():
        for length in range(3):
            prefixes = torch.tensor(list(itertools.product(range(VOCAB), repeat=length)), dtype=torch.long)
            prefixes = prefixes.view(VOCAB**length, length)  # [V^length, length], lexicographic
            ids = torch.cat([torch.tensor(SMALL_PROMPT).expand(len(prefixes), -1), prefixes], dim=1).to(model.device)
            probs = processor(ids, model(input_ids=ids, use_cache=False).logits[:, -1].float()).softmax(-1).cpu()
            tables.append(probs.reshape(*[VOCAB] * length, VOCAB))
    return tables


def likely_tree(tables: list[torch.Tensor], generated: list[int], shape: str) -> CandidateTree:
    """Drafts from the exact tables (likely tokens, so paths are often accepted); token 0 past them."""
    def top(prefix: list[int], k: int) -> list[int]:
        if len(prefix) >= len(tables):
            return list(range(k))
        return tables[len(prefix)][tuple(prefix)].topk(k).indices.tolist()

    token_ids, parents = [], []

    def chain(parent: int, prefix: list[int], depth: int) -> None:
        for _ in range(depth):
            token = top(prefix, 1)[0]
            token_ids.append(token)
            parents.append(parent)
            parent, prefix = len(parents) - 1, prefix + [token]

    if shape == "chain":
        chain(-1, generated, 3)
    elif shape == "wide":
        for token in top(generated, 4):
            token_ids.append(token)
            parents.append(-1)
            chain(len(parents) - 1, generated + [token], 1)
    else:  # deep: a 5-long chain and the runner-up first token with its own 2-long chain
        chain(-1, generated, 5)
        second = top(generated, 2)[1]
        token_ids.append(second)
        parents.append(-1)
        chain(len(parents) - 1, generated + [second], 2)
    return CandidateTree(token_ids, parents)


def speculative_samples(runner, tables, shape: str, params: SamplingParams, first_seed: int
                        ) -> tuple[np.ndarray, float]:
    """N sequences (seeds first_seed, ...) decoded together with trees until each has 3 tokens.

    Returns the first 3 tokens [N, 3] and the mean number of tokens per verification step.
    """
    ids = [f"d{i}" for i in range(N)]
    blocks = {s: list(range(5 * i, 5 * i + 5)) for i, s in enumerate(ids)}
    new = [NewSequence(s, dataclasses.replace(params, seed=first_seed + i), len(SMALL_PROMPT))
           for i, s in enumerate(ids)]
    runner.step(StepRequest([ScheduledSequence(s, SMALL_PROMPT[:-1], 0, blocks[s]) for s in ids], new))
    output, num_steps = {s: [] for s in ids}, 0
    while active := [s for s in ids if len(output[s]) < 3]:
        steps = [tree_step(s, (SMALL_PROMPT + output[s])[-1], likely_tree(tables, output[s], shape),
                           len(SMALL_PROMPT) - 1 + len(output[s]), blocks[s]) for s in active]
        for out in runner.step(StepRequest(steps)):
            output[out.seq_id] += out.token_ids
        num_steps += len(steps)
    runner.step(StepRequest(finished_seq_ids=ids))
    return np.array([output[s][:3] for s in ids]), sum(len(o) for o in output.values()) / num_steps


@pytest.mark.parametrize("penalty", [1.0, 1.5])
@pytest.mark.parametrize("shape", ["chain", "wide", "deep"])
def test_speculative_sampling_matches_plain_distribution(small_runner, shape, penalty):
    tables = exact_tables(small_runner.model, penalty)
    # Seeded draws with speculation equal plain seeded draws token for token, so every configuration
    # gets its own seeds: otherwise all shapes would produce the very same samples.
    first_seed = 1 + N * (["chain", "wide", "deep"].index(shape) + 3 * (penalty != 1.0))
    params = SamplingParams(do_sample=True, repetition_penalty=penalty)
    samples, tokens_per_step = speculative_samples(small_runner, tables, shape, params, first_seed)
    assert tokens_per_step > 1.4  # drafts were accepted often (measured 1.6-2.0), not only rejected
    pair = (tables[0][:, None] * tables[1]).reshape(-1).numpy()  # P(t1, t2): [V * V]
    third = (tables[0][:, None, None] * tables[1][:, :, None] * tables[2]).sum((0, 1)).numpy()  # P(t3): [V]
    for outcome, p in ((samples[:, 0] * VOCAB + samples[:, 1], pair), (samples[:, 2], third)):
        assert tv_distance(outcome, p) < tv_threshold(p, N)


def test_seeded_sampling_gives_the_same_tokens_with_and_without_trees(tiny_gemma3_dir):
    """One uniform per output token, drawn in order: a seeded request is token-identical either way."""
    runner = make_runner(tiny_gemma3_dir)
    params = SamplingParams(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.3, seed=7)
    plain = run_together(runner, [Decoder("p", PROMPT, list(range(30, 46)), params=params)], 16)["p"]

    def tree_of(context: list[int]) -> CandidateTree:  # the plain output's next 3 tokens after a wrong sibling
        upcoming = plain[len(context) - len(PROMPT):][:3]
        return CandidateTree([(upcoming[0] + 1) % 400] + upcoming, [-1, -1, 1, 2][: len(upcoming) + 1])

    speculative, num_steps = spec_decode(runner, PROMPT, 16, tree_of, params)
    assert speculative == plain and num_steps <= 16 // 3
