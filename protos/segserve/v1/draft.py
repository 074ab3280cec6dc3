"""Draft call contracts (drafter.proto's DraftQuery and DraftReply). Torch-free.

The scheduler sends a `DraftQuery` per running request with every step that drafts
(and one for every request that ended, `is_final`); the drafter answers each with a
`DraftReply`. Both sides build and read them here, so the wire has one shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.segserve.v1 import drafter_pb2
from protos.segserve.v1.tree import CandidateTree


@dataclass(frozen=True)
class DraftQuery:
    """One request's state update and its ask for a tree."""

    request_id: str
    new_token_ids: list[int]
    """Tokens since the ones the drafter was last sent (the whole sequence on a first query or a resync)."""
    num_tokens: int
    """Length of the whole sequence after new_token_ids: a drafter whose state disagrees asks for a resync."""
    num_prompt_tokens: int
    max_nodes: int
    """Most draft tokens in the tree; 0 = a state update only."""
    num_known_tokens: int = 0
    """With the whole sequence: tokens some drafter already received (segments closing within them are learned)."""
    is_final: bool = False
    """The request ended with these tokens: learn, then drop its state; no tree."""
    tenant: str = ""
    """Whose request: the drafter learns its segments into this tenant's corpora."""
    corpus_key: str = ""
    """A structured output's corpus (corpus_key()): the whole output is one segment, learned into and drafted
    from that key's corpus; empty = segments by markers."""
    min_node_prob: float = 0.0
    """The step's price of a draft token in accepted tokens (SpecPolicy.node_price): less likely nodes are left
    out. Off the wire, a price out of [0, 1) (or NaN) is no price."""

    @property
    def is_update_only(self) -> bool:
        """No tree asked for."""
        return self.is_final or self.max_nodes == 0

    def to_pb(self) -> drafter_pb2.DraftQuery:
        return drafter_pb2.DraftQuery(request_id=self.request_id, new_token_ids=self.new_token_ids,
                                      num_tokens=self.num_tokens, num_prompt_tokens=self.num_prompt_tokens,
                                      max_nodes=self.max_nodes, num_known_tokens=self.num_known_tokens,
                                      is_final=self.is_final, tenant=self.tenant, corpus_key=self.corpus_key,
                                      min_node_prob=self.min_node_prob)

    @classmethod
    def from_pb(cls, pb: drafter_pb2.DraftQuery) -> DraftQuery:
        price = pb.min_node_prob if 0 <= pb.min_node_prob < 1 else 0.0  # out of range or NaN: no price
        return cls(pb.request_id, list(pb.new_token_ids), pb.num_tokens, pb.num_prompt_tokens, pb.max_nodes,
                   pb.num_known_tokens, pb.is_final, pb.tenant, pb.corpus_key, price)


@dataclass(frozen=True)
class DraftReply:
    """A drafter's answer for one query: a tree, or a request to resend the whole sequence. Off the wire the tree
    is unchecked: call tree.problem() before using it."""

    tree: CandidateTree = CandidateTree()
    segment: str = ""
    """The segment kind the request is in."""
    needs_resync: bool = False
    marker_token_ids: tuple[int, ...] = ()
    """Every token of the drafter's segment markers: the request's segment may change where one comes."""

    def to_pb(self, request_id: str) -> drafter_pb2.DraftReply:
        return drafter_pb2.DraftReply(request_id=request_id, tree=self.tree.to_pb(), segment=self.segment,
                                      needs_resync=self.needs_resync, marker_token_ids=self.marker_token_ids)

    @classmethod
    def from_pb(cls, pb: drafter_pb2.DraftReply) -> DraftReply:
        return cls(CandidateTree.from_pb(pb.tree), pb.segment, pb.needs_resync, tuple(pb.marker_token_ids))
