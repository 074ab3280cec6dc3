"""The host half of the paged attention's per-step metadata (worker/attention.py holds the device half).

A step's works are laid out (`StepLayout`: each work's block-table row, computed and new token counts, and the
cache slot of every new token) and grouped by query count into power-of-two buckets; each group becomes a
`GroupPlan` of a few numpy arrays that the runner uploads in one copy. Key lengths are bucketed too
(`bucket_keys`), so that consecutive decode steps reuse tensor shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from worker.work import Work


@dataclass(frozen=True)
class StepLayout:
    """Where each work of a step sits, as host arrays in work order (worker/planning.py builds it)."""

    rows: np.ndarray  # [W] int64: the work's row in the block tables (worker/block_tables.py)
    starts: np.ndarray  # [W] int64: num_computed_tokens
    lengths: np.ndarray  # [W] int64: tokens computed this step
    offsets: np.ndarray  # [W] int64: index of the work's first token in the packed row
    slots: np.ndarray  # [T] int64: cache slot of every new token (storage position start + i)


def step_layout(works: list[Work], rows: list[int], host_tables: np.ndarray, block_size: int) -> StepLayout:
    """The layout of `works`, whose block tables are rows `rows` of host_tables [rows, max_blocks]."""
    num_works = len(works)
    lengths = np.fromiter((len(w.token_ids) for w in works), np.int64, num_works)
    starts = np.fromiter((w.num_computed_tokens for w in works), np.int64, num_works)
    offsets = np.cumsum(lengths) - lengths
    rows_array = np.asarray(rows, dtype=np.int64)
    num_tokens = int(lengths.sum())
    token_work = np.repeat(np.arange(num_works), lengths)  # [T]
    storage = starts[token_work] + np.arange(num_tokens) - offsets[token_work]  # [T]
    blocks = host_tables[rows_array[token_work], storage // block_size].astype(np.int64)
    return StepLayout(rows_array, starts, lengths, offsets, blocks * block_size + storage % block_size)


def _bucket(num_queries: int) -> int:
    """Sequences whose query counts share a power-of-two bucket are padded together."""
    return 1 << (num_queries - 1).bit_length()


def _buckets(num_queries: np.ndarray) -> np.ndarray:
    """_bucket of every entry of num_queries [W] (int64, each >= 1), without a Python loop."""
    exponents = np.ceil(np.log2(num_queries.astype(np.float64))).astype(np.int64)  # exact at powers of two
    return np.left_shift(1, exponents)


def bucket_keys(num_keys: int) -> int:
    """Key lengths are padded up to one of 8 sizes per power of two (at most 1/8 wasted), at least 16,
    so that consecutive decode steps reuse shapes instead of growing one key per step."""
    if num_keys <= 16:
        return 16
    step = 1 << (num_keys.bit_length() - 4)
    return -(-num_keys // step) * step


@dataclass
class GroupPlan:
    """The host half of an AttentionGroup: which works, their sizes, and the int arrays to upload."""

    num_queries: int  # Q
    num_keys: int  # L, bucketed
    per_row: np.ndarray  # [3, R]: block-table row, num_computed_tokens, tokens this step
    depths: np.ndarray  # [R, Q]: depth of every new token (causal: its index; a tree: its node's depth)
    sees: np.ndarray  # [R, Q, Q] bool: new token q sees new token j
    is_pad: np.ndarray  # [R, Q] bool
    query_index: np.ndarray  # [R, Q]: token index in the packed row (0 for padding)
    out_rows: np.ndarray  # [M]: flat r * Q + q of real queries
    out_tokens: np.ndarray  # [M]: their token index in the packed row
    is_whole_step: bool = False  # see AttentionGroup
    bucket: Callable[[int], int] = bucket_keys  # how num_keys was padded (the sliding windows' counts follow it)

    def arrays(self) -> list[np.ndarray]:
        """What the device half needs, in the order to_group() takes it."""
        return [self.per_row, self.depths, self.sees, self.is_pad, self.query_index, self.out_rows, self.out_tokens]


def plan_groups(works: list[Work], layout: StepLayout, bucket: Callable[[int], int] = bucket_keys
                ) -> list[GroupPlan]:
    """Group the works by query count (power-of-two buckets) and lay each group out on the host, key lengths
    padded by `bucket`."""
    if len(layout.slots) == len(works):  # one token each (every sequence decoding): the common step, built directly
        return [plan_one_token_each(layout, bucket)]
    query_buckets = _buckets(layout.lengths)
    plans = [_plan_group(works, np.flatnonzero(query_buckets == q), int(q), layout, bucket)
             for q in np.unique(query_buckets)]
    if len(plans) == 1 and not plans[0].is_pad.any():  # every work, in order, with no padding (e.g. all decoding)
        plans[0].is_whole_step = True
    return plans


def graph_bucket_keys(num_keys: int) -> int:
    """Key lengths of the decode steps replayed from CUDA graphs (worker/decode_graphs.py): powers of two, at least
    64. Each key length is a graph to capture, so these are coarser than bucket_keys': a context that grows from 64
    to 4,096 keys passes 7 of them instead of about 50, at up to twice the keys read (masked)."""
    return max(64, 1 << (num_keys - 1).bit_length())


def plan_one_token_each(layout: StepLayout, bucket: Callable[[int], int] = bucket_keys) -> GroupPlan:
    """What _plan_group gives for one group of every work when each computes one token: Q = 1, no padding, the
    queries in order (query r is token r). `bucket` pads the key length."""
    num_works = len(layout.rows)
    index = np.arange(num_works)
    per_row = np.stack([layout.rows, layout.starts, layout.lengths])
    return GroupPlan(1, bucket(int(layout.starts.max()) + 1), per_row, np.zeros((num_works, 1), np.int64),
                     np.ones((num_works, 1, 1), bool), np.zeros((num_works, 1), bool), index[:, None], index, index,
                     is_whole_step=True, bucket=bucket)


def _plan_group(works: list[Work], members: np.ndarray, num_queries: int, layout: StepLayout,
                bucket: Callable[[int], int] = bucket_keys) -> GroupPlan:
    """The GroupPlan of works[members], padded to num_queries queries, key lengths by `bucket`."""
    rows, q = len(members), num_queries
    starts, lengths, offsets = layout.starts[members], layout.lengths[members], layout.offsets[members]
    depths = np.broadcast_to(np.arange(q), (rows, q)).copy()  # [R, Q]
    sees = np.broadcast_to(np.tril(np.ones((q, q), dtype=bool)), (rows, q, q)).copy()  # [R, Q, Q]
    if q > 1:  # a tree has at least two nodes
        for r, i in enumerate(members):
            work = works[i]
            if work.is_tree:
                n = len(work.token_ids)
                depths[r, :n] = work.node_depths
                sees[r, :n, :n] = tree_sees(work.node_parents)
    is_pad = np.arange(q)[None, :] >= lengths[:, None]  # [R, Q]
    query_index = np.where(is_pad, 0, offsets[:, None] + np.arange(q)[None, :])  # [R, Q]
    out_rows = np.flatnonzero(~is_pad)  # [M]
    return GroupPlan(q, bucket(int((starts + lengths).max())), np.stack([layout.rows[members], starts, lengths]),
                     depths, sees, is_pad, query_index, out_rows, query_index.reshape(-1)[out_rows], bucket=bucket)


def tree_sees(parents: tuple[int, ...]) -> np.ndarray:
    """[n, n] bool: node i sees node j when j is i or one of its ancestors (parents come first)."""
    n = len(parents)
    sees = np.eye(n, dtype=bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            sees[node] |= sees[parent]
    return sees
