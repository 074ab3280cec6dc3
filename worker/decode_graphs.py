"""Decode steps on static buffers, replayed from CUDA graphs captured per batch size and key length.

An eager forward launches every kernel from Python, one at a time. On an H100 that made the step CPU-bound: the
GPU was busy a few percent of each step. A CUDA graph records a forward's kernels once and launches them all
again with one call, as vLLM and SGLang do for their decode batches. A graph replays fixed addresses and shapes,
so such a step reads everything it varies in from static buffers, and everything the host decides about shapes
picks the graph.

Which steps: decode steps (every sequence computes one token and samples it, no tree, no prompt log-probabilities)
of at most max(CAPTURE_SIZES) sequences, and only with a lean decoder (worker/lean_decoder.py); every other step
runs eagerly, as without graphs. The B sequences are padded to the next capture size (at least the lean decoder's
min_tokens: compiled layers take one token as two). A padding row computes token 0 at position 0, writes its key
and value to the scratch block (one block past the scheduler's, which no sequence ever gets) and reads key 0 of
block-table row 0 (read only, its output dropped).

A graph's key: the padded rows, the key length and each sliding window's key count, which are all the shapes a
decode step's attention takes. Key lengths are padded to powers of two (graph_bucket_keys, worker/attention_plan.py),
coarser than an eager step's, since each is a capture: the bench's contexts, 32 to 84 keys, took 23 captures with
eight lengths per power of two. The runner's eager steps (prefills, trees) pad key lengths the same way, so that a
sequence's attention reads the same keys in both kinds of step. A graph is captured the first time its key
comes and kept while MAX_GRAPHS others are newer. All graphs share one memory pool, as only one replays at a time,
and leave their logits in one buffer outside it. The block tables' device tensor may be replaced when it grows
(worker/block_tables.py): the graphs then read the old one, so they are dropped and captured again.

Numerics: a graph replays the eager forward's kernels on the padded batch, and the linears give each row the same
result whatever the batch (worker/row_blocks.py), so a row's logits are those of the eager step.
tests/worker/test_decode_graphs.py checks that on the CPU, where there is nothing to capture: there the padded
static steps run eagerly (is_capture False), each with the host-side decisions of the first step of its key, as a
replay of that step's graph would. That covers everything but the capture and the replay themselves.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import numpy as np
import torch

from worker.attention import AttentionBatch, to_group, windowed_num_keys
from worker.attention_plan import GroupPlan, StepLayout, graph_bucket_keys, plan_one_token_each
from worker.block_tables import BlockTables
from worker.kv_cache import PagedKVCache
from worker.lean_decoder import LeanDecoder
from worker.upload import upload

logger = logging.getLogger(__name__)

CAPTURE_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""The batch sizes a decode step is padded to (at most half again the rows it has)."""
MAX_GRAPHS = 256
"""Captured graphs kept (least recently used leave): about 14 batch sizes times the key lengths in use."""
_TOKEN, _POSITION, _SLOT, _TABLE_ROW, _START, _LENGTH = range(6)
"""The rows of the static buffer: per padded row, its input token, rotary position, cache slot, block-table row,
computed tokens and new tokens (1)."""


