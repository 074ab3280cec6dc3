"""Draft models: greedy chains and branches, the incremental per-request cache, self-speculative drafts."""

from __future__ import annotations

import pytest
import torch

from drafter.draft_head import most_frequent_token_ids
from drafter.draft_model import DraftModel, load_draft_model, parse_draft_model_spec
from drafter.types import Continuation, ContinuationSource

# Long enough to cross the tiny Gemma3's sliding window (8) several times.
CONTEXT = [1, 57, 203, 44, 91, 310, 12, 77, 150, 260, 33, 8, 199, 120]


def _greedy(model, context: list[int], num_tokens: int) -> list[int]:
    """Reference greedy decoding with no cache at all: one full forward per token."""
    tokens = list(context)
    with torch.inference_mode():
        for _ in range(num_tokens):
            logits = model(input_ids=torch.tensor([tokens])).logits  # [1, n, V]
            tokens.append(int(logits[0, -1].argmax()))
    return tokens[len(context) :]


def _next_probs(model, context: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([context])).logits  # [1, n, V]
    return torch.softmax(logits[0, -1].float(), dim=-1)  # [V]


@pytest.fixture(scope="module")
def gemma_draft(tiny_gemma3_dir) -> DraftModel:
    return load_draft_model({"kind": "model", "path": str(tiny_gemma3_dir)})


@pytest.fixture(scope="module")
def llama_draft(tiny_llama_dir) -> DraftModel:
    return load_draft_model({"kind": "model", "path": tiny_llama_dir})


def test_is_a_continuation_source(gemma_draft):
    assert isinstance(gemma_draft, DraftModel)
    source: ContinuationSource = gemma_draft
    assert source.propose(CONTEXT, max_len=2, max_candidates=1)[0].token_ids


@pytest.mark.parametrize("draft_name", ["gemma_draft", "llama_draft"])
def test_chain_is_the_models_own_greedy_continuation(draft_name, request):
    draft = request.getfixturevalue(draft_name)
    proposals = draft.propose(CONTEXT, max_len=6, max_candidates=1)
    assert len(proposals) == 1
    assert list(proposals[0].token_ids) == _greedy(draft.model, CONTEXT, 6)


def test_branches_are_top_alternatives_sorted_by_path_probability(gemma_draft):
    proposals = gemma_draft.propose(CONTEXT, max_len=5, max_candidates=4)
    chain, branches = proposals[0], proposals[1:]
    assert len(chain.token_ids) == 5 and len(branches) == 3
    scores = [b.score for b in branches]
    assert scores == sorted(scores, reverse=True)
    for branch in branches:
        position = len(branch.token_ids) - 1
        assert position < gemma_draft.num_branch_positions
        assert branch.token_ids[:position] == chain.token_ids[:position]
        assert branch.token_ids[position] != chain.token_ids[position]
    # Scores are path probabilities: check the first-position alternatives exactly.
    probs = _next_probs(gemma_draft.model, CONTEXT)
    top = torch.topk(probs, k=4)
    assert chain.token_ids[0] == int(top.indices[0])
    first_alternatives = {b.token_ids[0]: b.score for b in branches if len(b.token_ids) == 1}
    assert first_alternatives, "the best branch should deviate at the first position here"
    for token_id, score in first_alternatives.items():
        assert score == pytest.approx(float(probs[token_id]), rel=1e-4)
    chain_prob = float(probs[chain.token_ids[0]])
    for i in range(1, 5):
        chain_prob *= float(_next_probs(gemma_draft.model, CONTEXT + list(chain.token_ids[:i]))[chain.token_ids[i]])
    assert chain.score == pytest.approx(chain_prob, rel=1e-3)


def test_degenerate_requests_propose_nothing(gemma_draft):
    assert gemma_draft.propose([], max_len=4, max_candidates=2) == []
    assert gemma_draft.propose(CONTEXT, max_len=0, max_candidates=2) == []
    assert gemma_draft.propose(CONTEXT, max_len=4, max_candidates=0) == []


