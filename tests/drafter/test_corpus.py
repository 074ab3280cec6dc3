"""LookupCorpus and HistorySource: longest match, frequency ranking, the memory bound, save/load."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter.corpus import LookupCorpus
from drafter.history import MAX_MATCH, HistorySource
from drafter.segments import CorpusLimits


def _corpus(**limits) -> LookupCorpus:
    return LookupCorpus(CorpusLimits(**{"max_depth": 12, "max_key": 6, "min_key": 1, **limits}))


def test_longest_match_beats_a_more_frequent_shorter_key():
    corpus = _corpus()
    for _ in range(5):
        corpus.add([9, 3, 4, 50, 51])  # after (3, 4): mostly 50 ...
    corpus.add([1, 2, 3, 4, 70, 71])  # ... but after (1, 2, 3, 4): 70
    best = corpus.propose([1, 2, 3, 4], max_len=2, max_candidates=3)
    assert best[0].token_ids == (70, 71)
    shorter = corpus.propose([8, 3, 4], max_len=2, max_candidates=3)  # (8, 3, 4) unseen -> key (3, 4)
    assert shorter[0].token_ids == (50, 51)
    assert shorter[0].score == 5.0


def test_continuations_are_ranked_by_frequency():
    corpus = _corpus()
    for tail, times in (([10, 11], 1), ([20, 21], 3), ([30, 31], 2)):
        for _ in range(times):
            corpus.add([5, 6, *tail])
    found = corpus.propose([5, 6], max_len=2, max_candidates=3)
    assert [c.token_ids for c in found] == [(20, 21), (30, 31), (10, 11)]
    assert [c.score for c in found] == [3.0, 2.0, 1.0]
    assert len(corpus.propose([5, 6], max_len=2, max_candidates=2)) == 2


def test_min_key_and_unknown_context_propose_nothing():
    corpus = _corpus(min_key=2)
    corpus.add([1, 2, 3])
    assert corpus.propose([7, 2], max_len=3, max_candidates=4) == []  # only a 1-token key matches
    assert corpus.propose([1, 2], max_len=3, max_candidates=4)[0].token_ids == (3,)
    assert corpus.propose([], max_len=3, max_candidates=4) == []


def test_eviction_keeps_the_bound_and_prefers_frequent_paths():
    corpus = _corpus(max_entries=300, decay=0.5)
    frequent = [100, 101, 102, 103, 104]
    rng = np.random.default_rng(0)
    for i in range(200):
        corpus.add(frequent)
        corpus.add(rng.integers(200, 400, size=8).tolist())
        assert corpus.num_entries <= 300
    assert corpus.propose([100, 101], max_len=3, max_candidates=1)[0].token_ids == (102, 103, 104)


def test_save_load_round_trip(tmp_path):
    corpus = _corpus()
    for seq in ([1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 1, 2, 3, 4]):
        corpus.add(seq)
    path = tmp_path / "c.corpus.npz"
    corpus.save(path)
    loaded = LookupCorpus.load(path)
    assert loaded.num_entries == corpus.num_entries
    assert loaded.limits == corpus.limits
    for context in ([1, 2], [2, 3], [7], [3, 4]):
        assert loaded.propose(context, 4, 8) == corpus.propose(context, 4, 8)


def test_load_refuses_another_format(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, meta=np.frombuffer(b'{"format": "x", "version": 9}', dtype=np.uint8))
    with pytest.raises(ValueError, match="segserve-corpus"):
        LookupCorpus.load(path)


def _occurrences(sequences: list[list[int]], path: list[int], max_depth: int) -> int:
    """How often `path` occurs in the sequences (the counts a suffix trie cut at max_depth holds)."""
    if len(path) > max_depth:
        return 0
    return sum(seq[i:i + len(path)] == path for seq in sequences for i in range(len(seq) - len(path) + 1))


def _naive_longest_key(sequences: list[list[int]], context: list[int], limits: CorpusLimits) -> int:
    for key_len in range(min(limits.max_key, len(context), limits.max_depth - 1), limits.min_key - 1, -1):
        key = context[len(context) - key_len:]
        if any(seq[i:i + key_len] == key for seq in sequences for i in range(len(seq) - key_len)):
            return key_len  # the key occurs followed by a token
    return 0


@settings(max_examples=150, deadline=None)
@given(sequences=st.lists(st.lists(st.integers(-1, 4), min_size=1, max_size=25), min_size=1, max_size=12),
       contexts=st.lists(st.lists(st.integers(-1, 4), max_size=7), min_size=1, max_size=6),
       max_depth=st.sampled_from([4, 6, 12]), max_len=st.integers(1, 8), max_candidates=st.integers(1, 4))
def test_proposals_match_a_count_of_every_occurrence(sequences, contexts, max_depth, max_len, max_candidates):
    """Against counting by brute force, over corpora built a sequence at a time (runs merging as they go): the key
    is the longest suffix of the context that occurs followed by a token, each continuation's score is how often
    key + continuation occurs, scores come best first (the first the most frequent of all such paths), and a
    continuation ends at max_len, at max_depth with its key, or where nothing follows. -1 is a token like any
    other (keyed corpora learn it)."""
    limits = CorpusLimits(max_depth=max_depth, max_key=3, min_key=1)
    corpus = LookupCorpus(limits)
    for seq in sequences:
        corpus.add(seq)
    assert corpus.num_entries == sum(map(len, sequences))
    for context in contexts:
        found = corpus.propose(context, max_len, max_candidates)
        key_len = _naive_longest_key(sequences, context, limits)
        assert {c.match_len for c in found} == ({key_len} if key_len else set())
        key = context[len(context) - key_len:] if key_len else []
        assert len(found) <= max_candidates and len({c.token_ids for c in found}) == len(found)
        assert [c.score for c in found] == sorted((c.score for c in found), reverse=True)
        for c in found:
            path = [*key, *c.token_ids]
            assert c.score == _occurrences(sequences, path, max_depth) > 0
            is_cut = len(c.token_ids) == min(max_len, max_depth - key_len)
            assert is_cut or all(_occurrences(sequences, [*path, t], max_depth) == 0 for t in range(-1, 5))
        if found:  # best-first: the first continuation is the most frequent leaf (a path cut, or a dead end)
            depth = min(max_len, max_depth - key_len)
            paths = {tuple(seq[i + key_len:i + key_len + n]) for seq in sequences for i in range(len(seq))
                     for n in range(1, depth + 1) if seq[i:i + key_len] == key and i + key_len + n <= len(seq)}
            leaves = [p for p in paths if len(p) == depth or not any(q[:-1] == p for q in paths)]
            assert found[0].score == max(_occurrences(sequences, [*key, *p], max_depth) for p in leaves)


def test_memory_per_learned_token_is_a_few_words():
    """The arrays hold about five 4-byte words a token (the token, two suffix-array entries, a weight sum of two),
    plus each sequence's separator and each run's padding: at most 24 bytes a learned token for 200-token
    sequences, where SuffixDecoding's tree takes about 350 and the trie this replaced 2,300-2,800."""
    rng = random.Random(5)
    words = [rng.randrange(150_000) for _ in range(300)]  # a small vocabulary in use: text repeats
    corpus = LookupCorpus(CorpusLimits(max_depth=16, max_key=8))
    for _ in range(100):
        corpus.add([rng.choice(words) for _ in range(200)])
    assert corpus.num_entries == 20_000 and corpus.num_bytes <= 24 * corpus.num_entries, corpus.num_bytes