class DecodeGraphs:
    """Runs a runner's decode steps on static buffers, from CUDA graphs when is_capture (on CUDA)."""

    def __init__(self, lean: LeanDecoder, kv_cache: PagedKVCache, block_tables: BlockTables, scratch_slot: int,
                 is_capture: bool):
        self.lean, self.kv_cache, self.block_tables = lean, kv_cache, block_tables
        self.scratch_slot = scratch_slot
        self.is_capture = is_capture
        self.max_rows = CAPTURE_SIZES[-1]
        self.windows = sorted(lean.sliding_windows())
        self.device = kv_cache.keys[0].device
        self._static = torch.zeros(6, self.max_rows, dtype=torch.long, device=self.device)
        self._graphs: OrderedDict[tuple, torch.cuda.CUDAGraph] = OrderedDict()
        self._plans: OrderedDict[tuple, GroupPlan] = OrderedDict()
        """Without capture: the plan of the first step of each key, which later steps of that key run with, as they
        would replay its graph."""
        self._logits: torch.Tensor | None = None
        """[max_rows, V] float32: where every graph leaves its logits (allocated at the first capture). One buffer
        for all, outside their pool: a graph's own output would keep its pool memory from the graphs after it."""
        self._non_finite = torch.zeros(self.max_rows, dtype=torch.bool, device=self.device)
        self._tables = block_tables.device_table  # the tensor the graphs read
        self._pool = torch.cuda.graph_pool_handle() if is_capture else None
        self.num_captured = 0
        """Graphs captured so far (a key captured again after it left counts again)."""
        self.capture_seconds = 0.0
        """Time those captures took, their runs before the capture included."""

    @property
    def keys(self) -> list[tuple]:
        """The keys of the graphs kept, least recently used first (without capture, of the plans kept instead)."""
        return list(self._graphs if self.is_capture else self._plans)

    def fits(self, num_works: int, num_tokens: int, keep: np.ndarray) -> bool:
        """Whether a step of num_works works, num_tokens tokens and these kept logit rows is a decode step this
        runs: one token per work, each sampled, in work order, and no more works than the largest capture size."""
        return (num_tokens == num_works == len(keep) <= self.max_rows
                and bool((keep == np.arange(num_works)).all()))

    def run(self, layout: StepLayout, token_ids: np.ndarray, positions: np.ndarray
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's logits [B, V] (float32) and its new tokens' non-finite flags [B], for a step that fits()."""
        num_works = len(layout.rows)
        num_rows = next(size for size in CAPTURE_SIZES if size >= max(num_works, self.lean.min_tokens))
        host = np.zeros((6, num_rows), dtype=np.int64)
        host[_TOKEN, :num_works], host[_POSITION, :num_works] = token_ids, positions
        host[_SLOT, :num_works], host[_SLOT, num_works:] = layout.slots, self.scratch_slot
        host[_TABLE_ROW, :num_works], host[_START, :num_works] = layout.rows, layout.starts
        host[_LENGTH] = 1
        padded = StepLayout(host[_TABLE_ROW], host[_START], host[_LENGTH], np.arange(num_rows), host[_SLOT])
        plan = plan_one_token_each(padded, graph_bucket_keys)
        ends = padded.starts + 1
        # each window's key count as the forward's WindowSource pads it (plan.bucket)
        windowed = (windowed_num_keys(window, padded.starts, ends, plan.bucket) for window in self.windows)
        key = (num_rows, plan.num_keys, *(min(num_keys, plan.num_keys) for num_keys in windowed))
        self._static[:, :num_rows].copy_(upload([host], self.device)[0])
        if self.block_tables.device_table is not self._tables:  # grown: the graphs read the old tensor
            self._drop_graphs()
            self._tables = self.block_tables.device_table

        if not self.is_capture:
            # what a replay runs: the forward as the first step of this key ran it (its host-side decisions are in
            # the plan), on this step's buffers
            plan = self._plans.setdefault(key, plan)
            self._plans.move_to_end(key)
            while len(self._plans) > MAX_GRAPHS:
                self._plans.popitem(last=False)
            logits, non_finite = self._forward(num_rows, plan)
            return logits[:num_works].float(), non_finite[:num_works]

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            return self._forward(num_rows, plan)

        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(forward, key)
        else:
            self._graphs.move_to_end(key)
        graph.replay()
        # copies: the next replay of any graph overwrites the buffers
        return self._logits[:num_works].clone(), self._non_finite[:num_works].clone()

    def _drop_graphs(self) -> None:
        """Drop every graph, and start a new memory pool for the next ones. The allocator keeps a pool whose graphs
        are all gone as an entry that no capture may share (capture_begin asserts that the pool it joins is in
        use), so the next capture needs a new handle; empty_cache gives the old pool's memory back."""
        self._graphs.clear()
        if self.is_capture:
            self._pool = torch.cuda.graph_pool_handle()
            torch.cuda.empty_cache()

    def _forward(self, num_rows: int, plan: GroupPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The lean forward of the static buffer's first num_rows rows: logits [P, V] and non-finite flags [P].
        Everything it computes from the buffer is computed again by every replay."""
        static = self._static[:, :num_rows]
        index = torch.arange(num_rows, device=self.device)
        zeros = torch.zeros(num_rows, 1, dtype=torch.long, device=self.device)
        arrays = [static[_TABLE_ROW:], zeros, torch.ones(num_rows, 1, 1, dtype=torch.long, device=self.device),
                  zeros, index[:, None], index, index]
        group = to_group(plan, arrays, self._tables, self.kv_cache.block_size, is_cached_columns=False)
        batch = AttentionBatch(self.kv_cache, static[_SLOT], [group])
        logits = self.lean(static[_TOKEN:_TOKEN + 1], static[_POSITION:_POSITION + 1], index, batch)
        return logits[0], batch.non_finite

    def _capture(self, forward, key: tuple) -> torch.cuda.CUDAGraph:
        """Capture forward() as a graph under `key` that leaves its outputs in the shared buffers, after one run
        outside the capture (lazy initialisations, such as cuBLAS's workspace, must not happen inside it); that run
        writes the keys and values the replay will write again."""
        start = time.perf_counter()
        num_rows = key[0]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            vocab_size = forward()[0].shape[-1]
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._logits is None:
            self._logits = torch.zeros(self.max_rows, vocab_size, dtype=torch.float32, device=self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, non_finite = forward()
            self._logits[:num_rows].copy_(logits)
            self._non_finite[:num_rows].copy_(non_finite)
        self._graphs[key] = graph
        while len(self._graphs) > MAX_GRAPHS:
            self._graphs.popitem(last=False)
        self.num_captured += 1
        seconds = time.perf_counter() - start
        self.capture_seconds += seconds
        logger.debug("captured the decode step of %d rows, keys %s, in %.0f ms", num_rows, key[1:], 1000 * seconds)
        return graph
