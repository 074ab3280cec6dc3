"""The worker's persistent block tables: incremental, checked, and always equal to what was sent last."""

import numpy as np
import torch

from protos.segserve.v1.step import ScheduledSequence
from worker.attention_plan import _plan_group, bucket_keys, graph_bucket_keys, plan_groups, step_layout
from worker.block_tables import BlockTables
from worker.work import expand


def seq(seq_id: str, table: tuple[int, ...], num_computed: int = 0, num_new: int = 1) -> ScheduledSequence:
    return ScheduledSequence(seq_id, (3,) * num_new, num_computed, table, sample_indices=(num_new - 1,))


def row_of(tables: BlockTables, seq_id: str, num_blocks: int) -> list[int]:
    row = tables.row(seq_id)
    host = tables.host[row, :num_blocks].tolist()
    assert tables.device_table[row, :num_blocks].tolist() == host  # the device copy matches the host's
    return host


def test_a_growing_table_is_written_incrementally_and_matches_what_was_sent():
    tables = BlockTables(max_blocks_per_seq=8, num_blocks=100, device=torch.device("cpu"))
    assert tables.stage(seq("a", (5, 9)), 2) is None
    tables.flush()
    assert row_of(tables, "a", 2) == [5, 9]
    assert tables.stage(seq("a", (5, 9, 11)), 3) is None
    assert tables._pending == [(tables.row("a"), 2, (11,))]  # only the new block is written
    tables.flush()
    assert row_of(tables, "a", 3) == [5, 9, 11]
    assert tables.stage(seq("a", (5, 9, 11)), 3) is None
    assert tables._pending == []  # nothing changed, nothing to write


def test_a_reallocated_table_is_rewritten_from_the_first_difference():
    tables = BlockTables(max_blocks_per_seq=8, num_blocks=100, device=torch.device("cpu"))
    tables.stage(seq("a", (1, 2, 3)), 3)
    tables.flush()
    assert tables.stage(seq("a", (1, 7, 8)), 3) is None  # e.g. recomputed after a preemption
    tables.flush()
    assert row_of(tables, "a", 3) == [1, 7, 8]
    assert tables.stage(seq("a", (4,)), 1) is None  # shorter, and different
    tables.flush()
    assert row_of(tables, "a", 1) == [4]
    assert tables.stage(seq("a", (4, 6)), 2) is None
    tables.flush()
    assert row_of(tables, "a", 2) == [4, 6]


def test_out_of_range_block_ids_are_refused_and_leave_the_row_as_it_was():
    tables = BlockTables(max_blocks_per_seq=4, num_blocks=10, device=torch.device("cpu"))
    tables.stage(seq("a", (1, 2)), 2)
    tables.flush()
    assert "block ids must be in [0, 10)" in tables.stage(seq("a", (1, 2, 10)), 3)
    assert "block ids must be in [0, 10)" in tables.stage(seq("a", (1, -1, 3)), 3)
    assert "exceed" in tables.stage(seq("a", (1, 2, 3, 4, 5)), 5)
    tables.flush()
    assert row_of(tables, "a", 2) == [1, 2]
    assert tables.stage(seq("a", (1, 2, 3)), 3) is None  # the row still knows its first two blocks


def delta(seq_id: str, start: int, entries: tuple[int, ...]) -> ScheduledSequence:
    return ScheduledSequence(seq_id, (3,), 0, entries, (0,), block_table_start=start)


def test_a_delta_continues_the_last_whole_table_the_sequence_was_staged_with():
    tables = BlockTables(max_blocks_per_seq=8, num_blocks=100, device=torch.device("cpu"))
    tables.stage(seq("a", (5, 9, 11)), 2)  # the table runs a block past what the step needs: it is kept whole
    for work, whole in ((delta("a", 3, ()), (5, 9, 11)), (delta("a", 3, (12,)), (5, 9, 11, 12)),
                        (delta("a", 1, (7,)), (5, 7))):  # nothing new; one more block; changed from index 1
        assert tables.resolve(work) is None
        assert work.block_table == whole and work.block_table_start == 0
        assert tables.stage(work, len(whole)) is None
        tables.flush()
        assert row_of(tables, "a", len(whole)) == list(whole)
    whole = seq("a", (1, 2))
    assert tables.resolve(whole) is None and whole.block_table == (1, 2)  # start 0: the table as it came


