"""A step's grammar masks: the rows of constrained sequences with every forbidden token at -inf, before sampling.

In: the step's works, the indices of those under a grammar (worker/planning.py's StepPlan.constrained), their
sequences' states (worker/grammar.py's GrammarState on each), and the logits. Out: those rows masked in place, for
worker/verify.py's sample_works (`constrainer` is its Constrainer), and the works whose output broke their grammar.

Every matcher fills its rows of ONE host bitmask (`GrammarMasks`, kept and grown from step to step, pinned on
CUDA): one row at the end of a plain work, one per node of a tree (GrammarState.walk stands at each node in turn);
then on a GPU one copy goes to the device and one masked write covers every constrained row of the step (on the CPU
xgrammar's kernel writes them in place). The host work runs after the forward was launched, so on a GPU it overlaps
the forward. A step without constrained rows does none of this (the runner makes no constrainer for it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
import xgrammar as xgr

from worker.grammar import GrammarState
from worker.upload import to_device
from worker.verify import Constrainer
from worker.work import Work


class ConstrainedState(Protocol):
    """What `constrainer` reads of a sequence's state (worker/planning.py's SequenceState)."""

    grammar: GrammarState | None
    history: list[int]
    num_prompt_tokens: int


class GrammarMasks:
    """The host bitmask a step's matchers fill, kept and grown from step to step (pinned on CUDA, so its copy to
    the device does not make the host wait), and what applies it to the logits."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self._host = xgr.allocate_token_bitmask(0, vocab_size)  # [capacity, W] int32
        self._shifts = torch.arange(32, dtype=torch.int32, device=device)  # [32]

    def rows(self, num_rows: int) -> torch.Tensor:
        """A host bitmask of num_rows rows [num_rows, ceil(V / 32)], whatever they hold; valid until the next call.
        Reusing it is safe: a step's copy to the device is done by the time the step's results reach the host."""
        if num_rows > len(self._host):
            host = xgr.allocate_token_bitmask(max(num_rows, 2 * len(self._host)), self.vocab_size)
            self._host = host.pin_memory() if self.device.type == "cuda" else host
        return self._host[:num_rows]

    def apply(self, logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
        """Set every token that bitmask[j] forbids at logits row rows[j] to -inf, in place. logits: [N, V]; rows:
        distinct; bitmask: [len(rows), W] from rows(). The other rows are not touched.

        On the CPU, xgrammar's kernel writes each run of consecutive rows in place (unpacking the bits with torch
        ops there costs several times more at a 262k vocabulary); on a GPU, one copy of the bitmask and one masked
        write of the rows.
        """
        if logits.device.type == "cpu":
            for first, start, end in _runs(rows):
                xgr.apply_token_bitmask_inplace(logits[first:first + end - start], bitmask[start:end])
        else:
            self.apply_by_index(logits, rows, bitmask)

    def apply_by_index(self, logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
        """apply() as a GPU runs it, on any device: the bitmask copied there, unpacked, and one masked write."""
        num_rows, device = len(rows), logits.device
        words = bitmask.to(device, non_blocking=True)  # [B, W]
        bits = (words[:, :, None] >> self._shifts.to(device)) & 1  # [B, W, 32]
        allowed = bits.bool().reshape(num_rows, -1)[:, :logits.shape[1]]  # [B, V]
        index = to_device(torch.tensor(list(rows), dtype=torch.long), device)  # [B]
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))


def constrainer(works: Sequence[Work], constrained: Sequence[int], states: Mapping[str, ConstrainedState],
                masks: GrammarMasks) -> Constrainer:
    """What masks a step's constrained rows for worker/verify.py's sample_works: every sample row of each of
    `constrained` (indices into works: one row at the end of a plain work, every node of a tree, pruned to what the
    grammar allows in planning) after its matcher caught up with the sequence's output. A work whose output broke
    its grammar fails with the reason and its rows are left as they are."""
    def constrain(logits: torch.Tensor, first_rows: list[int]) -> dict[int, str]:
        failed, rows, masked = {}, [], []
        for i in constrained:
            work, state = works[i], states[works[i].seq_id]
            problem = state.grammar.sync(state.history[state.num_prompt_tokens:])
            if problem is None:
                rows += range(first_rows[i], first_rows[i] + len(work.sample_indices))
                masked.append(i)
            else:
                failed[i] = problem
        if not rows:
            return failed
        bitmask, start = masks.rows(len(rows)), 0
        for i in masked:
            work, grammar = works[i], states[works[i].seq_id].grammar
            if not work.is_tree:
                grammar.fill(bitmask, start)
            elif not all(grammar.walk(work.token_ids, work.node_parents,
                                      lambda node, first=start, grammar=grammar: grammar.fill(bitmask, first + node))):
                failed[i] = "its tree holds a node its structured_output forbids (the worker prunes those first)"
            start += len(work.sample_indices)
        masks.apply(logits, rows, bitmask)
        return failed
    return constrain


def _runs(rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first row, start, end) of each run of consecutive rows: rows[start:end] is first, first + 1, ..."""
    runs, start = [], 0
    for j in range(1, len(rows) + 1):
        if j == len(rows) or rows[j] != rows[j - 1] + 1:
            runs.append((rows[start], start, j))
            start = j
    return runs
