"""BlockPool: one device's KV blocks, their reference counts, and the prefix cache.

A block whose reference count drops to zero is free. If it holds a full block of computed tokens
it keeps its hash and stays findable (prefix caching) until a new allocation needs the space:
free blocks without a hash are handed out first (most recently freed first, so the memory that is
touched stays warm), then cached ones are evicted least recently freed first. Every operation is
O(1) per block: the evictable blocks sit in an insertion-ordered dict. A lookup also compares
the block's content (parent hash, token ids, extra keys): a hash collision can only miss.
"""
from __future__ import annotations

from collections import OrderedDict


class BlockPool:

    def __init__(self, num_blocks: int, enable_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.free_plain: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.block_hash: list[object | None] = [None] * num_blocks
        self.content: list[tuple | None] = [None] * num_blocks  # (parent, tokens, extra keys)
        self.cached: dict[object, int] = {}  # block hash -> block id
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    def take(self) -> int:
        if self.free_plain:
            block_id = self.free_plain.pop()
        else:
            block_id, _ = self.free_cached.popitem(last=False)
            del self.cached[self.block_hash[block_id]]
            self.block_hash[block_id] = self.content[block_id] = None
            self.num_evictions += 1
        self.ref_counts[block_id] = 1
        return block_id

    def share(self, block_id: int) -> None:
        """One more reference; revives a free cached block."""
        if self.ref_counts[block_id] == 0:
            del self.free_cached[block_id]
        self.ref_counts[block_id] += 1

    def release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if self.block_hash[block_id] is None:
                self.free_plain.append(block_id)
            else:
                self.free_cached[block_id] = None

    def lookup(self, block_hash: object, content: tuple) -> int | None:
        block_id = self.cached.get(block_hash)
        return block_id if block_id is not None and self.content[block_id] == content else None

    def register(self, block_id: int, block_hash: object, content: tuple) -> bool:
        """Make a full, computed block findable by its hash (first copy wins); whether it
        was made so."""
        if self.enable_caching and block_hash not in self.cached:
            self.cached[block_hash] = block_id
            self.block_hash[block_id], self.content[block_id] = block_hash, content
            return True
        return False

    def forget(self, block_id: int) -> None:
        """Make a registered block unfindable again (its K/V was never written)."""
        block_hash = self.block_hash[block_id]
        if block_hash is None:
            return
        del self.cached[block_hash]
        self.block_hash[block_id] = self.content[block_id] = None
        if self.ref_counts[block_id] == 0:
            del self.free_cached[block_id]
            self.free_plain.append(block_id)

    def is_free(self, block_id: int) -> bool:
        return self.ref_counts[block_id] == 0
