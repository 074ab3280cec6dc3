"""LookupCorpus and HistorySource: longest match, frequency ranking, the memory bound, save/load."""

from __future__ import annotations

import numpy as np
import pytest

from drafter.corpus import LookupCorpus
from drafter.history import HistorySource
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
