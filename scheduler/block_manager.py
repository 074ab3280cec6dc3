"""Allocation of the worker's KV-cache blocks to sequences.

The worker owns the memory (num_kv_blocks blocks of block_size token slots);
this class owns which block belongs to which sequence. A sequence's block
table grows as its computed tokens grow and is freed in one go when it
finishes, is aborted or is preempted.
"""

from __future__ import annotations

from collections import deque

from scheduler.sequence import Sequence


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens token slots."""
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - len(self._free_block_ids)

    @property
    def num_total_tokens(self) -> int:
        """Token slots in the whole cache: no sequence can ever compute more."""
        return self.num_total_blocks * self.block_size

    def num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks seq lacks to hold its computed tokens plus num_new_tokens more."""
        needed = num_blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_new_tokens) <= len(self._free_block_ids)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to cover num_computed_tokens + num_new_tokens positions."""
        missing = self.num_missing_blocks(seq, num_new_tokens)
        if missing > len(self._free_block_ids):
            raise RuntimeError(f"{seq.request_id}: {missing} KV blocks needed, {self.num_free_blocks} free")
        seq.block_table.extend(self._free_block_ids.popleft() for _ in range(missing))

    def num_free_slots(self, seq: Sequence) -> int:
        """Token slots seq could still fill beyond num_computed_tokens: its own spare slots plus every free block."""
        return (len(seq.block_table) + len(self._free_block_ids)) * self.block_size - seq.num_computed_tokens

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past seq's computed tokens (left over by rejected draft nodes)."""
        keep = num_blocks_for(seq.num_computed_tokens, self.block_size)
        self._free_block_ids.extend(seq.block_table[keep:])
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Return all of seq's blocks to the pool (their contents are simply overwritten later)."""
        self._free_block_ids.extend(seq.block_table)
        seq.block_table = []
