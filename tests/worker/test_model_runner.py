"""The model runner against the stock transformers model: greedy decoding, batching, KV paging, trees."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from protos.segserve.v1.sampling import SamplingParams
from protos.segserve.v1.step import NewSequence, ScheduledSequence, StepRequest
from protos.segserve.v1.tree import CandidateTree
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner
from tests.support.devices import TEST_DEVICE
from tests.support.exact import assert_as_exact_as, exact_last_logits, tree_paths
from segserve.bench.random_models import TINY_GEMMA3, save_random
from tests.support.tiny_models import LLAMA_KIN
from worker.sampler import sample
from worker.validation import InvalidRequest

BLOCK_SIZE = 4
PROMPT = [1, 50, 60, 70, 80, 90, 100, 33, 21, 7, 140]


def make_runner(model_dir, num_kv_blocks: int = 64, block_size: int = BLOCK_SIZE, **fields) -> ModelRunner:
    # float32 everywhere (also on a GPU) so that greedy choices compare exactly with the reference
    config = WorkerConfig(model=str(model_dir), num_kv_blocks=num_kv_blocks, block_size=block_size, dtype="float32",
                          device=TEST_DEVICE, **fields)
    runner = ModelRunner(config)
    runner.warm_up()
    return runner


def logits_of(runner: ModelRunner, request: StepRequest) -> torch.Tensor:
    """The float32 logits [N, V] that runner.step(request) samples from, one row per sample index (every node of a
    tree) in request order: its own state update and forward, without the sampling."""
    plan = runner.update_states(request)
    if plan.rejected:
        raise InvalidRequest("; ".join(plan.rejected.values()))
    return runner.execute(plan)[:plan.num_sample_rows]


@pytest.fixture(scope="module")
def gemma3_runner(tiny_gemma3_dir):
    return make_runner(tiny_gemma3_dir)


@pytest.fixture(scope="module")
def llama_runner(tiny_llama_dir):
    return make_runner(tiny_llama_dir)


@pytest.fixture(scope="module")
def mistral_runner(tiny_mistral_dir):
    return make_runner(tiny_mistral_dir)


@pytest.fixture(scope="module")
def qwen2_runner(tiny_qwen2_dir):
    return make_runner(tiny_qwen2_dir)


@pytest.fixture(scope="module")
def qwen3_runner(tiny_qwen3_dir):
    return make_runner(tiny_qwen3_dir)


ARCHITECTURES = ("gemma3", "llama", *LLAMA_KIN)


@pytest.fixture(params=ARCHITECTURES)
def runner(request):
    return request.getfixturevalue(f"{request.param}_runner")


@contextlib.contextmanager
def stock_attention(model, implementation: str = "sdpa"):
    """Run the same weights with transformers' own attention (the reference): SDPA, or "eager"."""
    model.set_attn_implementation(implementation)
    try:
        yield model
    finally:
        model.set_attn_implementation("segserve_paged")


def reference_greedy(model, prompt: list[int], num_new: int) -> list[int]:
    with stock_attention(model), torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=model.device), do_sample=False, max_new_tokens=num_new,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def reference_last_logits(model, token_ids: list[int], implementation: str = "sdpa") -> torch.Tensor:
    """Logits after `token_ids`, computed from scratch with no cache, under transformers' `implementation`: [V]."""
    with stock_attention(model, implementation), torch.inference_mode():
        ids = torch.tensor([token_ids], device=model.device)
        return model(input_ids=ids, use_cache=False).logits[0, -1].float()


class Decoder:
    """Drives one sequence through the runner the way the scheduler does: chunked prefill, then decode."""

    def __init__(self, seq_id: str, prompt: list[int], blocks: list[int], chunks: list[int] | None = None,
                 params: SamplingParams | None = None):
        self.seq_id, self.prompt, self.blocks = seq_id, prompt, blocks
        self.pending = _split(prompt, chunks or [len(prompt)])
        self.new = NewSequence(seq_id, params or SamplingParams(), len(prompt))
        self.num_computed, self.output = 0, []

    def work(self) -> ScheduledSequence:
        tokens = self.pending[0] if self.pending else [self.output[-1]]
        is_last_chunk = len(self.pending) <= 1
        return ScheduledSequence(self.seq_id, tokens, self.num_computed, self.blocks,
                                 sample_indices=[len(tokens) - 1] if is_last_chunk else [])

    def advance(self, work: ScheduledSequence, sampled: list[int]) -> None:
        self.num_computed += len(work.token_ids)
        if self.pending:
            self.pending.pop(0)
        self.output += sampled


