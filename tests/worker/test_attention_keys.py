"""The key slots of an attention group and of a sliding-window range (worker/attention.py): each key's block-table
entry times the block size plus its offset in the block, whichever way they are computed."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.attention import WINDOW_KEY_GRID, _key_columns, _key_slots, _window_slots


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), block_size=st.sampled_from([1, 4, 16, 32]), num_keys=st.integers(1, 300),
       width=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_key_slots_are_each_keys_block_entry_and_offset(rows, block_size, num_keys, width, seed):
    """Keys within the table's columns and padding keys past them (which read the last column) alike."""
    generator = torch.Generator().manual_seed(seed)
    num_cols = min(-(-num_keys // block_size), width)
    tables = torch.randint(0, 1000, (rows, num_cols), generator=generator)
    _, block_col, key_offset = _key_columns.__wrapped__(num_keys, block_size, num_cols, torch.device("cpu"))
    expected = [[int(tables[r, min(k // block_size, num_cols - 1)]) * block_size + k % block_size
                 for k in range(num_keys)] for r in range(rows)]
    slots = _key_slots(tables, block_size, num_keys, block_col, key_offset)
    assert slots.tolist() == expected
    assert slots.is_contiguous()


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), block_size=st.sampled_from([1, 4, 5, 16, 32]), num_keys=st.integers(1, 300),
       width=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_window_slots_are_each_keys_block_entry_and_offset(rows, block_size, num_keys, width, seed):
    """A sliding-window range from each row's grid line on, its keys past the table's columns reading the last one;
    block sizes that divide the grid (whole blocks gathered) and that do not (a gather per key)."""
    generator = torch.Generator().manual_seed(seed)
    tables = torch.randint(0, 1000, (rows, width), generator=generator)
    first = torch.randint(0, width * block_size // WINDOW_KEY_GRID + 1, (rows, 1), generator=generator)
    first *= WINDOW_KEY_GRID
    key = first + torch.arange(num_keys)
    expected = [[int(tables[r, min(k // block_size, width - 1)]) * block_size + k % block_size
                 for k in key[r].tolist()] for r in range(rows)]
    slots = _window_slots(tables, first, key, block_size)
    assert slots.tolist() == expected