def _trie_v1(path, sequences: list[list[int]], limits: CorpusLimits) -> None:
    """A snapshot as the suffix trie before this corpus wrote it: every suffix cut at max_depth, in preorder."""
    root: dict = {}
    counts: dict[int, float] = {}
    for seq in sequences:
        for begin in range(len(seq)):
            node = root
            for token in seq[begin:begin + limits.max_depth]:
                node = node.setdefault(token, {})
                counts[id(node)] = counts.get(id(node), 0.0) + 1.0
    tokens, num_children, node_counts = [-1], [len(root)], [0.0]
    stack = list(reversed(root.items()))
    while stack:
        token, node = stack.pop()
        tokens.append(token)
        num_children.append(len(node))
        node_counts.append(counts[id(node)])
        stack.extend(reversed(node.items()))
    meta = {"format": "segserve-corpus", "version": 1, "limits": limits.__dict__}
    np.savez_compressed(path, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                        tokens=np.asarray(tokens, np.int64), counts=np.asarray(node_counts, np.float32),
                        num_children=np.asarray(num_children, np.int64))


def test_a_v1_trie_snapshot_loads_and_drafts_what_it_learned(tmp_path):
    limits = CorpusLimits(max_depth=8, max_key=4, min_key=1)
    sequences = [[1, 2, 3, 4, 5]] * 3 + [[1, 2, 3, 9, 9]] + [[7, 8, 2, 3, 6]] * 2
    _trie_v1(tmp_path / "old.corpus.npz", sequences, limits)
    migrated = LookupCorpus.load(tmp_path / "old.corpus.npz")
    assert migrated.limits == limits
    fresh = _corpus(max_depth=8, max_key=4)
    for seq in sequences:
        fresh.add(seq)
    for context in ([1, 2], [2, 3], [8, 2, 3], [3], [5], [4, 4, 9]):
        expected = [c.token_ids for c in fresh.propose(context, 3, 3)]
        assert [c.token_ids for c in migrated.propose(context, 3, 3)] == expected, context