def _split(tokens: list[int], sizes: list[int]) -> list[list[int]]:
    out, start = [], 0
    for size in sizes:
        out.append(tokens[start:start + size])
        start += size
    assert start == len(tokens)
    return out


def run_together(runner: ModelRunner, decoders: list[Decoder], num_new: int) -> dict[str, list[int]]:
    """Step all decoders in shared batches until each has num_new tokens; then forget them."""
    new = [d.new for d in decoders]
    while any(len(d.output) < num_new for d in decoders):
        active = [d for d in decoders if len(d.output) < num_new]
        works = [d.work() for d in active]
        outputs = {o.seq_id: list(o.token_ids) for o in runner.step(StepRequest(works, new))}
        new = []
        for d, w in zip(active, works):
            d.advance(w, outputs.get(d.seq_id, []))
    runner.step(StepRequest(finished_seq_ids=[d.seq_id for d in decoders]))
    return {d.seq_id: d.output for d in decoders}


def test_greedy_decode_matches_generate(runner):
    """Uneven prefill chunks, a scattered block table, 20 tokens: far past tiny Gemma3's window of 8."""
    num_new = 20
    blocks = [9, 2, 31, 5, 17, 3, 40, 11]
    got = run_together(runner, [Decoder("a", PROMPT, blocks, chunks=[3, 5, 3])], num_new)["a"]
    assert got == reference_greedy(runner.model, PROMPT, num_new)


@pytest.mark.real_model
def test_real_model_greedy_matches_generate(default_model_dir):
    from transformers import AutoTokenizer

    runner = make_runner(default_model_dir, num_kv_blocks=8, block_size=16)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    texts = ["The capital of France is Paris. The capital of Germany is",
             "def add(a, b):\n    return a + b\n\ndef mul("]
    prompts = [tokenizer(t).input_ids for t in texts]
    decoders = [Decoder(f"p{i}", p, [i * 2, i * 2 + 1], chunks=[5, len(p) - 5]) for i, p in enumerate(prompts)]
    got = run_together(runner, decoders, 4)
    for i, prompt in enumerate(prompts):
        assert got[f"p{i}"] == reference_greedy(runner.model, prompt, 4)


@pytest.mark.real_model
def test_real_model_greedy_matches_generate_past_the_sliding_window(default_model_dir):
    """A 673-token context, prefilled in two chunks, then decoded: past the first decode step gemma-3-270m's
    sliding layers (a window of 512) read 544 of the 704 keys (bucketed), and give transformers' tokens."""
    from transformers import AutoTokenizer

    runner = make_runner(default_model_dir, num_kv_blocks=48, block_size=16)
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    text = " ".join(f"Item {i}: the {i % 7}th shelf holds {i * 3} boxes." for i in range(42)) + " Item 42: the"
    prompt = tokenizer(text).input_ids
    assert 600 < len(prompt) < 740
    got = run_together(runner, [Decoder("w", prompt, list(range(48)), chunks=[300, len(prompt) - 300])], 12)["w"]
    assert got == reference_greedy(runner.model, prompt, 12)


def test_batch_invariance(runner):
    assert_batch_invariant(runner)


def assert_batch_invariant(runner: ModelRunner) -> None:
    """Sequences of different lengths, prefilling and decoding in shared steps, match decoding alone."""
    prompts = {"short": PROMPT[:3], "mid": PROMPT[:9], "long": PROMPT + [200, 201, 202]}
    tables = {"short": [0, 1, 2, 3, 4, 5], "mid": [6, 7, 8, 9, 10, 11, 12], "long": [13, 14, 15, 16, 17, 18, 19]}
    chunks = {"short": [3], "mid": [4, 5], "long": [2, 6, 6]}
    together = run_together(runner, [Decoder(k, p, tables[k], chunks[k]) for k, p in prompts.items()], 12)
    for key, prompt in prompts.items():
        alone = run_together(runner, [Decoder(key, prompt, tables[key])], 12)
        assert together[key] == alone[key]