def test_a_delta_past_what_the_worker_holds_is_refused():
    tables = BlockTables(max_blocks_per_seq=8, num_blocks=100, device=torch.device("cpu"))
    tables.stage(seq("a", (5, 9)), 2)
    assert "block_table_start=3, but the worker holds 2 entries" in tables.resolve(delta("a", 3, (1,)))
    assert "holds 0 entries" in tables.resolve(delta("b", 1, ()))  # never staged
    assert "block ids must be in" in tables.stage(seq("a", (5, 9, 100)), 3)  # refused: the last table stays
    assert tables.resolve(delta("a", 3, ())) is not None
    tables.release("a")
    assert "holds 0 entries" in tables.resolve(delta("a", 1, ()))


def test_rows_are_reused_after_release_and_the_tables_grow_past_their_first_size():
    tables = BlockTables(max_blocks_per_seq=2, num_blocks=1000, device=torch.device("cpu"), num_rows=4)
    for i in range(10):
        assert tables.stage(seq(f"s{i}", (i, 100 + i)), 2) is None
    tables.flush()
    assert tables.host.shape[0] >= 10
    assert all(row_of(tables, f"s{i}", 2) == [i, 100 + i] for i in range(10))
    freed = tables.row("s3")
    tables.release("s3")
    tables.stage(seq("new", (7, 8)), 2)
    tables.flush()
    assert tables.row("new") == freed
    assert row_of(tables, "new", 2) == [7, 8]  # no stale entries of s3 are taken for the new sequence's
    tables.retain({"new", "s0"})
    assert set(tables._rows) == {"new", "s0"}


def test_the_layout_gives_every_new_token_its_slot_in_its_own_block_table():
    block_size = 4
    tables = BlockTables(max_blocks_per_seq=4, num_blocks=50, device=torch.device("cpu"))
    seqs = [seq("a", (10, 20), num_computed=3, num_new=2), seq("b", (7,), num_computed=0, num_new=3)]
    for s in seqs:
        tables.stage(s, -(-s.num_tokens // block_size))
    layout = step_layout([expand(s) for s in seqs], [tables.row(s.seq_id) for s in seqs], tables.host, block_size)
    # a: positions 3, 4 -> block 10 slot 3, block 20 slot 0; b: positions 0..2 of block 7
    assert layout.slots.tolist() == [43, 80, 28, 29, 30]
    assert layout.offsets.tolist() == [0, 2] and layout.lengths.tolist() == [2, 3]
    assert np.array_equal(layout.starts, [3, 0])


def test_key_lengths_are_bucketed_with_at_most_an_eighth_wasted():
    assert bucket_keys(1) == 16 and bucket_keys(16) == 16
    sizes = [bucket_keys(n) for n in range(1, 5000)]
    assert all(size >= n and (n <= 16 or size - n <= n / 8) for n, size in zip(range(1, 5000), sizes))
    assert len(set(sizes)) < 70  # few shapes over 5,000 lengths, not one per length


def test_the_graphs_key_lengths_are_powers_of_two_from_64():
    """Each is a CUDA graph to capture (worker/decode_graphs.py), so there are far fewer than bucket_keys'."""
    sizes = [graph_bucket_keys(n) for n in range(1, 5000)]
    assert sizes[:64] == [64] * 64 and graph_bucket_keys(65) == 128 and graph_bucket_keys(4096) == 4096
    assert all(size >= n and (n <= 64 or size < 2 * n) for n, size in zip(range(1, 5000), sizes))
    assert sorted(set(sizes)) == [64, 128, 256, 512, 1024, 2048, 4096, 8192]


def test_a_step_of_one_token_each_is_planned_as_one_group_exactly_as_the_general_path_plans_it():
    block_size = 4
    tables = BlockTables(max_blocks_per_seq=8, num_blocks=50, device=torch.device("cpu"))
    seqs = [seq("a", (10, 20), num_computed=5), seq("b", (7,), num_computed=0), seq("c", (1, 2, 3, 4), num_computed=13)]
    for s in seqs:
        tables.stage(s, -(-s.num_tokens // block_size))
    works = [expand(s) for s in seqs]
    layout = step_layout(works, [tables.row(s.seq_id) for s in seqs], tables.host, block_size)
    (fast,) = plan_groups(works, layout)
    general = _plan_group(works, np.arange(len(works)), 1, layout)
    assert fast.is_whole_step
    assert (fast.num_queries, fast.num_keys) == (general.num_queries, general.num_keys) == (1, 16)
    for got, expected in zip(fast.arrays(), general.arrays()):
        assert got.dtype == expected.dtype and np.array_equal(got, expected)
