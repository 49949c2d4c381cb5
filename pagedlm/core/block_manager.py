"""The BlockManager: a pool of fixed-size KV-cache blocks with reference counts.

Each sequence owns a block table (logical block i -> physical block id). Forked sequences share
blocks; a shared block is copied before it is written to (copy-on-write).
"""
from __future__ import annotations

from pagedlm.sequence import Sequence
from pagedlm.utils import cdiv


class BlockManager:

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Admissions keep a few blocks back so running sequences can still grow next step.
        self.watermark_blocks = int(watermark * num_blocks)
        self.ref_counts = [0] * num_blocks
        # A stack: recently freed blocks are reused first, so the cache memory actually touched
        # stays close to peak usage (fresh pages are slow to fault in).
        self.free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def _take(self) -> int:
        block_id = self.free_block_ids.pop()
        self.ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_block_ids.append(block_id)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to take for the next num_new_tokens, counting a copy-on-write."""
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        needed = max(0, total - len(seq.block_table))
        if self._shared_write_block(seq) is not None:
            needed += 1
        return needed

    def _shared_write_block(self, seq: Sequence) -> int | None:
        """Index in the block table of a shared block the next token would be written into."""
        idx = seq.num_computed_tokens // self.block_size
        if idx < len(seq.block_table) and self.ref_counts[seq.block_table[idx]] > 1:
            return idx
        return None

    def can_allocate(self, num_blocks: int, admission: bool = False) -> bool:
        reserve = self.watermark_blocks if admission else 0
        return self.num_free_blocks - num_blocks >= reserve

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Give seq room for its next num_new_tokens; returns (src, dst) blocks to copy."""
        copies = []
        idx = self._shared_write_block(seq)
        if idx is not None:
            src = seq.block_table[idx]
            dst = self._take()
            self._release(src)
            seq.block_table[idx] = dst
            copies.append((src, dst))
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        while len(seq.block_table) < total:
            seq.block_table.append(self._take())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_table = list(parent.block_table)
        for block_id in child.block_table:
            self.ref_counts[block_id] += 1

    def free(self, seq: Sequence) -> None:
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
