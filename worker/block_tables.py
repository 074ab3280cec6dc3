"""Every live sequence's block table, kept between steps on the host and on the model's device.

The scheduler sends each sequence's whole block table every step, but from one step to the next
a table only grows by a block now and then. `BlockTables` gives each sequence a row of one
persistent int32 table ([rows, max_blocks_per_seq], a numpy array and its device copy) and
writes only the entries that changed, all of a step's writes in one device copy. Only the
changed entries are range-checked, so a step costs O(changed blocks), not O(every block).

The rows stay in sync with what the scheduler sent last, whether or not the step then ran: an
entry only says which block holds a position, and nothing reads it before a step that covers
the position has checked it.

A scheduler may also send only a table's new entries (ScheduledSequence.block_table_start, for a
worker with WorkerInfo.block_table_deltas): `resolve` puts them after the entries kept from the
sequence's last table, which every sequence that passed its checks leaves here.
"""

from __future__ import annotations

import numpy as np
import torch

from protos.segserve.v1.step import ScheduledSequence
from worker.upload import upload


class BlockTables:
    """Rows of block ids, one per live sequence, on the host (`host`) and on the device (`device_table`)."""

    def __init__(self, max_blocks_per_seq: int, num_blocks: int, device: torch.device, num_rows: int = 64):
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_blocks = num_blocks
        self.device = device
        self.host = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int32)  # [rows, max_blocks_per_seq]
        self.device_table = torch.zeros(num_rows, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._rows: dict[str, int] = {}
        self._known: dict[str, tuple[int, ...]] = {}
        """seq_id -> the entries its row holds (a prefix of the last table the scheduler sent)."""
        self._sent: dict[str, tuple[int, ...]] = {}
        """seq_id -> the last whole table it was staged with (what block_table_start counts into)."""
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._pending: list[tuple[int, int, tuple[int, ...]]] = []
        """(row, first column, block ids) written on the host, not yet on the device."""

    def row(self, seq_id: str) -> int:
        """The sequence's row (assigned on first use)."""
        row = self._rows.get(seq_id)
        if row is None:
            if not self._free_rows:
                self._grow()
            row = self._rows[seq_id] = self._free_rows.pop()
            self._known[seq_id] = ()
        return row

    def release(self, seq_id: str) -> None:
        """Forget a sequence; its row is reused."""
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._known.pop(seq_id)
            self._free_rows.append(row)
        self._sent.pop(seq_id, None)

    def retain(self, seq_ids) -> None:
        """Release every sequence not in seq_ids (a collection with fast membership)."""
        for seq_id in [s for s in self._rows.keys() | self._sent.keys() if s not in seq_ids]:
            self.release(seq_id)

    def resolve(self, seq: ScheduledSequence) -> str | None:
        """Make seq's block_table whole (block_table_start 0): the entries before block_table_start are those of
        the last table the sequence was staged with. Changes seq in place (its meaning stays the same), or
        returns why it cannot: the worker holds fewer entries than block_table_start."""
        start = seq.block_table_start
        if not start:
            return None
        sent = self._sent.get(seq.seq_id, ())
        if start > len(sent):
            return (f"block_table_start={start}, but the worker holds {len(sent)} entries of its block table "
                    "(send the whole table)")
        seq.block_table = sent[:start] + seq.block_table  # nothing new (most decode steps): `sent` itself, no copy
        seq.block_table_start = 0
        return None

    def stage(self, seq: ScheduledSequence, num_blocks_needed: int) -> str | None:
        """Take the first num_blocks_needed entries of seq.block_table (whole: see resolve) into its row (host
        side), and keep the whole table for the sequence's next resolve.

        Returns why they cannot be taken (a block id out of range, more blocks than a sequence
        may have), or None. Only entries that differ from the row's are checked and written.
        """
        if num_blocks_needed > self.max_blocks_per_seq:
            return f"{num_blocks_needed} blocks exceed the {self.max_blocks_per_seq} a sequence may have"
        table = seq.block_table
        known = self._known.get(seq.seq_id, ())
        first = len(known)
        if first > num_blocks_needed or table[:first] != known:
            first = _common_prefix(table, known, num_blocks_needed)
        if first == num_blocks_needed and first == len(known):
            self._sent[seq.seq_id] = table
            return None
        new = table[first:num_blocks_needed]
        if new and (min(new) < 0 or max(new) >= self.num_blocks):
            return f"block ids must be in [0, {self.num_blocks})"
        self._sent[seq.seq_id] = table
        row = self.row(seq.seq_id)
        self.host[row, first:num_blocks_needed] = new
        self._known[seq.seq_id] = table[:num_blocks_needed]
        if new:
            self._pending.append((row, first, new))
        return None

    def flush(self) -> None:
        """Copy every staged entry to the device table in one transfer."""
        if not self._pending:
            return
        rows = np.concatenate([np.full(len(new), row, dtype=np.int64) for row, _, new in self._pending])
        cols = np.concatenate([np.arange(first, first + len(new)) for _, first, new in self._pending])
        values = np.concatenate([np.asarray(new, dtype=np.int32) for _, _, new in self._pending])
        self._pending.clear()
        index, values = upload([np.stack([rows, cols]), values], self.device)  # [2, W], [W]
        self.device_table.index_put_((index[0], index[1]), values.to(torch.int32))

    def _grow(self) -> None:
        """Double the number of rows (both copies keep their contents)."""
        old = self.host.shape[0]
        self.host = np.concatenate([self.host, np.zeros_like(self.host)])
        self.device_table = torch.cat([self.device_table, torch.zeros_like(self.device_table)])
        self._free_rows = list(range(2 * old - 1, old - 1, -1)) + self._free_rows


def _common_prefix(table: tuple[int, ...], known: tuple[int, ...], limit: int) -> int:
    """How many leading entries table and known share, at most limit."""
    n = min(len(table), len(known), limit)
    for i in range(n):
        if table[i] != known[i]:
            return i
    return n
