"""The candidate-tree contract (common.proto's CandidateTree): one encoding, one depth, one check.

A tree holds draft tokens after a sequence's last token (the root, implicit).
`parents[i]` is -1 for a child of the root, else the index of an earlier draft.
The drafter builds trees, the scheduler prunes them to its budget and checks the
worker's answer against them, the worker verifies them: all with this type.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from protos.segserve.v1 import common_pb2

ROOT = -1
"""The parent of the root's children."""


@dataclass(frozen=True)
class CandidateTree:
    """Draft tokens in topological order (a parent before its children)."""

    token_ids: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    """Parent of each draft token: ROOT (-1), or an index into token_ids smaller than its own."""
    depths: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """Depth of each draft token: the root's children have depth 1. Computed once."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", tuple(self.token_ids))
        object.__setattr__(self, "parents", tuple(self.parents))
        depths: list[int] = []
        for index, parent in enumerate(self.parents):
            # A malformed parent gets depth 0 here; problem() reports it.
            depths.append(1 if parent == ROOT else depths[parent] + 1 if 0 <= parent < index else 0)
        object.__setattr__(self, "depths", tuple(depths))

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def max_depth(self) -> int:
        """Depth of the deepest draft (0 for an empty tree)."""
        return max(self.depths, default=0)

    def problem(self, vocab_size: int | None = None, max_nodes: int | None = None) -> str | None:
        """Why this tree cannot be verified as sent, or None when it is well formed."""
        if len(self.token_ids) != len(self.parents):
            return f"{len(self.token_ids)} draft tokens but {len(self.parents)} parents"
        if max_nodes is not None and len(self.token_ids) > max_nodes:
            return f"{len(self.token_ids)} draft tokens, more than the {max_nodes} allowed"
        for index, (token_id, parent) in enumerate(zip(self.token_ids, self.parents)):
            if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                return f"draft token {token_id} is outside the vocabulary of {vocab_size}"
            if not ROOT <= parent < index:
                return f"draft {index} has parent {parent} (must be -1 or an earlier draft)"
        return None

    def prune(self, max_nodes: int, max_depth: int) -> CandidateTree:
        """The first max_nodes drafts (topological order) no deeper than max_depth whose parents are kept.

        A topological prefix of the kept drafts is itself a tree, so the result is well formed.
        """
        new_index: dict[int, int] = {}
        token_ids: list[int] = []
        parents: list[int] = []
        for index, (token_id, parent, depth) in enumerate(zip(self.token_ids, self.parents, self.depths)):
            if len(token_ids) >= max_nodes:
                break
            if depth > max_depth or (parent != ROOT and parent not in new_index):
                continue
            new_index[index] = len(token_ids)
            token_ids.append(token_id)
            parents.append(ROOT if parent == ROOT else new_index[parent])
        return CandidateTree(tuple(token_ids), tuple(parents))

    def is_path(self, token_ids: Sequence[int]) -> bool:
        """Whether token_ids is an accepted answer: token_ids[:-1] walks the tree down from the root.

        The last token is the target's own and may be anything.
        """
        nodes = {ROOT}  # a set: siblings may repeat a token
        for token_id in token_ids[:-1]:
            nodes = {i for i, parent in enumerate(self.parents) if parent in nodes and self.token_ids[i] == token_id}
            if not nodes:
                return False
        return len(token_ids) >= 1

    def to_pb(self) -> common_pb2.CandidateTree:
        return common_pb2.CandidateTree(token_ids=self.token_ids, parents=self.parents)

    @classmethod
    def from_pb(cls, pb: common_pb2.CandidateTree) -> CandidateTree:
        """Convert as sent; call problem() before trusting it."""
        return cls(tuple(pb.token_ids), tuple(pb.parents))
