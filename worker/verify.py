"""Sampling after the forward: plain rows, and speculative trees verified by an acceptance walk.

In: the step's `Work`s (worker/work.py; a tree's node 0 is the root, the last sampled token) and
the target's logits: a row per sample index (every node of a tree), then the rows kept for prompt
log-probabilities. Out: per work, its tokens, scores and top log-probabilities (for a tree the
accepted drafts followed by the target's own token), per tree the accepted node indices, and per
work that failed the reason; `kv_moves` says where accepted KV goes.

Acceptance keeps the target's distribution exactly (SPEC section 2 step 5): the walk starts at the
root; at each visited node one token is chosen from the target's processed distribution at that
node, with the node's own prefix (greedy: the argmax; sampling: one draw from the sequence's
generator); if a child carries that token the walk descends, else the token is emitted and the
walk stops. Every node of every tree, and every plain row, is sampled in ONE sampler call, a node
with the uniform of its depth (worker/draws.py), so the walk only follows tokens already chosen,
and a seeded sequence still consumes one uniform per output token, as plain decoding does. The
chosen tokens, their scores, the top log-probabilities and the non-finite check come to the host
in one transfer: the step's only wait for the device. Before the sampler call, the rows of
sequences with a structured output get their grammar's mask (worker/grammar.py: forbidden tokens
at -inf). A sampler failure fails only the sequence whose rows raised (worker/faults.py), and so
do non-finite logits at any of its rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.draws import DrawPlan, draw_uniforms
from worker.faults import non_finite_mask, sample_isolated
from worker.sampler import SampleRow, SamplerOutput
from worker.work import Work


NON_FINITE_LOGITS = "non-finite logits (NaN or infinity)"
NON_FINITE_KV = "non-finite keys or values (NaN or infinity)"
NON_FINITE = (NON_FINITE_LOGITS, NON_FINITE_KV)
"""Why a work failed when its forward overflowed: the KV it wrote may not be finite either."""


class TreeWalk:
    """The acceptance walk over one tree step: `node` is where the next token is chosen.

    Siblings carrying the same token have the same prefix, hence the same logits and KV: the walk
    stands on all of them at once and descends into whichever has a matching child, so the
    accepted path is the longest one the target agrees with even when a drafter sends duplicates.
    """

    def __init__(self, work: Work):
        self._token_ids = work.token_ids
        self._children: list[list[int]] = [[] for _ in work.token_ids]  # node -> its children, in order
        for node, parent in enumerate(work.node_parents[1:], start=1):
            self._children[parent].append(node)
        self._nodes = [0]
        self.accepted_nodes: list[int] = []
        """Draft nodes accepted so far, root excluded, in path order."""
        self.is_done = False

    @property
    def node(self) -> int:
        """The node whose distribution chooses the next token (any of the equivalent ones)."""
        return self._nodes[0]

    def offer(self, token: int) -> None:
        """The token the target chose at `node`: descend to the children carrying it, or stop."""
        matches = [child for node in self._nodes for child in self._children[node] if self._token_ids[child] == token]
        if not matches:
            self.is_done = True
            return
        self.accepted_nodes.append(matches[0])
        self._nodes = matches


def kv_moves(accepted_nodes: Sequence[int], depths: Sequence[int]) -> list[tuple[int, int]]:
    """(from, to) offsets after num_computed_tokens: each accepted node moves to its depth.

    Moves are listed in increasing depth; a node's depth never exceeds its index.
    """
    return [(node, depths[node]) for node in accepted_nodes if node != depths[node]]


RowMaker = Callable[[Work], list[SampleRow]]
"""Builds the SampleRows of a work's sample indices, in order (each with its own prefix where it is read)."""
Constrainer = Callable[[torch.Tensor, list[int]], dict[int, str]]
"""Masks, in place, the rows of logits [N, V] that grammars constrain, given each work's first sample row; returns
work index -> why it failed (its output broke its grammar)."""


@dataclass(slots=True)  # one per sampled sequence per step
class Sampled:
    """What one work sampled this step, token by token."""

    token_ids: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[list[int], list[float]] | None] = field(default_factory=list)
    accepted_nodes: list[int] | None = None
    """Tree steps: the accepted draft nodes (root excluded)."""


def step_paths(work: Work) -> list[tuple[int, ...]]:
    """Per sample index of `work`, the step's tokens it sees, itself included (its path or its prefix), each
    tree path built from its parent's in one tuple concatenation rather than walked back to the root."""
    if not work.is_tree:
        return [work.token_ids[:index + 1] for index in work.sample_indices]
    paths: list[tuple[int, ...]] = []
    for node, parent in enumerate(work.node_parents):  # parents come before their children
        paths.append((paths[parent] if parent >= 0 else ()) + (work.token_ids[node],))
    return [paths[index] for index in work.sample_indices]


