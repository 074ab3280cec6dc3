"""Speculative drafting: per-request segment tracking, per-segment lookup corpora, candidate trees.

In (gRPC, drafter.proto): per request, the tokens appended since the last step and
the node budget (0 = update only; a final update ends the request), and on a request's first query its
tenant (learned segments stay in that tenant's corpora; drafts come from them and the shared, seeded ones) and
corpus key (a structured output's whole output is one segment, drafted from and learned into its key's
corpora). Out: a DraftReply per request: a candidate tree (protos.segserve.v1.tree.CandidateTree: token
ids + parents, -1 = rooted at the last token) and its segment name, or needs_resync.

Modules: types (Continuation, ContinuationSource), segments (TOML
config of segment kinds), tracker (current segment over a token stream), corpus
(suffix-array lookup corpus bounded in bytes, save/load), keyed (corpora per corpus key and tenant,
bounded in keys and bytes), learner (adds learned
segments to corpora on a background thread, a slice at a time), history (the
request's own tokens as a source, bounded in bytes), trees (builder registry),
state (per-request state, resync, final updates, online learning), planner
(sources -> tree), service/server (gRPC), build
(`segserve corpus build`). Draft models plug in as ContinuationSources
(draft_model.py).
"""
