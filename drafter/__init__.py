"""Speculative drafting: per-request segment tracking, per-segment lookup corpora, candidate trees.

In (gRPC, drafter.proto): per request, the tokens appended since the last step and
the node budget. Out: a DraftReply per request: a candidate tree
(protos.segserve.v1.tree.CandidateTree: token ids + parents, -1 = rooted at the
last token) and its segment name, or needs_resync.

Modules: types (Continuation, ContinuationSource), segments (TOML
config of segment kinds), tracker (current segment over a token stream), corpus
(bounded suffix-trie lookup corpus, save/load), history (the request's own
tokens as a source), trees (builder registry), state (per-request state, resync,
online learning), planner (sources -> tree), service/server (gRPC), build
(`segserve corpus build`). Draft models plug in as ContinuationSources
(draft_model.py).
"""
