"""SuffixPlanner: SuffixDecoding behind the Draft interface (`--drafter-backend suffix`).

The peer segserve's own proposer is measured against (`segserve bench spec --systems
segserve_suffix`). The proposer is arctic-inference's SuffixDecodingCache, the
implementation vLLM's `suffix` speculation method imports (`make suffix-decoding`
builds it from its sdist): a global suffix tree over the responses of past requests
and a per-request tree over the request's prompt and response, both scored by
frequency. A draft grows from the longest match of the context's suffix, at most
max_spec_factor * match length + max_spec_offset tokens and within the caller's node
budget, keeping nodes whose estimated probability is at least min_token_prob; the
better scoring of the two trees' drafts is proposed. Its parameters are
DrafterConfig's suffix_* fields, vLLM's defaults with trees on (segserve verifies
trees; vLLM verifies chains).

Only the proposer differs from the default backend (DraftPlanner): the request states,
the scheduler's gate and batch and the worker's verification are the same. The cache
follows the drafter's request states: a request's first draft starts it with its
prompt, its new tokens are appended before each draft, and its end stops it (its last
tokens first, when it ends with a final update). Its response stays in the global tree
until max_cached_requests later requests have pushed it out (oldest first). A tree is
labelled with the request's segment kind, so acceptance per kind compares with the
default backend's. As in SuffixDecoding, one global tree serves every tenant and
corpus key.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from contextlib import AbstractContextManager, nullcontext
from typing import Sequence

from drafter.config import DrafterConfig
from drafter.segments import SegmentsConfig
from drafter.state import RequestState
from protos.segserve.v1.tree import ROOT, CandidateTree

SEGMENT = "suffix"
"""The name the global tree's sizes are reported under (DrafterStats)."""


def new_cache(config: DrafterConfig):
    """arctic-inference's SuffixDecodingCache; ImportError says how to build it."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as exc:
        raise ImportError("the suffix backend needs SuffixDecoding's extension: run `make suffix-decoding`") from exc
    return SuffixDecodingCache(config.suffix_max_tree_depth, config.suffix_max_cached_requests)


class SuffixPlanner:
    """DraftPlanner's interface over a SuffixDecodingCache; pure logic, no network."""

    backend = "suffix"

    def __init__(self, segments: SegmentsConfig, config: DrafterConfig | None = None):
        self.segments = segments
        """Only to label trees with the request's segment kind, and for the markers replies carry."""
        self.config = config or DrafterConfig()
        """SuffixDecoding's parameters (its suffix_* fields) and max_requests."""
        self.cache = new_cache(self.config)
        self.num_learned_tokens: Counter[str] = Counter()
        """Response tokens added to the global tree since start, under SEGMENT."""
        self._max_requests = self.config.max_requests
        self._num_fed: OrderedDict[str, int] = OrderedDict()
        """Active request -> how many of its tokens the cache holds, least recently drafted first."""
        self._num_learned_responses = 0

    def learn(self, segment: str, token_ids: Sequence[int], tenant: str = "", corpus_key: str = "") -> None:
        """A past response joins the global tree, as a finished request of its own (segment, tenant and key are
        not scoped: one global tree)."""
        self._num_learned_responses += 1
        request_id = ("learned", self._num_learned_responses)  # never a Draft request's id (those are strings)
        self.cache.start_request(request_id, [])
        self.cache.add_active_response(request_id, list(token_ids))
        self.cache.stop_request(request_id)
        self.num_learned_tokens[SEGMENT] += len(token_ids)

    def reading(self) -> AbstractContextManager:
        return nullcontext()  # nothing learns in the background

    def wait_learned(self, timeout_s: float | None = None) -> bool:
        return True  # learn() adds at once

    def source_stats(self, kind: str) -> dict[str, tuple[int, int]]:
        return {}  # one proposer, judged by the scheduler's acceptance only

    def corpus_sizes(self) -> tuple[Counter[str], Counter[str]]:
        """Responses in the global tree and its estimated memory, under SEGMENT."""
        global_tree = self.cache._global_tree  # the cache has no accessor; SuffixTree.estimate_memory is public
        return Counter({SEGMENT: len(self.cache.cached_requests)}), Counter({SEGMENT: global_tree.estimate_memory()})

    def draft(self, state: RequestState, max_nodes: int, min_node_prob: float = 0.0) -> tuple[CandidateTree, str]:
        """The request's tree within max_nodes (and the suffix trees' depth), labelled with its segment kind.
        SuffixDecoding prunes by its own min_token_prob: the scheduler's price (min_node_prob) is not applied,
        so the peer runs as vLLM configures it."""
        self._feed(state)
        segment = state.segment
        if max_nodes <= 0:
            return CandidateTree(), segment
        config = self.config
        context = state.tokens[-config.suffix_max_tree_depth:]
        found = self.cache.speculate(state.request_id, context, max_nodes, config.suffix_max_spec_factor,
                                     config.suffix_max_spec_offset, config.suffix_min_token_prob,
                                     config.is_suffix_tree_spec)
        return _tree(found.token_ids, found.parents, max_nodes), segment

    def release(self, request_id: str, final: RequestState | None = None) -> None:
        """A request ended: its last tokens (`final`) join its response, then it stops (the response stays)."""
        if final is not None:
            self._feed(final)
        if self._num_fed.pop(request_id, None) is not None:
            self.cache.stop_request(request_id)

    def _feed(self, state: RequestState) -> None:
        """Start the request with its prompt if new (or out of step), then append its tokens the cache lacks."""
        request_id, tokens = state.request_id, state.tokens
        num_fed = self._num_fed.get(request_id)
        if num_fed is None or num_fed > len(tokens):
            self.release(request_id)
            num_fed = min(state.num_prompt_tokens, len(tokens))
            self.cache.start_request(request_id, tokens[:num_fed])
            self._num_fed[request_id] = num_fed
            self._bound(request_id)
        if len(tokens) > num_fed:
            self.cache.add_active_response(request_id, tokens[num_fed:])
            self.num_learned_tokens[SEGMENT] += len(tokens) - num_fed
        self._num_fed[request_id] = len(tokens)
        self._num_fed.move_to_end(request_id)

    def _bound(self, newest: str) -> None:
        """Stop the least recently drafted requests past max_requests (their states were dropped too)."""
        while len(self._num_fed) > self._max_requests:
            oldest = next(iter(self._num_fed))
            if oldest == newest:
                break
            self.release(oldest)


def _tree(token_ids, parents, max_nodes: int) -> CandidateTree:
    """SuffixDecoding's draft (parents index earlier drafts, -1 the root) as a CandidateTree of at most max_nodes
    drafts: its first max_nodes, which keep every parent (a parent precedes its children)."""
    token_ids, parents = list(token_ids)[:max_nodes], list(parents)[:max_nodes]
    return CandidateTree(token_ids, [ROOT if parent < 0 else parent for parent in parents])