def test_incremental_cache_matches_fresh_runs_after_appends_and_divergence(gemma_draft):
    fresh = lambda ctx: gemma_draft.propose(ctx, max_len=4, max_candidates=3)  # noqa: E731
    incremental = lambda ctx: gemma_draft.propose_for("req-1", ctx, max_len=4, max_candidates=3)  # noqa: E731
    context = list(CONTEXT)
    first = incremental(context)
    _assert_same(first, fresh(context))
    # All drafts accepted plus the target's own token: the cache already holds most of it.
    context = context + list(first[0].token_ids) + [5]
    _assert_same(incremental(context), fresh(context))
    # Drafts rejected: the target chose another token after the first draft.
    second = fresh(context)
    context = context + [second[0].token_ids[0], (second[0].token_ids[1] + 1) % 300]
    _assert_same(incremental(context), fresh(context))
    # The same context twice, then a context that diverges deep inside (beyond the window).
    _assert_same(incremental(context), fresh(context))
    context = context[:3] + [42] + context[4:]
    _assert_same(incremental(context), fresh(context))
    assert gemma_draft.num_cached_requests == 1
    gemma_draft.release("req-1")
    gemma_draft.release("unknown")
    assert gemma_draft.num_cached_requests == 0


def test_cached_requests_are_bounded_least_recently_used_first(tiny_llama_dir):
    draft = load_draft_model({"kind": "model", "path": tiny_llama_dir}, max_cached_requests=2)
    for request_id in ("a", "b", "a", "c"):
        draft.propose_for(request_id, CONTEXT, max_len=1, max_candidates=1)
    assert list(draft._caches) == ["a", "c"]


def _assert_same(got: list[Continuation], want: list[Continuation]) -> None:
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.score for c in got] == pytest.approx([c.score for c in want], rel=1e-4)


@pytest.mark.parametrize("model_dir_name", ["tiny_gemma3_dir", "tiny_llama_dir"])
def test_self_speculative_with_all_layers_equals_the_full_model(model_dir_name, request):
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = request.getfixturevalue(model_dir_name)
    num_layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    draft = load_draft_model({"kind": "self_speculative", "target": str(model_dir), "num_layers": num_layers})
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    proposals = draft.propose(CONTEXT, max_len=6, max_candidates=1)
    assert list(proposals[0].token_ids) == _greedy(target, CONTEXT, 6)


@pytest.mark.parametrize("model_dir_name", ["tiny_gemma3_dir", "tiny_llama_dir"])
def test_self_speculative_truncates_to_the_targets_first_layers(model_dir_name, request):
    from transformers import AutoModelForCausalLM

    model_dir = request.getfixturevalue(model_dir_name)
    draft = load_draft_model({"kind": "self_speculative", "target": model_dir, "num_layers": 1})
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert len(draft.model.model.layers) == 1
    if hasattr(draft.model.config, "layer_types"):
        assert draft.model.config.layer_types == target.config.layer_types[:1]
    shared = {
        "layer 0": (draft.model.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight),
        "final norm": (draft.model.model.norm.weight, target.model.norm.weight),
        "head": (draft.model.lm_head.weight, target.lm_head.weight),
        "embeddings": (draft.model.model.embed_tokens.weight, target.model.embed_tokens.weight),
    }
    for name, (got, want) in shared.items():
        assert torch.equal(got, want), f"{name} is not the target's"
    # A one-layer draft is a different model: its greedy tokens are its own.
    chain = draft.propose(CONTEXT, max_len=4, max_candidates=1)[0].token_ids
    assert list(chain) == _greedy(draft.model, CONTEXT, 4)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("model", "must be a table"),
        ({"path": "x"}, "'kind' must be one of"),
        ({"kind": "ngram", "path": "x"}, "'kind' must be one of"),
        ({"kind": "model"}, "needs 'path'"),
        ({"kind": "model", "path": "/nonexistent/dir"}, "not a transformers model directory"),
        ({"kind": "model", "path": "DIR", "num_layers": 2}, "unknown keys ['num_layers']"),
        ({"kind": "self_speculative", "path": "DIR", "num_layers": 2}, "unknown keys ['path']"),
        ({"kind": "self_speculative", "target": "DIR"}, "'num_layers' must be a positive integer"),
        ({"kind": "self_speculative", "target": "DIR", "num_layers": 0}, "'num_layers' must be a positive integer"),
        ({"kind": "self_speculative", "target": "DIR", "num_layers": "2"}, "'num_layers' must be a positive"),
        ({"kind": "self_speculative", "target": "DIR", "num_layers": True}, "'num_layers' must be a positive"),
    ],
)
def test_bad_specs_raise_clear_value_errors(spec, message, tiny_llama_dir):
    if isinstance(spec, dict):
        spec = {k: (str(tiny_llama_dir) if v == "DIR" else v) for k, v in spec.items()}
    with pytest.raises(ValueError) as error:
        parse_draft_model_spec(spec)
    assert message in str(error.value)


