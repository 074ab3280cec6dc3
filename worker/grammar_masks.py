"""A step's grammar masks: the rows of constrained sequences with every forbidden token at -inf, before sampling.

In: the step's works, the indices of those under a grammar (worker/planning.py's ForwardPlan.constrained), their
sequences' states (worker/grammar.py's GrammarState on each), and the logits. Out: those rows masked in place, for
worker/verify.py's sample_works (`constrainer` is its Constrainer), and the works whose output broke their grammar.

Two phases, so that the grammar's host work can leave the step's critical path:
- `fill_masks` needs the matchers and the trees, not the logits. Every matcher catches up with its sequence's output,
  then fills its rows of ONE host bitmask (`GrammarMasks`, kept and grown from step to step, pinned on CUDA): one
  row at the end of a plain work, one per node of a tree (GrammarState.walk stands at each node in turn). Where it
  runs is the runner's choice (worker/model_runner.py, OVERLAP_MIN_FORWARD_S): on a GPU after the forward's launch,
  on the step's thread, while the device computes; on the CPU on the runner's grammar thread while a long forward
  runs (torch's kernels and xgrammar's calls release the GIL), and after a short one, where a second thread costs
  the forward more than it hides.
- `constrainer`, in sample_works after the forward, gets the fill (waits for it, or runs it) and applies the
  bitmask: on a GPU one copy goes to the device and one masked write covers every constrained row of the step (on
  the CPU numpy writes them in place).
Between the two, nothing else touches the matchers: the runner waits for the fill before the step ends, whatever
happens (the forced spans and the next step's pruning use them after). A step without constrained rows does none
of this (the runner starts no fill and makes no constrainer for it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import xgrammar as xgr

from worker.grammar import GrammarError, GrammarState, fill_rows
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

        On the CPU, numpy unpacks the forbidden bits into bytes and writes -inf where they are set, into each run
        of consecutive rows in place: 5x quicker than xgrammar's CPU kernel at a 400-token vocabulary and at
        262,144 (measured 17 against 80 us for 64 rows of 400, 10 against 52 ms for 64 rows of 262,144), and
        several times quicker than unpacking with torch ops; on a GPU, one copy of the bitmask and one masked write
        of the rows.
        """
        if logits.device.type != "cpu":
            self.apply_by_index(logits, rows, bitmask)
        elif logits.dtype != torch.float32:  # (numpy has no bfloat16)
            for first, start, end in _runs(rows):
                xgr.apply_token_bitmask_inplace(logits[first:first + end - start], bitmask[start:end])
        else:
            forbidden = np.unpackbits((~bitmask).numpy().view(np.uint8), axis=1, count=logits.shape[1],
                                      bitorder="little").view(np.bool_)  # [R, V]: bit j of word w is token 32 w + j
            for first, start, end in _runs(rows):
                np.copyto(logits[first:first + end - start].numpy(), -np.inf, where=forbidden[start:end])

    def apply_by_index(self, logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
        """apply() as a GPU runs it, on any device: the bitmask copied there, unpacked, and one masked write."""
        num_rows, device = len(rows), logits.device
        words = bitmask.to(device, non_blocking=True)  # [B, W]
        bits = (words[:, :, None] >> self._shifts.to(device)) & 1  # [B, W, 32]
        allowed = bits.bool().reshape(num_rows, -1)[:, :logits.shape[1]]  # [B, V]
        index = to_device(torch.tensor(list(rows), dtype=torch.long), device)  # [B]
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(~allowed, float("-inf")))


@dataclass
class FilledMasks:
    """A step's masks as fill_masks left them."""

    bitmask: torch.Tensor
    """[R, W] int32 on the host, GrammarMasks.rows(): the masked works' rows, in the order of `spans`."""
    spans: list[tuple[int, int]]
    """(work index, its number of rows) of every work whose matcher filled rows, in bitmask order."""
    failed: dict[int, str]
    """Work index -> why it failed: its output broke its grammar (its rows are not masked), its grammar did not
    compile (neither), or its tree holds a node the grammar forbids."""


@torch.inference_mode()  # on the grammar thread too: the reused bitmask is an inference tensor, written in place
def fill_masks(works: Sequence[Work], constrained: Sequence[int], states: Mapping[str, ConstrainedState],
               masks: GrammarMasks) -> FilledMasks:
    """The masks of every sample row of each of `constrained` (indices into works: one row at the end of a plain
    work, every node of a tree, pruned to what the grammar allows in planning), after its matcher caught up with the
    sequence's output (waiting for its grammar's compile, the first time). A work whose output broke its grammar
    fails with the reason, and so does one whose grammar did not compile.

    Where the runner runs it on its grammar thread beside the forward, it is the only user of these matchers until
    it returns, and the histories it reads are not written before the step's postprocess."""
    failed, masked, num_rows = {}, [], 0
    for i in constrained:
        state = states[works[i].seq_id]
        try:
            problem = state.grammar.sync(state.history[state.num_prompt_tokens:])
        except GrammarError as exc:
            problem = str(exc)
        if problem is None:
            masked.append(i)
            num_rows += len(works[i].sample_indices)
        else:
            failed[i] = problem
    bitmask, start, spans, plain, plain_rows = masks.rows(num_rows), 0, [], [], []
    for i in masked:
        work, grammar = works[i], states[works[i].seq_id].grammar
        if not work.is_tree:
            plain.append(grammar)
            plain_rows.append(start)
        elif not all(grammar.walk(work.token_ids, work.node_parents,
                                  lambda node, first=start, grammar=grammar: grammar.fill(bitmask, first + node))):
            failed[i] = "its tree holds a node its structured_output forbids (the worker prunes those first)"
        spans.append((i, len(work.sample_indices)))
        start += len(work.sample_indices)
    fill_rows(plain, bitmask, plain_rows)
    if num_rows:
        _fail_dead_ends(bitmask[:num_rows], spans, failed)
    return FilledMasks(bitmask, spans, failed)


def _fail_dead_ends(bitmask: torch.Tensor, spans: Sequence[tuple[int, int]], failed: dict[int, str]) -> None:
    """Fail each work with a row whose mask allows no token at all (no token of the model continues its grammar
    there): sampling it would draw a forbidden token. bitmask: int32 [R, W], the works' rows in `spans` order."""
    is_dead = (bitmask == 0).all(dim=1).tolist()  # [R]
    start = 0
    for i, num_rows in spans:
        if i not in failed and any(is_dead[start:start + num_rows]):
            failed[i] = "its structured_output allows no token of this model here (it cannot be continued)"
        start += num_rows


def constrainer(filled_masks: Callable[[], FilledMasks], masks: GrammarMasks) -> Constrainer:
    """What masks a step's constrained rows for worker/verify.py's sample_works: it gets their masks from
    filled_masks() (fill_masks run now, or waited for where it ran beside the forward), applies them, and returns
    the works that failed there."""
    def constrain(logits: torch.Tensor, first_rows: list[int]) -> dict[int, str]:
        filled = filled_masks()
        rows = [row for i, num_rows in filled.spans for row in range(first_rows[i], first_rows[i] + num_rows)]
        if rows:
            masks.apply(logits, rows, filled.bitmask)
        return dict(filled.failed)
    return constrain


def _runs(rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first row, start, end) of each run of consecutive rows: rows[start:end] is first, first + 1, ..."""
    runs, start = [], 0
    for j in range(1, len(rows) + 1):
        if j == len(rows) or rows[j] != rows[j - 1] + 1:
            runs.append((rows[start], start, j))
            start = j
    return runs
