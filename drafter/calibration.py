"""How likely a draft node is to be accepted, as measured: per segment kind, what became of the nodes proposed.

In: each request's last merged trie (drafter/trees.py `merge`) and the tokens the target wrote after it. Out:
`calibrate(kind)`, a trees.Calibrate: (depth, weight, parent's weight) -> the chance a node is accepted once its
parent is, which trees.grow multiplies along a path.

Why: a node's weight (the scores of the continuations through it, each source's scaled by its measured match
share) ranks nodes but is no chance. A chain's deepest node weighs what its first does, though every token deeper
is one more chance to go wrong, and sources that agree add up past 1. The scheduler prices a draft token in
accepted tokens (DraftQuery.min_node_prob), and only a chance can be held against a price: a node worth less than
it slows the step down.

How: when a request's next query comes, its last trie is walked along the tokens written since: every child of
the root and of each node on the written path is judged (accepted: it is the token written there); nothing under
a rejected node is (what is measured is the chance given the parent). The whole trie is judged, not the tree cut
from it, so that the nodes a price left out are measured too. Judgements are counted per kind, depth and bin of
the node's weight (at depth 1) or of its share of its parent's weight (deeper); a bin's chance is its accepted
share drawn toward that weight or share by PRIOR judgements, so that before anything is measured the chances
multiply back to the plain weights (w1 * w2/w1 * ... = the node's own). Counts halve past MAX_JUDGED, so that
the chances follow the traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from drafter.trees import Calibrate, TrieNode

NUM_BINS = 10
"""Bins of a node's weight or share, each a tenth of [0, 1]."""
_DEPTH_BUCKETS = (0, 0, 1, 2, 3, 3, 4, 4, 4)
"""Depth -> its bucket (1, 2, 3, 4-5, 6-8); deeper nodes share the last, 5."""
NUM_DEPTH_BUCKETS = 6
PRIOR = 2.0
"""Judgements a bin's chance starts from, at the node's own weight or share."""
MAX_JUDGED = 512.0
"""A bin's judgements past which its counts halve."""


def _slot(depth: int, feature: float) -> int:
    bucket = _DEPTH_BUCKETS[depth] if depth < len(_DEPTH_BUCKETS) else NUM_DEPTH_BUCKETS - 1
    return bucket * NUM_BINS + min(int(feature * NUM_BINS), NUM_BINS - 1)


def _feature(depth: int, weight: float, parent_weight: float) -> float:
    """A node's weight (depth 1) or its share of its parent's (deeper), within [0, 1]."""
    share = weight if depth == 1 else weight / parent_weight
    return min(max(share, 0.0), 1.0)


class NodeCalibration:
    """Judged and accepted nodes per segment kind, depth bucket and weight bin (the module docstring)."""

    def __init__(self) -> None:
        self.counts: dict[str, list[list[float]]] = {}
        """Segment kind -> [judged, accepted] per slot (depth bucket * NUM_BINS + bin)."""

    def chance(self, kind: str, depth: int, weight: float, parent_weight: float) -> float:
        """The chance a node of `kind` at `depth` is accepted once its parent is (a trees.Calibrate)."""
        feature = _feature(depth, weight, parent_weight)
        counts = self.counts.get(kind)
        if counts is None:
            return feature
        judged, accepted = counts[_slot(depth, feature)]
        return (accepted + PRIOR * feature) / (judged + PRIOR)

    def calibrate(self, kind: str) -> Calibrate:
        return partial(self.chance, kind)

    def judge(self, kind: str, root: TrieNode, written: Sequence[int]) -> None:
        """Count the fate of the trie's nodes that `written` (the tokens after it) decides."""
        if not written or not root.children:
            return
        counts = self.counts.setdefault(kind, [[0.0, 0.0] for _ in range(NUM_DEPTH_BUCKETS * NUM_BINS)])
        node = root
        for depth, token_id in enumerate(written, start=1):
            following = None
            for child in node.children.values():
                slot = counts[_slot(depth, _feature(depth, child.weight, node.weight))]
                slot[0] += 1.0
                if child.token_id == token_id:
                    slot[1] += 1.0
                    following = child
                if slot[0] >= MAX_JUDGED:
                    slot[0] /= 2
                    slot[1] /= 2
            if following is None or not following.children:
                return
            node = following

    def of_kind(self, kind: str) -> dict[int, list[tuple[float, float]]]:
        """Depth bucket -> (judged, accepted) per weight bin, for one kind; empty if nothing was judged."""
        counts = self.counts.get(kind)
        if counts is None:
            return {}
        return {bucket: [tuple(slot) for slot in counts[bucket * NUM_BINS:(bucket + 1) * NUM_BINS]]
                for bucket in range(NUM_DEPTH_BUCKETS)}
