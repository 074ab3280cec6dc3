"""Allocation of the worker's KV-cache blocks to sequences, with automatic prefix caching.

The worker owns the memory (num_kv_blocks blocks of block_size token slots);
this class owns which block belongs to which sequences. Blocks are
reference-counted: a sequence's block table may start with blocks that other
sequences (other requests, earlier chat turns, the other n > 1 choices) hold too.

Prefix caching (as vLLM v1): a FULL block whose tokens are all computed gets a
hash, sha256(parent block's hash, the block's token ids), so one hash names one
whole prefix. A block whose refcount drops to 0 keeps its hash and waits in an
LRU free queue; a sequence being admitted takes the longest chain of cached
blocks of its tokens. Allocation takes a free block without a hash first, then
the least recently freed cached one, whose hash it evicts: cached KV is dropped
only when memory is needed.

Invariants: a block is free (refcount 0, in exactly one free queue) or used; a
hashed block holds its final KV (positions below the num_computed_tokens of the
sequence that computed it) and is never written again, since the worker writes
only at positions >= a sequence's num_computed_tokens, which lie in that
sequence's own unhashed blocks (its not-yet-full tail and the blocks after it).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence as Tokens

from scheduler.sequence import Sequence


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold num_tokens token slots."""
    return -(-num_tokens // block_size)


def hash_block(parent: bytes, token_ids: Tokens[int]) -> bytes:
    """The hash of a full block: its parent's hash (b"" for the first block) chained with its token ids.

    A cryptographic hash, so that no request can make its blocks collide with another's."""
    digest = hashlib.sha256(parent)
    digest.update(array("I", token_ids).tobytes())
    return digest.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, is_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self.is_prefix_caching = is_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        """hash -> the block holding that prefix's KV (used or free)."""
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        """Free blocks that keep a hash, least recently freed first (the next one evicted)."""
        self.num_prefix_cache_queries = 0
        """Tokens of sequences admitted with a cache lookup (every admission that may read the cache)."""
        self.num_prefix_cache_hits = 0
        """Of those, tokens taken from cached blocks instead of being computed."""

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with refcount > 0."""
        return self.num_total_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a hash, used or free."""
        return len(self._cached)

    @property
    def num_total_tokens(self) -> int:
        """Token slots in the whole cache: no sequence can ever compute more."""
        return self.num_total_blocks * self.block_size

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._hashes[block_id] is not None

    def num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks seq lacks to hold its computed tokens plus num_new_tokens more."""
        needed = num_blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to cover num_computed_tokens + num_new_tokens positions."""
        missing = self.num_missing_blocks(seq, num_new_tokens)
        if not missing:
            return
        if missing > self.num_free_blocks:
            raise RuntimeError(f"{seq.request_id}: {missing} KV blocks needed, {self.num_free_blocks} free")
        seq.block_table.extend(self._take_free_block() for _ in range(missing))

    def num_free_slots(self, seq: Sequence) -> int:
        """Token slots seq could still fill beyond num_computed_tokens: its own spare slots plus every free block."""
        return (len(seq.block_table) + self.num_free_blocks) * self.block_size - seq.num_computed_tokens

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The blocks of the longest cached prefix of seq's tokens that seq may take (none when it may not).

        Only full blocks, and never the block of seq's last token: its logits are needed, so at
        least that token is computed. A sequence asking for prompt log-probabilities takes none
        (it needs every prompt position's logits), though its own blocks still fill the cache.
        """
        if not self._may_read_cache(seq):
            return []
        num_blocks = (seq.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in self._block_hashes(seq, num_blocks):
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def can_admit(self, prefix: list[int], num_new_tokens: int) -> bool:
        """Whether a sequence taking `prefix` (from cached_prefix) can get blocks for num_new_tokens more."""
        num_revived = sum(1 for block_id in prefix if self._ref_counts[block_id] == 0)
        num_new_blocks = num_blocks_for(len(prefix) * self.block_size + num_new_tokens, self.block_size) - len(prefix)
        return num_revived + num_new_blocks <= self.num_free_blocks

    def admit(self, seq: Sequence, prefix: list[int], num_new_tokens: int) -> None:
        """Give a sequence without blocks the cached prefix (its computed tokens start past it) and blocks
        for num_new_tokens more; counts the lookup in the prefix-cache stats."""
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id}: admitted while holding KV blocks")
        if self._may_read_cache(seq):
            self.num_prefix_cache_queries += seq.num_tokens
            self.num_prefix_cache_hits += len(prefix) * self.block_size
        for block_id in prefix:  # before allocating, so that allocation cannot evict them
            self._ref(block_id)
        seq.block_table = list(prefix)
        seq.num_blocks_sent = 0
        seq.num_hashed_blocks = len(prefix)
        seq.num_computed_tokens = len(prefix) * self.block_size
        self.allocate(seq, num_new_tokens)

    def commit(self, seq: Sequence) -> None:
        """Hash seq's blocks that have become full of computed tokens, so that others can take them.

        A block whose prefix is cached already (computed by another sequence in the same step,
        e.g. the n > 1 choices of one prompt) is swapped for the cached copy, and its own is freed.
        """
        if not self.is_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        if num_full <= seq.num_hashed_blocks:  # most steps: no block became full
            return
        hashes = self._block_hashes(seq, num_full)
        for index in range(seq.num_hashed_blocks, num_full):
            block_hash, block_id = hashes[index], seq.block_table[index]
            cached_id = self._cached.get(block_hash)
            if cached_id is None:
                self._cached[block_hash] = block_id
                self._hashes[block_id] = block_hash
            elif cached_id != block_id:
                self._ref(cached_id)
                seq.block_table[index] = cached_id
                seq.num_blocks_sent = min(seq.num_blocks_sent, index)
                self._unref(block_id)
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past seq's computed tokens (left over by rejected draft nodes)."""
        keep = num_blocks_for(seq.num_computed_tokens, self.block_size)
        for block_id in reversed(seq.block_table[keep:]):
            self._unref(block_id)
        del seq.block_table[keep:]
        seq.num_blocks_sent = min(seq.num_blocks_sent, keep)
        seq.num_hashed_blocks = min(seq.num_hashed_blocks, keep)

    def free(self, seq: Sequence) -> None:
        """Drop seq's hold on all of its blocks. Tail first, so that a shared prefix is evicted last."""
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table = []
        seq.num_blocks_sent = 0
        seq.num_hashed_blocks = 0

    def uncache(self, seq: Sequence) -> None:
        """Take seq's blocks out of the prefix cache, for a sequence whose step failed: the KV it computed may be
        wrong (a forward that overflowed, whose non-finite values the worker has set to 0), so no later prefix
        may take it. Whoever holds a block still reads it; once free it is reused as an uncached block."""
        for block_id in seq.block_table:
            if self._hashes[block_id] is not None:
                self._unhash(block_id)
        seq.num_hashed_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every hash (the worker's KV may be gone, e.g. it restarted); refcounts are untouched."""
        for block_id in self._cached.values():
            self._hashes[block_id] = None
        self._cached.clear()
        self._free_uncached.extend(self._free_cached)
        self._free_cached.clear()

    def _may_read_cache(self, seq: Sequence) -> bool:
        return self.is_prefix_caching and seq.sampling.num_prompt_logprobs is None

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """seq.block_hashes extended to its first num_blocks full blocks (hashes of token content)."""
        hashes, size = seq.block_hashes, self.block_size
        for index in range(len(hashes), min(num_blocks, seq.num_tokens // size)):
            hashes.append(hash_block(hashes[-1] if hashes else b"", seq.token_ids[index * size:(index + 1) * size]))
        return hashes[:num_blocks]

    def _take_free_block(self) -> int:
        if self._free_uncached:
            block_id = self._free_uncached.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            self._unhash(block_id)
        self._ref_counts[block_id] = 1
        return block_id

    def _unhash(self, block_id: int) -> None:
        """Forget a hashed block's hash: no prefix lookup finds it any more."""
        del self._cached[self._hashes[block_id]]
        self._hashes[block_id] = None

    def _ref(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:  # a cached free block comes back into use
            del self._free_cached[block_id]
        self._ref_counts[block_id] += 1

    def _unref(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] > 0:
            return
        if self._hashes[block_id] is None:
            self._free_uncached.append(block_id)
        else:
            self._free_cached[block_id] = None  # most recently freed: evicted last
