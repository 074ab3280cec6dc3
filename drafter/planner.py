"""DraftPlanner: one request's state -> a candidate tree from its segment's sources and algorithm.

In: a RequestState and the caller's node budget. Out: a CandidateTree
(protos.segserve.v1.tree) and the segment name. Sources per segment: its lookup
corpus and the request's own history, plus its draft model ("combine"), or the
draft model alone ("replace").
Corpora per tenant: `corpora` are the shared ones (what an operator seeds, and what the
default tenant "" learns, so a single-tenant drafter behaves as before); a request of
another tenant learns into that tenant's own corpus of the kind (`tenant_corpora`, made on
its first segment) and draws from it and the shared corpus, never from another tenant's.
Budget: the tenants' corpora of a kind share the kind's byte budget (its `corpus.max_bytes`).
Each is bounded by it like any corpus, and when together they pass it, the corpora of the
tenants that learned least recently are dropped whole until they fit again (the one learning
now is kept); the shared corpus has the budget of its own. So a kind holds at most about twice
its budget, however many tenants there are.
A request with a corpus key (a structured output) is in the `schema` kind for its whole output:
its sources are the key's corpora, scoped and bounded the same way (`keyed`, drafter/keyed.py), and
its own history.
Each source's scores are normalized to sum to 1 before merging, so a corpus's raw
frequencies and a draft model's probabilities weigh the same; a lookup source's are then
scaled by its match over the longest lookup match (`by_match`), so the guess founded on
more context takes the tree's nodes first, and every source's by how well it has
predicted in this segment kind (`SourceAcceptance`): each draft's best continuation per
source is judged against the tokens the request's next update brings, so a kind's trees
go to the sources that earn them there (a draft model that rarely agrees with the
target in prose, history where the output copies its prompt).
Depth adapts to the match, as SuffixDecoding's does, for kinds with a spec_factor:
a lookup continuation found after a match of n context tokens drafts at most
spec_factor * n tokens, so a weak match (2 tokens) drafts little while a long one
(text being copied: the request's own history follows a match back up to 64
tokens) drafts past the kind's max_depth and max_nodes, up to the scheduler's budget.
A corpus cuts key and continuation together at its trie depth; a lookup that matched a whole
key drafts on from its own end (`chained`), so text learned whole drafts as deep as the budget.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from contextlib import AbstractContextManager, nullcontext
from typing import Mapping, Sequence

from drafter.calibration import NodeCalibration
from drafter.corpus import LookupCorpus
from drafter.keyed import KEY_START, KeyedCorpora, Scope, output_context
from drafter.learner import Learner
from drafter.segments import SegmentKind, SegmentsConfig
from drafter.state import RequestState
from drafter.trees import grow, merge
from drafter.types import Continuation, ContinuationSource, is_request_aware
from protos.segserve.v1.tree import CandidateTree


class SourceAcceptance:
    """Per (segment kind, source): tokens of its best continuations judged against what the model wrote next,
    and those that matched (each continuation's leading run)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], list[int]] = {}

    def judge(self, state: RequestState) -> None:
        """Score the state's last proposals against the tokens appended since, then forget them."""
        new = state.tokens[state.proposed_at:]
        if new and state.proposals:
            for role, tokens in state.proposals.items():
                judged = min(len(tokens), len(new))
                matched = next((i for i in range(judged) if tokens[i] != new[i]), judged)
                counts = self.counts.setdefault((state.proposed_kind, role), [0, 0])
                counts[0] += judged
                counts[1] += matched
            state.proposals = {}

    def weight(self, kind: str, role: str) -> float:
        """The matched share, smoothed toward 1/2 by one of each (a source never judged weighs 1/2)."""
        judged, matched = self.counts.get((kind, role), (0, 0))
        return (matched + 1) / (judged + 2)

    def of_kind(self, kind: str) -> dict[str, tuple[int, int]]:
        """role -> (judged, matched) for one kind."""
        return {role: (c[0], c[1]) for (k, role), c in sorted(self.counts.items()) if k == kind}


class DraftPlanner:
    """Holds the corpora and draft models; pure logic, no network."""

    backend = "segserve"

    def __init__(
        self,
        segments: SegmentsConfig,
        corpora: Mapping[str, LookupCorpus] | None = None,
        draft_models: Mapping[str, ContinuationSource] | None = None,
        learner: Learner | None = None,
        tenant_corpora: Mapping[tuple[str, str], LookupCorpus] | None = None,
        max_corpus_keys: int = 256,
        keyed_corpora: Mapping[Scope, LookupCorpus] | None = None,
    ):
        self.segments = segments
        self.corpora = dict(corpora or {})
        """Segment kind -> the shared corpus (seeded by operators; learned into by the default tenant "")."""
        for kind in segments.all_kinds:
            self.corpora.setdefault(kind.name, LookupCorpus(kind.corpus))
        self.tenant_corpora: OrderedDict[tuple[str, str], LookupCorpus] = OrderedDict(tenant_corpora or {})
        """(tenant, segment kind) -> what that tenant's requests learned, least recently learned first; tenants
        other than "" only."""
        self.num_tenant_corpora_dropped = 0
        """Tenant corpora dropped to keep their kind within its budget."""
        self.keyed = KeyedCorpora(segments.schema.corpus, max_corpus_keys, keyed_corpora)
        """(tenant, corpus key) -> what that tenant's requests with the key learned ("" = shared)."""
        self.draft_models = dict(draft_models or {})
        self.learner = learner
        """Learns in the background (drafter/learner.py); None = learn() adds at once, on the caller's thread."""
        self.num_learned_tokens: Counter[str] = Counter()
        """Tokens learned per segment kind since start (the keyed corpora's under the schema kind's name)."""
        self.acceptance = SourceAcceptance()
        """How well each kind's sources predicted (their weight in by_match)."""
        self.calibration = NodeCalibration()
        """How likely each kind's nodes turned out to be accepted, by depth and weight (what min_node_prob and
        the tree builders read)."""

    def learn(self, segment: str, token_ids: Sequence[int], tenant: str = "", corpus_key: str = "") -> None:
        """Online learning: a closed segment's tokens join the tenant's corpus of its kind (queued, with a learner);
        with a corpus key, a keyed request's output joins the tenant's corpus of that key."""
        if corpus_key:
            self._add(self.keyed.for_learning(tenant, corpus_key), (KEY_START, *token_ids))
            self.num_learned_tokens[self.segments.schema.name] += len(token_ids)
            return
        corpus = self.corpus_for(segment, tenant, is_created=True)
        if corpus is None:
            return
        self._add(corpus, token_ids)
        self.num_learned_tokens[segment] += len(token_ids)
        if tenant:
            self.tenant_corpora.move_to_end((tenant, segment))
            self._bound_tenants(segment)

    def _add(self, corpus: LookupCorpus, token_ids: Sequence[int]) -> None:
        if self.learner is None:
            corpus.add(token_ids)
        else:
            self.learner.submit(corpus, token_ids)

    def corpus_for(self, segment: str, tenant: str = "", is_created: bool = False) -> LookupCorpus | None:
        """The corpus a tenant learns into (the shared one for ""); None for an unknown kind, or a tenant's
        corpus not made yet unless is_created."""
        if not tenant or segment not in self.corpora:
            return self.corpora.get(segment)
        corpus = self.tenant_corpora.get((tenant, segment))
        if corpus is None and is_created:
            corpus = self.tenant_corpora[(tenant, segment)] = LookupCorpus(self.corpora[segment].limits)
        return corpus

    def _bound_tenants(self, segment: str) -> None:
        """Drop the least recently learned tenants' corpora of `segment` while together they pass its budget."""
        budget = self.corpora[segment].limits.max_bytes
        own = [key for key in self.tenant_corpora if key[1] == segment]
        total = sum(self.tenant_corpora[key].num_bytes for key in own)
        for key in own[:-1]:  # the newest (the one learning now) is kept
            if total <= budget:
                break
            total -= self.tenant_corpora.pop(key).num_bytes
            self.num_tenant_corpora_dropped += 1

    def corpus_sizes(self) -> tuple[Counter[str], Counter[str]]:
        """Entries and bytes per segment kind, the shared corpus and every tenant's together."""
        entries, num_bytes = Counter(), Counter()
        tenant_corpora = ((segment, corpus) for (_, segment), corpus in self.tenant_corpora.items())
        for segment, corpus in [*self.corpora.items(), *tenant_corpora]:
            entries[segment] += corpus.num_entries
            num_bytes[segment] += corpus.num_bytes
        if len(self.keyed):
            name = self.segments.schema.name
            entries[name], num_bytes[name] = self.keyed.sizes()
        return entries, num_bytes

    def reading(self) -> AbstractContextManager:
        """Hold the corpora still while drafting or saving (the learner waits; it never holds them long)."""
        return self.learner.guard.reading() if self.learner is not None else nullcontext()

    def source_stats(self, kind: str) -> dict[str, tuple[int, int]]:
        """How well each of the kind's sources predicted (SourceAcceptance)."""
        return self.acceptance.of_kind(kind)

    def wait_learned(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued segment is in its corpus (never call it while reading()); False on timeout."""
        return self.learner is None or self.learner.wait_idle(timeout_s)

    def release(self, request_id: str, final: RequestState | None = None) -> None:
        """A request ended (`final`: its last state, when it ended with a final update): per-request sources
        (draft-model caches) forget it."""
        for model in self.draft_models.values():
            if is_request_aware(model):
                model.release(request_id)

    def draft(self, state: RequestState, max_nodes: int, min_node_prob: float = 0.0) -> tuple[CandidateTree, str]:
        """The tree for one request within min(max_nodes, the segment's budget); with the kind's spec_factor, a
        long match may take up to max_nodes (adaptive_depth). No node is less likely to be accepted than
        min_node_prob (the scheduler's price of a draft token) or the kind's min_prob."""
        self.acceptance.judge(state)
        if state.trie is not None:
            self.calibration.judge(state.proposed_kind, state.trie, state.tokens[state.proposed_at:])
            state.trie = None
        kind = self.segments.schema if state.corpus_key else self.segments.kind(state.segment)
        budget = min(max_nodes, kind.max_nodes)
        if budget <= 0:
            return CandidateTree(), kind.name
        max_len = max(kind.max_depth, max_nodes) if kind.spec_factor > 0 else kind.max_depth
        proposals, weights = [], []
        state.proposals = {}
        for role, source, context in self._sources(kind, state):
            found = _normalized(_propose(source, state, context, kind, max_len))
            if kind.spec_factor > 0 and found:
                found, _ = adaptive_depth(found, kind.spec_factor, kind.max_depth)
                if not is_request_aware(source):
                    found[0] = chained(source, context, found[0], kind, max_nodes)
            if found:
                state.proposals[role] = found[0].token_ids
            proposals.append(found)
            weights.append(self.acceptance.weight(kind.name, role))
        state.proposed_at, state.proposed_kind = len(state.tokens), kind.name
        continuations = by_match(proposals, weights)
        depth = kind.max_depth
        if kind.spec_factor > 0:
            depth = max([depth, *(len(c.token_ids) for c in continuations)])
            budget = min(max_nodes, max(budget, depth))
        state.trie = merge(continuations, depth)
        tree = grow(kind.algorithm, state.trie, budget, max(kind.min_prob, min_node_prob),
                    self.calibration.calibrate(kind.name))
        return tree, kind.name

    def _sources(self, kind: SegmentKind, state: RequestState
                 ) -> list[tuple[str, ContinuationSource, Sequence[int]]]:  # fmt: skip
        """Each source with its role (what SourceAcceptance judges it as) and the context it is asked about (the
        request's tokens; a keyed corpus, its output's)."""
        if state.corpus_key:
            context = output_context(state.tokens, state.num_prompt_tokens, kind.corpus.max_key)
            shared = self.keyed.get("", state.corpus_key)
            keyed = [("keyed" if corpus is shared else "keyed_tenant", corpus, context)
                     for corpus in self.keyed.lookup(state.tenant, state.corpus_key)]
            return [*keyed, ("history", state.history, state.tokens)]
        draft_model = self.draft_models.get(kind.name)
        is_replace = kind.draft_model is not None and kind.draft_model.mode == "replace"
        if draft_model is not None and is_replace:
            return [("draft_model", draft_model, state.tokens)]
        sources: list[tuple[str, ContinuationSource, Sequence[int]]] = [("corpus", self.corpora[kind.name],
                                                                         state.tokens)]  # fmt: skip
        tenant_corpus = self.corpus_for(kind.name, state.tenant)
        if tenant_corpus is not None and tenant_corpus is not self.corpora[kind.name]:
            sources.append(("tenant", tenant_corpus, state.tokens))
        sources.append(("history", state.history, state.tokens))
        if draft_model is not None:
            sources.append(("draft_model", draft_model, state.tokens))
        return sources


def _propose(source: ContinuationSource, state: RequestState, context: Sequence[int], kind: SegmentKind,
             max_len: int) -> list[Continuation]:  # fmt: skip
    if is_request_aware(source):  # keeps e.g. a draft model's KV cache per request
        return source.propose_for(state.request_id, context, kind.max_depth, kind.max_candidates)
    return source.propose(context, max_len, kind.max_candidates)


def adaptive_depth(continuations: list[Continuation], spec_factor: float, max_depth: int
                   ) -> tuple[list[Continuation], int]:  # fmt: skip
    """SuffixDecoding's match-length–adaptive drafts: a lookup's continuation found after a match of n context
    tokens keeps at most max(1, spec_factor * n) tokens (a short, weak match drafts little), which may pass
    max_depth (a long match, e.g. text being copied, drafts deep); others (a draft model's) keep max_depth. Returns
    them and the tree depth they need (at least max_depth)."""
    adapted = []
    for c in continuations:
        length = match_depth(spec_factor, c.match_len) if c.match_len else max_depth
        adapted.append(Continuation(c.token_ids[:length], c.score, c.match_len))
    return adapted, max([max_depth, *(len(c.token_ids) for c in adapted)])


def match_depth(spec_factor: float, match_len: int) -> int:
    """Tokens a lookup continuation keeps after a match of match_len context tokens (at least one)."""
    return max(1, int(spec_factor * match_len))


def chained(source: ContinuationSource, context: Sequence[int], best: Continuation, kind: SegmentKind,
            max_len: int) -> Continuation:
    """`best`, a lookup's top continuation cut to its match (adaptive_depth), drafted on by looking its own end up
    again while each lookup matches a whole key (kind.corpus.max_key tokens, the strongest evidence a corpus
    gives): a corpus cuts a key and its continuation together at its trie depth, so text it learned whole (an
    output repeated, a file edited again) would otherwise draft no deeper than that depth less the key, however
    much of it is ahead. A lookup that matches less stops the chain; so does max_len."""
    tokens = list(best.token_ids)
    match_len = best.match_len
    while kind.corpus.max_key <= match_len and len(tokens) < max_len:
        found = source.propose([*context, *tokens], max_len - len(tokens), 1)
        if not found or not found[0].token_ids:
            break
        match_len = found[0].match_len
        tokens.extend(found[0].token_ids[: match_depth(kind.spec_factor, match_len)])
    return Continuation(tuple(tokens[:max_len]), best.score, best.match_len)


def by_match(proposals: list[list[Continuation]], weights: Sequence[float] | None = None) -> list[Continuation]:
    """Every source's continuations (each source's scores summing to 1) in one list, a lookup source's scores
    scaled by its longest match over the longest of all lookups: a source that matched 4 tokens of the context
    weighs half as much as one that matched 8, so the better-founded guess takes the tree's nodes first rather
    than splitting them evenly. Sources that are no lookup (a draft model's) keep their weight. Each source's
    scores are scaled by its `weights` entry too (its measured acceptance, when given)."""
    longest = max((c.match_len for found in proposals for c in found), default=0)
    merged = []
    for index, found in enumerate(proposals):
        match_len = max((c.match_len for c in found), default=0)
        weight = (match_len / longest if match_len else 1.0) * (weights[index] if weights is not None else 1.0)
        merged.extend(Continuation(c.token_ids, c.score * weight, c.match_len) for c in found)
    return merged


def _normalized(continuations: list[Continuation]) -> list[Continuation]:
    total = sum(c.score for c in continuations if c.score > 0)
    if total <= 0:
        return []
    return [Continuation(c.token_ids, c.score / total, c.match_len)
            for c in continuations if c.score > 0 and c.token_ids]
