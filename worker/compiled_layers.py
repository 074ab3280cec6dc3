"""A lean decoder's layer regions compiled by torch.compile (inductor), one compiled code for every layer and token
count.

A lean layer runs as two regions around its paged attention (worker/lean_decoder.py): before_attention (input norm,
projections, query and key norms, rotary embedding) and after_attention (output projection, norms, residuals, MLP).
Eager, each of their norms, casts, rotary steps, activations and residual additions is a kernel of its own,
launched one at a time, and replayed one at a time by a CUDA graph (worker/decode_graphs.py). Inductor fuses the
element-wise work around each linear into one generated kernel, as HF's compiled `generate` does for its whole
forward: traced on an H100, a compiled layer of gemma-3-270m ran 6 generated kernels and its 7 linears besides
its attention (docs/engine.md, "Compiled layers"). The paged attention stays eager between the regions: its shapes
(the key lengths) change every step.

One compile serves every layer and every step:
- a region takes a layer's LayerCalls, and dynamo lifts the modules' weights to inputs (inlined nn.Modules), so
  every layer of a class runs the same compiled code on its own weights (gemma-3-270m's sliding and full layers
  alike: they differ in their attention only);
- the token count is marked dynamic, so no token count gets code of its own and the kernels are the same for
  every count. Dynamo specialises a size of 1, so a step of one token runs as two copies of it.

Numerics. A compiled region rounds otherwise than the eager one (fused reductions), so a runner with compiled
layers runs every step with them: prefills, decode steps, trees, eager or from graphs. A row's result must not
depend on the other rows, for lossless greedy speculation: the generated kernels compute each row on its own, with
one configuration for every count (one kernel per region op, tuned once), and the linears keep their row policies
(worker/row_blocks.py): a linear with a policy other than rows-as-they-come runs as an opaque op
(segserve::row_block_linear), exactly as in an eager step. tests/worker/test_compiled_layers.py checks a row's logits
alone against among others on the test device.

Calls. A compiled call checks only the guards that tell its compiled codes apart
(skip_guard_eval_unsafe, as worker/compiled.py does): the runner hands every call tensors of one kind, and the
full guards, which cover every weight of the layer, cost more than the region itself on a CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from worker.compiled import allow_recompiles

logger = logging.getLogger(__name__)


class CompiledRegion:
    """fn(calls, *tensors) compiled once for every token count. The token count is dimension token_dims[i] of the
    i-th tensor, and output_dims[j] of the j-th output (a single output: output_dims[0] of it)."""

    min_tokens = 2
    """The fewest tokens a call computes as they come; one token goes as two copies of it."""

    def __init__(self, fn: Callable, token_dims: tuple[int, ...], output_dims: tuple[int, ...], name: str):
        allow_recompiles()
        self._fn, self._compiled = fn, torch.compile(fn, fullgraph=True)
        self.token_dims, self.output_dims, self.name = token_dims, output_dims, name
        self._is_compiled = False

    def __call__(self, calls, *tensors: torch.Tensor):
        is_one = tensors[0].shape[self.token_dims[0]] == 1
        if is_one:  # one token goes as two, the same twice: a dynamic size is never 1 (dynamo specialises 0 and 1)
            tensors = tuple(torch.cat((tensor, tensor), dim) for tensor, dim in zip(tensors, self.token_dims))
        output = self._call(calls, tensors) if self._is_compiled else self._compile(calls, tensors)
        if not is_one:
            return output
        if isinstance(output, torch.Tensor):
            return output.narrow(self.output_dims[0], 0, 1)
        return tuple(part.narrow(dim, 0, 1) for part, dim in zip(output, self.output_dims))

    def _call(self, calls, tensors: tuple[torch.Tensor, ...]):
        """A call after the first: only the guards that tell the region's compiled codes apart are checked. Should
        the call need another code (dynamo then refuses to compile under that stance, before running anything), it
        runs with every guard checked, which compiles one."""
        try:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self._compiled(calls, *tensors)
        except RuntimeError as error:
            if "Recompilation triggered" not in str(error):
                raise
        logger.warning("the layers' %s compiles again, for inputs of another kind", self.name)
        return self._compiled(calls, *tensors)

    def _compile(self, calls, tensors: tuple[torch.Tensor, ...]):
        """The first call (in the worker's warm-up): the token count marked dynamic, compiled (or found in dynamo's
        cache, compiled by another runner of the same model class in this process). Should compiling fail (no C
        compiler for Triton's launcher, say), the region runs eagerly from then on, every step alike."""
        for tensor, dim in zip(tensors, self.token_dims):
            torch._dynamo.mark_dynamic(tensor, dim)
        start = time.perf_counter()
        try:
            output = self._compiled(calls, *tensors)
            logger.info("compiled the layers' %s in %.1f s", self.name, time.perf_counter() - start)
        except Exception as error:  # a slower worker, not a failed one
            logger.error("the layers' %s could not be compiled, so they run eagerly: %s: %s", self.name,
                         type(error).__name__, error)
            self._compiled = self._fn
            output = self._fn(calls, *tensors)
        self._is_compiled = True
        return output


def compiled_regions(before: Callable, after: Callable) -> tuple[CompiledRegion, CompiledRegion]:
    """A lean decoder's regions (worker/lean_decoder.py's `regions`), compiled: before(calls, hidden [1, T, E],
    cos [1, 1, T, D], sin) and after(calls, hidden [1, T, E], attention [1, T, H, D])."""
    return (CompiledRegion(before, (1, 2, 2), (2, 2, 2), "before_attention"),
            CompiledRegion(after, (1, 1), (1,), "after_attention"))