def _prefill_logits(runner: ModelRunner, seq_id: str, tokens: list[int], blocks: list[int]) -> torch.Tensor:
    work = ScheduledSequence(seq_id, tokens, 0, blocks, sample_indices=list(range(len(tokens))))
    logits = logits_of(runner, StepRequest([work], [NewSequence(seq_id, SamplingParams(), len(tokens))]))
    decode = ScheduledSequence(seq_id, [5], len(tokens), blocks, sample_indices=[0])
    logits = torch.cat([logits, logits_of(runner, StepRequest([decode]))])
    runner.step(StepRequest(finished_seq_ids=[seq_id]))
    return logits


def prefill_rows(tokens: list[int]) -> list[list[int]]:
    """The token sequence behind each row _prefill_logits returns."""
    return [tokens[:i + 1] for i in range(len(tokens))] + [tokens + [5]]


def test_block_tables_scattered_and_reused(runner):
    tokens = PROMPT + [3, 4, 5, 6]
    contiguous = _prefill_logits(runner, "a", tokens, [0, 1, 2, 3, 4])
    shuffled = _prefill_logits(runner, "b", tokens, [37, 12, 50, 8, 21])
    assert_as_exact_as(shuffled, contiguous, exact_last_logits(runner.config.model, prefill_rows(tokens)))
    # Blocks 37, 12, ... now hold another sequence's keys: a new one reusing them must not see them.
    other = [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8, 7, 6, 5, 4]
    fresh = _prefill_logits(runner, "c", other, [60, 61, 62, 63])
    reused = _prefill_logits(runner, "d", other, [12, 50, 37, 8])
    assert_as_exact_as(reused, fresh, exact_last_logits(runner.config.model, prefill_rows(other)))


# A candidate tree after the root 77: parent of each draft (-1 = the root).
ROOT_TOKEN = 77
TREE = CandidateTree((12, 250, 31, 99, 140, 5, 64), (-1, -1, 0, 0, 1, 2, 5))


def node_paths(tree: CandidateTree) -> list[list[int]]:
    """Each node's tokens from the root: node 0 is the root, node i + 1 is draft i."""
    return tree_paths(ROOT_TOKEN, tree)


def test_tree_forward_matches_naive(runner):
    """One packed tree forward (tree mask + depth positions) equals each root-to-node path run from scratch."""
    context = PROMPT + [200, 201, 202, 203]  # 15 tokens: the tree's keys cross the sliding window of 8
    blocks = (20, 3, 44, 9, 30, 1)
    prefill = ScheduledSequence("t", context, 0, blocks)
    runner.step(StepRequest([prefill], [NewSequence("t", SamplingParams(), len(context))]))
    tree = ScheduledSequence("t", (ROOT_TOKEN,), len(context), blocks, draft=TREE)
    packed = logits_of(runner, StepRequest([tree]))
    runner.step(StepRequest(finished_seq_ids=["t"]))
    assert packed.shape[0] == len(TREE) + 1
    rows = [context + path for path in node_paths(TREE)]
    naive = torch.stack([reference_last_logits(runner.model, row) for row in rows]).to(packed.device)
    assert_as_exact_as(packed, naive, exact_last_logits(runner.config.model, rows))


def test_tree_sampling_sees_each_nodes_path(runner):
    """Penalties at a tree node count the node's own path, exactly as a plain sequence ending there."""
    # Top log-probabilities are normalized over the whole penalized row, so any history difference shows.
    params = SamplingParams(repetition_penalty=3.0, frequency_penalty=2.0, num_top_logprobs=3)
    context = PROMPT[:6]
    blocks = tuple(range(10, 14))
    runner.step(StepRequest([ScheduledSequence("t", context, 0, blocks)], [NewSequence("t", params, 3)]))
    plan = runner.update_states(StepRequest([ScheduledSequence("t", (ROOT_TOKEN,), len(context), blocks,
                                                                draft=TREE)]))
    logits = runner.execute(plan)  # [nodes, V]
    (work,) = plan.works
    rows = runner.sample_rows(work)  # one a node, each with its node's path: the penalties ask for history
    assert len(rows) == len(TREE) + 1
    tree_out = sample(logits, rows)
    runner.step(StepRequest(finished_seq_ids=["t"]))
    for node, path in enumerate(node_paths(TREE)):
        tokens = context + path
        plain = ScheduledSequence("p", tokens, 0, tuple(range(20, 24)), sample_indices=[len(tokens) - 1])
        (out,) = runner.step(StepRequest([plain], [NewSequence("p", params, 3)], finished_seq_ids=["p"]))
        assert tree_out.token_ids[node] == out.token_ids[0]
        assert tree_out.scores[node] == pytest.approx(out.scores[0], abs=1e-4)
        assert tree_out.top_logprobs[node][0] == list(out.top_logprobs[0].token_ids)
        assert tree_out.top_logprobs[node][1] == pytest.approx(out.top_logprobs[0].logprobs, abs=1e-4)