def sample_works(works: Sequence[Work], logits: torch.Tensor, make_rows: RowMaker,
                 non_finite_tokens: torch.Tensor | None = None, constrain: Constrainer | None = None
                 ) -> tuple[dict[int, Sampled], dict[int, str]]:
    """Sample every row of every work in one sampler call, then walk the trees over the chosen tokens.

    logits: [N + R, V]: N rows, one per sample index in work order (a tree has one per node), then R
    rows kept for prompt log-probabilities, in work order; all N + R are checked for non-finite values.
    non_finite_tokens: [T] bool, per new token of the step in work order, whether its keys or values were
    not finite (the forward's check); fetched in the same transfer, and fails the works they belong to.
    constrain: masks the rows of structured outputs (worker/grammar.py), after the non-finite check and before
    sampling; None when no work has one.
    Returns (work index -> what it sampled, for the works that sampled and did not fail; work index ->
    why it failed). Seeded generators are left where one draw per emitted token leaves them.
    """
    first_rows, num_rows = [], 0
    for work in works:
        first_rows.append(num_rows)
        num_rows += len(work.sample_indices)
    sampling = [i for i, work in enumerate(works) if work.sample_indices]
    rows = [row for i in sampling for row in make_rows(works[i])]
    drawing = [i for i in sampling if rows[first_rows[i]].params.do_sample]
    plans = [DrawPlan(first_rows[i], rows[first_rows[i]].generator, _draw_positions(works[i])) for i in drawing]
    uniform, seeded = draw_uniforms(plans, num_rows, logits.device)
    groups = [(first_rows[i], first_rows[i] + len(works[i].sample_indices)) for i in sampling]
    checks = non_finite_mask(logits)  # of the model's logits: before a grammar sets tokens to -inf
    if non_finite_tokens is not None:
        checks = torch.cat([checks, non_finite_tokens])
    failed = constrain(logits[:num_rows], first_rows) if constrain is not None else {}
    parts, failed_groups = sample_isolated(logits[:num_rows], rows, uniform, groups) if rows else ([], {})
    is_bad, chosen = _fetch(checks, parts, num_rows)
    failed |= {sampling[g]: message for g, message in failed_groups.items()}
    if is_bad.any():
        owners = [i for i, w in enumerate(works) for _ in w.sample_indices]
        owners += [i for i, w in enumerate(works) for _ in w.prompt_offsets]
        num_logits = len(owners)
        owners += [i for i, w in enumerate(works) for _ in w.token_ids]
        non_finite: dict[int, str] = {}  # a work's first bad row names it: its logits before its keys and values
        for row in np.flatnonzero(is_bad).tolist():
            non_finite.setdefault(owners[row], NON_FINITE_LOGITS if row < num_logits else NON_FINITE_KV)
        failed |= non_finite
    sampled = {i: _accept(works[i], chosen, first_rows[i]) for i in sampling if i not in failed}
    for j, draws in seeded.items():
        if drawing[j] in sampled:
            draws.keep(len(sampled[drawing[j]].token_ids))
    return sampled, failed


Chosen = tuple[list[int], list[float], list[tuple[list[int], list[float]] | None]]
"""Per sample row: the chosen token, its score and its top log-probabilities or None."""


def _fetch(is_bad: torch.Tensor, parts: list[tuple[int, SamplerOutput]], num_rows: int) -> tuple[np.ndarray, Chosen]:
    """The non-finite mask [N + R] (a numpy bool array) and the sampler's outputs on the host, in ONE
    device-to-host transfer.

    float64 holds every token id (< 2**53) and float32 value exactly. Rows no part covers (their
    sequence's sampling failed) get token 0 and score 0.0.
    """
    tensors = [is_bad] + [t for _, out in parts for t in out.device_parts()]
    sizes = [t.numel() for t in tensors]
    if sum(sizes):
        flat = torch.cat([t.to(torch.float64) for t in tensors]).cpu().numpy()  # [sum(sizes)], the one transfer
    else:  # nothing sampled or checked (a prefill chunk): no transfer
        flat = np.zeros(0)
    lists, start = [], 0
    for size in sizes:
        lists.append(flat[start:start + size])
        start += size
    token_ids, scores, top = [0] * num_rows, [0.0] * num_rows, [None] * num_rows
    for k, (first_row, out) in enumerate(parts):
        part_ids, part_scores, part_top = out.from_host(lists[1 + 4 * k:5 + 4 * k])
        end = first_row + len(part_ids)
        token_ids[first_row:end], scores[first_row:end], top[first_row:end] = part_ids, part_scores, part_top
    return lists[0] != 0, (token_ids, scores, top)


def _draw_positions(work: Work) -> Sequence[int]:
    """Per sample row of a work, the index among the step's emitted tokens that its uniform is drawn for."""
    return work.node_depths if work.is_tree else range(len(work.sample_indices))


def _accept(work: Work, chosen: Chosen, first_row: int) -> Sampled:
    """What a work emits, from the tokens chosen at its rows: every row of a plain work; for a tree, the
    walk from the root along children that carry the chosen token, ending with the target's own token."""
    token_ids, scores, top = chosen
    if not work.is_tree:
        end = first_row + len(work.sample_indices)
        return Sampled(token_ids[first_row:end], scores[first_row:end], top[first_row:end])
    out, walk = Sampled(), TreeWalk(work)
    while not walk.is_done:
        row = first_row + walk.node
        out.token_ids.append(token_ids[row])
        out.scores.append(scores[row])
        out.top_logprobs.append(top[row])
        walk.offer(token_ids[row])
    out.accepted_nodes = walk.accepted_nodes
    return out