def test_history_proposes_what_followed_the_longest_suffix():
    history = HistorySource(max_key=4, min_key=1)
    tokens = [1, 2, 3, 10, 11, 5, 3, 20, 21, 1, 2, 3]
    history.extend(tokens)
    found = history.propose(tokens, max_len=2, max_candidates=4)
    assert found[0].token_ids == (10, 11)  # key (1, 2, 3), not the more recent (3,) -> (20, 21)
    assert len(found) == 1


def test_history_counts_repeats_and_prefers_recent_on_ties():
    history = HistorySource(max_key=2, min_key=1)
    history.extend([7, 1, 7, 2, 7, 1, 7, 3, 7])
    found = history.propose(history.tokens, max_len=1, max_candidates=3)
    assert [c.token_ids for c in found] == [(1,), (3,), (2,)]
    assert [c.score for c in found] == [2.0, 1.0, 1.0]


def test_history_is_incremental():
    history = HistorySource(max_key=3, min_key=2)
    history.extend([4, 5, 6])
    assert history.propose(history.tokens, 3, 2) == []  # (5, 6) only occurs as the context itself
    history.extend([4, 5])
    assert history.propose(history.tokens, 3, 2)[0].token_ids == (6, 4, 5)


def _scanned(tokens: list[int], context: list[int], history: HistorySource, max_len: int, first: int = 0) -> list:
    """What HistorySource.propose should answer, by scanning `tokens` from `first` on for the context's longest
    suffix (min_key..max_key tokens) that a token follows: the most recent max_occurrences occurrences'
    continuations, counted, most frequent first, ties most recent first, each with its longest match."""
    for key_len in range(min(history.max_key, len(context)), history.min_key - 1, -1):
        key = context[len(context) - key_len:]
        ends = [e for e in range(first + key_len, len(tokens)) if tokens[e - key_len:e] == key]
        if not ends:
            continue
        counts, matched = {}, {}
        for e in reversed(ends[-history.max_occurrences:]):
            continuation = tuple(tokens[e:e + max_len])
            counts[continuation] = counts.get(continuation, 0) + 1
            match_len = key_len
            if key_len == history.max_key:
                limit = min(MAX_MATCH, e, len(context))
                match_len = max(m for m in range(key_len, limit + 1) if tokens[e - m:e] == context[len(context) - m:])
            matched[continuation] = max(matched.get(continuation, 0), match_len)
        ranked = sorted(counts, key=lambda c: -counts[c])
        return [(c, float(counts[c]), matched[c]) for c in ranked]
    return []


@pytest.mark.parametrize(("max_key", "min_key", "max_bytes"), [(6, 1, 1 << 20), (3, 2, 1 << 20), (6, 1, 40 * 8)])
def test_history_proposes_what_a_scan_of_its_tokens_finds(max_key, min_key, max_bytes):
    """Every proposal, counts and match lengths included, equals a plain scan's over the tokens the history still
    searches (all of them; with a small max_bytes, the most recent ones)."""
    rng = random.Random(7)
    words = [rng.randrange(50) for _ in range(30)]
    history = HistorySource(max_key=max_key, min_key=min_key, max_occurrences=4, max_bytes=max_bytes)
    history.extend([rng.choice(words) for _ in range(300)])  # a prompt
    for step in range(30):
        history.extend([rng.choice(words) for _ in range(rng.randrange(1, 4))])
        first = history._first  # the oldest token still searched
        assert history.num_bytes <= max_bytes
        for end in (len(history.tokens), rng.randrange(1, len(history.tokens))):
            context = history.tokens[:end]
            found = [(c.token_ids, c.score, c.match_len) for c in history.propose(context, 5, 8)]
            assert found == _scanned(history.tokens, context, history, 5, first), (step, end)