@pytest.mark.parametrize("bad, message", [
    (dict(seq_id="nobody"), "unknown seq_id"),
    (dict(block_table=()), "block_table"),
    (dict(block_table=(64,)), "block ids"),
    (dict(token_ids=(1, 2, 400)), "token_ids"),
    (dict(num_computed_tokens=7), "knows only"),
    (dict(sample_indices=(3,)), "sample_indices"),
    (dict(token_ids=(1,), sample_indices=(), draft=CandidateTree((5, 6), (-1, 3))), "invalid draft tree"),
    (dict(token_ids=(1,), sample_indices=(), draft=CandidateTree((5, 6), (-1,))), "invalid draft tree"),
    (dict(token_ids=(1,), sample_indices=(), draft=CandidateTree((5, 999), (-1, 0))), "vocabulary"),
    (dict(token_ids=(1, 2), sample_indices=(), draft=CandidateTree((5,), (-1,))), "exactly one token"),
    (dict(token_ids=(1,), sample_indices=(), draft=CandidateTree((5,) * 8, (-1,) * 8)), "block_table"),
])
def test_invalid_sequences_get_an_error_and_no_side_effects(gemma3_runner, bad, message):
    runner = gemma3_runner
    good = dict(seq_id="v", token_ids=(1, 2, 3), num_computed_tokens=0, block_table=(0, 1), sample_indices=(2,))
    runner.step(StepRequest(new_sequences=[NewSequence("v", SamplingParams(), 3)], finished_seq_ids=["v"]))
    (failed,) = runner.step(StepRequest([ScheduledSequence(**{**good, **bad})]))
    assert failed.seq_id == bad.get("seq_id", "v") and message in failed.error and failed.token_ids == ()
    # The failed step changed nothing: the sequence still starts from scratch.
    (first,) = runner.step(StepRequest([ScheduledSequence(**good)]))
    (again,) = runner.step(StepRequest([ScheduledSequence(**good)], [NewSequence("v", SamplingParams(), 3)]))
    assert not first.error and first.token_ids == again.token_ids


def test_overlapping_slots_and_duplicates_reject_the_step(gemma3_runner):
    runner = gemma3_runner
    new = [NewSequence("x", SamplingParams(), 2), NewSequence("y", SamplingParams(), 2)]
    clash = [ScheduledSequence("x", (1, 2), 0, (5,)), ScheduledSequence("y", (3, 4), 0, (5,))]
    with pytest.raises(InvalidRequest, match="same KV-cache slot"):
        runner.step(StepRequest(clash, new))
    assert not {"x", "y"} & set(runner.block_tables._rows)  # a refused step keeps no block-table rows
    twice = [ScheduledSequence("x", (1, 2), 0, (5,)), ScheduledSequence("x", (1, 2), 0, (6,))]
    with pytest.raises(InvalidRequest, match="scheduled twice"):
        runner.step(StepRequest(twice, new))
    runner.step(StepRequest(new_sequences=new, finished_seq_ids=[]))
    runner.step(StepRequest(finished_seq_ids=["x"]))
    (out,) = runner.step(StepRequest([ScheduledSequence("x", (1,), 0, (5,), sample_indices=(0,))]))
    assert "unknown seq_id" in out.error
    runner.step(StepRequest(finished_seq_ids=["y"]))