def test_too_many_layers_is_a_value_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="exceeds the target's 2 decoder layers"):
        load_draft_model({"kind": "self_speculative", "target": tiny_llama_dir, "num_layers": 3})


def test_draft_model_options_are_validated(gemma_draft):
    with pytest.raises(ValueError, match="num_branch_positions"):
        DraftModel(gemma_draft.model, num_branch_positions=-1)
    with pytest.raises(ValueError, match="max_cached_requests"):
        DraftModel(gemma_draft.model, max_cached_requests=0)


def _restricted_greedy(model, context: list[int], allowed: set[int], num_tokens: int) -> list[int]:
    """Greedy decoding with every logit outside `allowed` masked out."""
    tokens = list(context)
    mask = torch.full((model.config.vocab_size,), float("-inf"))
    mask[sorted(allowed)] = 0.0
    with torch.inference_mode():
        for _ in range(num_tokens):
            logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]  # [V]
            tokens.append(int((logits + mask).argmax()))
    return tokens[len(context) :]


@pytest.mark.parametrize("model_dir_name", ["tiny_gemma3_dir", "tiny_llama_dir"])
def test_a_head_over_the_whole_vocabulary_changes_nothing(model_dir_name, request):
    model_dir = request.getfixturevalue(model_dir_name)
    full = load_draft_model({"kind": "model", "path": model_dir})
    everything = DraftModel(full.model, head_token_ids=range(full.model.config.vocab_size))
    _assert_same(everything.propose(CONTEXT, 5, 4), full.propose(CONTEXT, 5, 4))


def test_restricted_head_proposes_only_fixed_and_context_tokens(gemma_draft):
    fixed = list(range(150, 300))
    draft = DraftModel(gemma_draft.model, head_token_ids=fixed)
    allowed = set(fixed) | set(CONTEXT)
    proposals = draft.propose(CONTEXT, max_len=6, max_candidates=4)
    assert all(t in allowed for c in proposals for t in c.token_ids)
    assert list(proposals[0].token_ids) == _restricted_greedy(draft.model, CONTEXT, allowed, 6)
    # The restricted head is a different draft, not a copy of the full one.
    assert proposals[0].token_ids != gemma_draft.propose(CONTEXT, 6, 1)[0].token_ids
    # Incremental calls agree with fresh ones, tokens outside the fixed set included.
    context = CONTEXT + list(proposals[0].token_ids) + [3]
    draft.propose_for("r", CONTEXT, 6, 4)
    _assert_same(draft.propose_for("r", context, 6, 4), draft.propose(context, 6, 4))


def test_most_frequent_token_ids_ranks_by_count_then_id():
    streams = [[5, 5, 5, 9, 9, 2], [9, 7, 7, 1]]
    assert most_frequent_token_ids(streams, 2) == [5, 9]
    assert most_frequent_token_ids(streams, 3, always=[0]) == [0, 5, 7, 9]  # 7 (twice) beats 1 and 2 (once)
    with pytest.raises(ValueError, match="num_tokens"):
        most_frequent_token_ids(streams, 0)


