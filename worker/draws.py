"""The step's uniforms, drawn before sampling: each sampling sequence's, one per token it may emit.

In: per sampling sequence, its first sample row, its generator (None: torch's global RNG) and the
draw position of each of its rows (plain rows: 0, 1, ...; tree nodes: their depth). Out: one
uniform per sample row [N] on the device, and per seeded sequence a `SeededDraws` that puts its
generator, after acceptance, where drawing one uniform per emitted token would have left it.

Plain decoding draws one uniform per output token from the sequence's generator, in order
(`torch.rand(1)` each). A tree step may emit up to depth + 1 tokens, so the sequence draws that
many up front, and the node at depth d uses the uniform of the step's d-th token: the walk visits
one node per depth (or siblings carrying the same token, whose distributions are the same), so no
path reuses a draw, and siblings at one depth may share theirs. After the walk the generator is put
back where num_emitted draws leave it: a seeded sequence gives the same tokens with and without
trees. Unseeded sequences draw from the global RNG, all in one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.upload import to_device


@dataclass(frozen=True)
class DrawPlan:
    """What one sampling sequence draws this step."""

    first_row: int
    """Its first sample row; its rows are first_row, first_row + 1, ..."""
    generator: torch.Generator | None
    positions: Sequence[int]
    """Per row, which of the sequence's uniforms it uses (its token's index among those the step emits)."""


class SeededDraws:
    """`num` uniforms drawn in order from one generator, as `num` calls of rand(1) would draw them."""

    def __init__(self, generator: torch.Generator, num: int, device: torch.device, is_batched: bool | None = None):
        """is_batched: draw with one rand(num) (None: on the CPU, whose mt19937 gives rand(n) the values and
        the final state of n calls of rand(1)); else num calls of rand(1)."""
        self.generator, self._num, self._device = generator, num, device
        # The states to go back to: after 0 draws (batched: the used ones are redrawn) or after each
        # draw (elsewhere: CUDA's is a (seed, offset) pair, cheap to keep). None: nothing to undo.
        self._states: list[torch.Tensor] | None = None
        if (device.type == "cpu" if is_batched is None else is_batched) or num == 1:
            self._states = [generator.get_state()] if num > 1 else None
            self.uniform = torch.rand(num, generator=generator, device=device)  # [num]
            return
        # CUDA's Philox does not: rand(n) takes n values of one counter, rand(1) one value per call.
        self._states, draws = [generator.get_state()], []
        for _ in range(num):
            draws.append(torch.rand(1, generator=generator, device=device))
            self._states.append(generator.get_state())
        self.uniform = torch.cat(draws)  # [num]

    def keep(self, num_used: int) -> None:
        """Leave the generator where drawing the first num_used of the uniforms, in order, would have."""
        if num_used >= self._num or self._states is None:
            return
        if len(self._states) > 1:
            self.generator.set_state(self._states[num_used])
            return
        self.generator.set_state(self._states[0])
        if num_used:
            torch.rand(num_used, generator=self.generator, device=self._device)


def draw_uniforms(plans: Sequence[DrawPlan], num_rows: int, device: torch.device
                  ) -> tuple[torch.Tensor | None, dict[int, SeededDraws]]:
    """(uniform per sample row [num_rows] or None when no row samples, plan index -> SeededDraws).

    Rows no plan covers (greedy rows) get an arbitrary uniform, which the sampler ignores.
    """
    if not plans:
        return None, {}
    num_draws = [max(plan.positions) + 1 for plan in plans]
    seeded = {j: SeededDraws(plan.generator, num_draws[j], device)
              for j, plan in enumerate(plans) if plan.generator is not None}
    num_global = sum(n for j, n in enumerate(num_draws) if j not in seeded)
    pieces = [torch.rand(num_global, device=device)] if num_global else []  # [num_global]
    base, next_global, next_seeded = [0] * len(plans), 0, num_global
    for j, n in enumerate(num_draws):
        if j in seeded:
            base[j], next_seeded = next_seeded, next_seeded + n
            pieces.append(seeded[j].uniform)
        else:
            base[j], next_global = next_global, next_global + n
    index = [0] * num_rows
    for j, plan in enumerate(plans):
        index[plan.first_row:plan.first_row + len(plan.positions)] = [base[j] + p for p in plan.positions]
    uniforms = torch.cat(pieces) if len(pieces) > 1 else pieces[0]  # [sum(num_draws)]
    if index == list(range(uniforms.shape[0])):  # e.g. plain decoding, every row unseeded
        return uniforms, seeded
    return uniforms.index_select(0, to_device(torch.tensor(index, dtype=torch.long), device)), seeded