def test_logit_bias_moves_greedy_choice_at_every_step(gemma3_runner):
    """A strong bias on one token makes greedy decoding pick it; a strong negative one bans the favourite."""
    plain = run_together(gemma3_runner, [Decoder("b", PROMPT, list(range(40, 48)))], 4)["b"]
    forced = SamplingParams(logit_bias={123: 100.0})
    got = run_together(gemma3_runner, [Decoder("b", PROMPT, list(range(40, 48)), params=forced)], 4)["b"]
    assert plain != [123] * 4 and got == [123] * 4
    banned = SamplingParams(logit_bias={plain[0]: -100.0})
    got = run_together(gemma3_runner, [Decoder("b", PROMPT, list(range(40, 48)), params=banned)], 1)["b"]
    assert got[0] != plain[0]


def test_info_describes_model_and_cache(gemma3_runner):
    info = gemma3_runner.info()
    assert (info.num_kv_blocks, info.block_size, info.vocab_size, info.max_model_len) == (64, BLOCK_SIZE, 400, 512)
    assert info.eos_token_ids == (gemma3_runner.model.config.eos_token_id,)
    assert info.dtype == "float32" and info.device == str(gemma3_runner.model.device)
    assert gemma3_runner.is_ready


@pytest.mark.parametrize("chunks", [[(1, 1), (1, 1)], [(3, 3), (3, 3)], [(4, 4), (4, 4)], [(1, 1), (3, 3)]],
                         ids=["decoding", "padded-prefill", "whole-prefill", "mixed"])
def test_attention_without_gather_or_scatter_gives_the_same_logits(runner, monkeypatch, chunks):
    """The step's only group with no padding query reads its queries and writes its output in place; the logits
    are exactly those of gathering and scattering its rows."""
    from worker import forward_path

    plan_groups = forward_path.plan_groups
    seen = []

    def plan_groups_without_shortcut(*args):
        plans = plan_groups(*args)
        seen.append(len(plans) == 1 and plans[0].is_whole_step)
        for plan in plans:
            plan.is_whole_step = False
        return plans

    prompts = [PROMPT[:9], PROMPT[2:11]]
    logits = {}
    for is_shortcut in (True, False):
        if not is_shortcut:
            monkeypatch.setattr(forward_path, "plan_groups", plan_groups_without_shortcut)
        ids = [f"s{i}" for i in range(len(chunks))]
        new = [NewSequence(i, SamplingParams(), len(p)) for i, p in zip(ids, prompts)]
        prefill = [ScheduledSequence(i, p[:4], 0, [10 * k, 10 * k + 1, 10 * k + 2], sample_indices=[3])
                   for k, (i, p) in enumerate(zip(ids, prompts))]
        logits_of(runner, StepRequest(prefill, new))
        step = [ScheduledSequence(i, p[4:4 + n], 4, [10 * k, 10 * k + 1, 10 * k + 2], sample_indices=list(range(s)))
                for k, (i, p, (n, s)) in enumerate(zip(ids, prompts, chunks))]
        logits[is_shortcut] = logits_of(runner, StepRequest(step))
        runner.step(StepRequest(finished_seq_ids=ids))
    assert torch.equal(logits[True], logits[False])
    is_whole = {"[(1, 1), (1, 1)]": True, "[(3, 3), (3, 3)]": False, "[(4, 4), (4, 4)]": True, "[(1, 1), (3, 3)]": False}
    assert seen[-1] == is_whole[str(chunks)]  # the compared step's, after its prefill's


def windowed_and_full(run, windowed_keys=None) -> tuple[torch.Tensor, torch.Tensor]:
    """run() twice: the sliding layers on their windowed key ranges (WindowSource.keys, or `windowed_keys` in its
    place), then reading every key (every window declined)."""
    import worker.attention as attention

    results = []
    for keys in (windowed_keys or attention.WindowSource.keys, lambda source, window, group: None):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(attention.WindowSource, "keys", keys)
            results.append(run())
    return results[0], results[1]


@pytest.fixture(scope="module")
def fine_keys_gemma3_runner(tiny_gemma3_dir):
    """Key lengths padded as eager steps pad them without graphs (on CUDA too, where a runner with graphs pads them
    to powers of two from 64 keys: these tests' contexts would then all be one length, windowed or not)."""
    return make_runner(tiny_gemma3_dir, is_cuda_graphs=False)