def test_head_vocabulary_from_a_corpus_spec(tiny_llama_dir, tmp_path):
    from transformers import AutoTokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 20 + "The quick brown fox.")
    spec = {"kind": "model", "path": tiny_llama_dir, "head_vocab_size": 5, "head_vocab_corpus": str(corpus)}
    draft = load_draft_model(spec)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    fixed = set(draft.head.token_ids.tolist())
    assert set(tokenizer.all_special_ids) <= fixed
    assert len(fixed - set(tokenizer.all_special_ids)) == 5
    assert fixed - set(tokenizer.all_special_ids) <= set(tokenizer(corpus.read_text())["input_ids"])
    assert all(t in fixed | set(CONTEXT) for c in draft.propose(CONTEXT, 4, 3) for t in c.token_ids)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"head_vocab_size": 10}, "'head_vocab_corpus' must be a text file"),
        ({"head_vocab_corpus": "CORPUS"}, "'head_vocab_size' must be a positive integer"),
        ({"head_vocab_size": 0, "head_vocab_corpus": "CORPUS"}, "'head_vocab_size' must be a positive integer"),
        ({"head_vocab_size": 10, "head_vocab_corpus": "/nonexistent.txt"}, "files not found"),
        ({"head_vocab_size": 10, "head_vocab_corpus": [1]}, "'head_vocab_corpus' must be a text file"),
    ],
)
def test_bad_head_vocab_specs_raise_clear_value_errors(extra, message, tiny_llama_dir, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello")
    extra = {k: (str(corpus) if v == "CORPUS" else v) for k, v in extra.items()}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_draft_model_spec({"kind": "model", "path": str(tiny_llama_dir), **extra})


def test_a_head_smaller_than_the_candidates_asked_for_still_proposes(gemma_draft):
    draft = DraftModel(gemma_draft.model, head_token_ids=[5])
    proposals = draft.propose([5, 5], max_len=3, max_candidates=8)
    assert proposals == [Continuation((5, 5, 5), pytest.approx(1.0))]


def test_drafter_loads_the_draft_model_its_segments_config_names(tiny_gemma3_dir, tmp_path):
    from transformers import AutoTokenizer

    from drafter.draft_model import DraftModel
    from drafter.segments import load_segments
    from drafter.server import load_draft_models

    config = tmp_path / "segments.toml"
    config.write_text('[default]\nalgorithm = "best_first"\n\n[[segment]]\nname = "code"\nstart = "```"\n'
                      'end = "```"\ndraft_model = { kind = "self_speculative", num_layers = 1, mode = "combine" }\n')
    segments = load_segments(config, AutoTokenizer.from_pretrained(tiny_gemma3_dir))
    models = load_draft_models(segments, str(tiny_gemma3_dir))
    assert set(models) == {"code"} and isinstance(models["code"], DraftModel)
    assert models["code"].propose([5, 6, 7], max_len=3, max_candidates=2)[0].token_ids


def test_the_drafter_puts_its_draft_models_on_the_device_and_dtype_it_is_given(tiny_gemma3_dir, tmp_path):
    import torch
    from transformers import AutoTokenizer

    from drafter.config import DrafterConfig
    from drafter.segments import load_segments
    from drafter.server import load_draft_models

    config = tmp_path / "segments.toml"
    config.write_text('[[segment]]\nname = "code"\nstart = "```"\nend = "```"\n'
                      'draft_model = { kind = "self_speculative", num_layers = 1 }\n')
    segments = load_segments(config, AutoTokenizer.from_pretrained(tiny_gemma3_dir))
    model = load_draft_models(segments, str(tiny_gemma3_dir), "cpu", "bfloat16")["code"].model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.device.type == "cpu"
    auto = load_draft_models(segments, str(tiny_gemma3_dir), "auto", "auto")["code"].model
    expected = (torch.bfloat16, "cuda") if torch.cuda.is_available() else (torch.float32, "cpu")
    assert (next(auto.parameters()).dtype, auto.device.type) == expected
    with pytest.raises(ValueError, match="device"):
        DrafterConfig(device="tpu")
    with pytest.raises(ValueError, match="dtype"):
        DrafterConfig(dtype="int8")