@pytest.mark.parametrize("first_work", ["decode", "tree"])
def test_sliding_layers_read_only_their_window_and_give_the_logits_of_every_key(fine_keys_gemma3_runner, first_work):
    """Past tiny Gemma3's window of 8, its sliding layers gather the keys within reach of their queries, not the
    whole context, and give the logits of gathering every key and masking the ones out of reach (to rounding:
    the kernel sums fewer masked keys)."""
    import worker.attention as attention

    runner = fine_keys_gemma3_runner

    windowed_keys = attention.WindowSource.keys
    key_counts = []  # (the group's keys, the window layer's) per group, since the last clear()
    compared = []  # key_counts of each run's compared step

    def counting_keys(source, window, group):
        result = windowed_keys(source, window, group)
        key_counts.append((group.key_slots.shape[1], result[0].shape[1] if result is not None else None))
        return result

    long, chunked = list(range(3, 43)), list(range(50, 85))  # 40 and 35 tokens
    blocks = {"long": list(range(0, 12)), "chunked": list(range(30, 20, -1))}

    def run() -> torch.Tensor:
        new = [NewSequence("long", SamplingParams(), len(long)), NewSequence("chunked", SamplingParams(), len(chunked))]
        runner.step(StepRequest([ScheduledSequence("long", long, 0, blocks["long"]),
                                 ScheduledSequence("chunked", chunked[:30], 0, blocks["chunked"])], new))
        if first_work == "decode":
            work = ScheduledSequence("long", [7], len(long), blocks["long"], sample_indices=[0])
        else:
            work = ScheduledSequence("long", (ROOT_TOKEN,), len(long), blocks["long"], draft=TREE)
        key_counts.clear()
        step = [work, ScheduledSequence("chunked", chunked[30:], 30, blocks["chunked"], sample_indices=[0, 4])]
        logits = logits_of(runner, StepRequest(step))
        compared.append(list(key_counts))
        runner.step(StepRequest(finished_seq_ids=["long", "chunked"]))
        return logits

    windowed, full = windowed_and_full(run, counting_keys)
    # every group (one query and five prompt tokens; or those with the tree) read fewer keys when windowed
    assert len(compared[0]) == (2 if first_work == "decode" else 1)
    assert all(windowed is not None and windowed < keys for keys, windowed in compared[0])
    long_rows = [long + [7]] if first_work == "decode" else [long + path for path in node_paths(TREE)]
    rows = long_rows + [chunked[:31], chunked[:35]]
    assert_as_exact_as(windowed, full, exact_last_logits(runner.config.model, rows))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_windowed_keys_give_the_logits_of_every_key_for_any_mix_of_contexts_and_chunks(gemma3_runner, data):
    """One to three sequences with any cached context (0-60 tokens) each compute a chunk of 1-9 tokens in one
    step, on shuffled blocks; the logits of every new token are those of reading every key, to rounding."""
    num_seqs = data.draw(st.integers(1, 3), label="sequences")
    sizes = [(data.draw(st.integers(0, 60)), data.draw(st.integers(1, 9))) for _ in range(num_seqs)]
    tokens = [data.draw(st.lists(st.integers(3, 399), min_size=c + n, max_size=c + n)) for c, n in sizes]
    pool = data.draw(st.permutations(range(64)))
    blocks, used = [], 0
    for context, new in sizes:
        count = -(-(context + new) // BLOCK_SIZE)
        blocks.append(pool[used:used + count])
        used += count
    ids = [f"h{i}" for i in range(num_seqs)]

    def run() -> torch.Tensor:
        prefill = [ScheduledSequence(i, t[:c], 0, b) for i, t, (c, _), b in zip(ids, tokens, sizes, blocks) if c]
        new = [NewSequence(i, SamplingParams(), c + n) for i, (c, n) in zip(ids, sizes)]
        if prefill:
            gemma3_runner.step(StepRequest(prefill, new))
            new = [n for n in new if n.seq_id not in {p.seq_id for p in prefill}]
        step = [ScheduledSequence(i, t[c:], c, b, sample_indices=list(range(n)))
                for i, t, (c, n), b in zip(ids, tokens, sizes, blocks)]
        logits = logits_of(gemma3_runner, StepRequest(step, new))
        gemma3_runner.step(StepRequest(finished_seq_ids=ids))
        return logits

    windowed, full = windowed_and_full(run)
    rows = [t[:c + j + 1] for t, (c, n) in zip(tokens, sizes) for j in range(n)]
    assert_as_exact_as(windowed, full, exact_last_logits(gemma3_runner.config.model, rows))


def test_greedy_decode_with_windowed_sliding_layers_matches_generate(gemma3_runner):
    """Chunked prefill and 40 decode steps, the sliding layers on windowed key ranges: transformers' tokens."""
    prompt = PROMPT + list(range(200, 230))  # 41 tokens
    got = run_together(gemma3_runner, [Decoder("w", prompt, list(range(40, 64)), chunks=[17, 9, 15])], 40)["w"]
    assert got == reference_greedy(gemma3_runner.model, prompt, 40)


@pytest.fixture(scope="module")
def capped_gemma2_dir(tmp_path_factory):
    """A tiny Gemma2, the kind of model that caps its attention logits (tanh), here at 0.5: low enough to change
    every layer's output. It runs on transformers' forward (there is no lean Gemma2)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(**{**TINY_GEMMA3, "attn_logit_softcapping": 0.5, "final_logit_softcapping": None})
    return save_random(Gemma2ForCausalLM, config, tmp_path_factory.mktemp("capped-gemma2"))


def test_capped_attention_logits_give_transformers_logits(capped_gemma2_dir):
    """Capped attention logits (softcap, which SDPA cannot do): a chunked prefill, a decode step and a tree past the
    sliding window give the logits of transformers' eager attention, which caps them."""
    runner = make_runner(capped_gemma2_dir)
    context = PROMPT + [200, 201, 202, 203]  # 15 tokens: past the sliding window of 8
    blocks = (20, 3, 44, 9, 30, 1)
    runner.step(StepRequest([ScheduledSequence("t", context[:9], 0, blocks)],
                            [NewSequence("t", SamplingParams(), len(context))]))
    runner.step(StepRequest([ScheduledSequence("t", context[9:], 9, blocks)]))
    decode = logits_of(runner, StepRequest([ScheduledSequence("t", (ROOT_TOKEN,), len(context), blocks,
                                                              sample_indices=(0,))]))
    tree = logits_of(runner, StepRequest([ScheduledSequence("t", (ROOT_TOKEN,), len(context), blocks,
                                                            draft=TREE)]))
    runner.step(StepRequest(finished_seq_ids=["t"]))
    uncapped = AutoModelForCausalLM.from_pretrained(capped_gemma2_dir, dtype=torch.float32).to(runner.device)
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    rows = [context + path for path in node_paths(TREE)]
    expected = torch.stack([reference_last_logits(runner.model, row, "eager") for row in rows]).to(tree.device)
    assert_as_exact_as(tree, expected, exact_last_logits(capped_gemma2_dir, rows))
    for row, capped in zip(rows, expected):
        assert not torch.allclose(reference_last_logits(uncapped, row, "eager").to(tree.device),
                                  capped, atol=1e-2)  # the cap matters
    torch.testing.assert_close(decode[0], tree[0])


def test_layers_share_one_additive_mask_per_window_in_a_step(fine_keys_gemma3_runner, monkeypatch):
    """SDPA gets an additive mask of the queries' dtype (0 or -inf), made once per step for each window: tiny
    Gemma3's three sliding layers share one and its full-attention layer has its own, instead of SDPA converting a
    boolean mask at every layer."""
    runner, sdpa = fine_keys_gemma3_runner, torch.nn.functional.scaled_dot_product_attention
    masks = []

    def recording_sdpa(query, key, value, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    blocks = list(range(8))
    runner.step(StepRequest([ScheduledSequence("m", PROMPT, 0, blocks)],
                            [NewSequence("m", SamplingParams(), len(PROMPT))]))
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    runner.step(StepRequest([ScheduledSequence("m", (ROOT_TOKEN,), len(PROMPT), blocks, sample_indices=(0,))]))
    runner.step(StepRequest(finished_seq_ids=["m"]))
    assert len(masks) == len(runner.model.model.layers) == 4
    assert len({id(mask) for mask in masks}) == 2
    for mask in masks:
        assert mask.dtype == torch.float32
        assert set(mask.unique().tolist()) == {0.0, float("-inf")}
