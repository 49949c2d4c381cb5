"""The BlockManager: sequences' block tables over a device pool and a host (swap) pool.

Each sequence owns a block table (logical block i -> physical block id). Forked sequences share
blocks; a shared block is copied before it is written to (copy-on-write). With prefix caching a
full block is known by a hash chained over its parent's hash and its token ids, so a new prompt
starts from the longest prefix already in the cache. Swapping moves a group's blocks to the host
pool and back; the CacheEngine does the copies the returned (src, dst) pairs describe.
"""
from __future__ import annotations

from pagedlm.core.block_pool import BlockPool
from pagedlm.sequence import Sequence
from pagedlm.utils import cdiv


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], extra_key=None) -> int:
    # Python's tuple hash: 64 bits, deterministic for ints. The chain makes a block's hash
    # stand for its whole prefix.
    return hash((parent_hash, token_ids, extra_key))


class BlockManager:

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 num_cpu_blocks: int = 0, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Admissions keep a few blocks back so running sequences can still grow next step.
        self.watermark_blocks = int(watermark * num_blocks)
        self.gpu = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.cpu = BlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found

    # -- state ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_free_blocks

    @property
    def ref_counts(self) -> list[int]:
        return self.gpu.ref_counts

    def usage(self) -> float:
        return 1.0 - self.gpu.num_free_blocks / self.num_blocks

    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # -- prefix caching -----------------------------------------------------------------------
    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Hashes of the full blocks among seq's first num_tokens tokens."""
        bs = self.block_size
        hashes = seq.block_hashes
        while (len(hashes) + 1) * bs <= num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]),
                                     seq.cache_key))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding seq's longest cached prefix. At least one token is left to compute,
        since the step needs its logits."""
        if not self.enable_prefix_caching:
            return []
        self._extend_hashes(seq, len(seq.token_ids) - 1)
        blocks = []
        for h in seq.block_hashes:
            block_id = self.gpu.lookup(h)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def num_revived(self, blocks: list[int]) -> int:
        """How many of these cached blocks are free now (reusing them takes them off the pool)."""
        return sum(1 for b in blocks if self.gpu.is_free(b))

    def use_cached_prefix(self, seq: Sequence, blocks: list[int]) -> None:
        """Start a fresh sequence from its cached prefix blocks."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return
        self.prefix_queries += len(seq.token_ids)
        self.prefix_hits += len(blocks) * self.block_size
        for b in blocks:
            self.gpu.share(b)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size
        seq.num_cached_blocks = len(blocks)

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full blocks among seq's first num_tokens tokens (computed this step)."""
        if not self.enable_prefix_caching:
            return
        self._extend_hashes(seq, num_tokens)
        full = min(num_tokens // self.block_size, len(seq.block_table))
        for i in range(seq.num_cached_blocks, full):
            self.gpu.register(seq.block_table[i], seq.block_hashes[i])
        seq.num_cached_blocks = max(seq.num_cached_blocks, full)

    # -- allocation ---------------------------------------------------------------------------
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
        if idx < len(seq.block_table) and self.gpu.ref_counts[seq.block_table[idx]] > 1:
            return idx
        return None

    def can_allocate(self, num_blocks: int, admission: bool = False) -> bool:
        reserve = self.watermark_blocks if admission else 0
        return self.gpu.num_free_blocks - num_blocks >= reserve

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Give seq room for its next num_new_tokens; returns (src, dst) blocks to copy."""
        copies = []
        idx = self._shared_write_block(seq)
        if idx is not None:
            src = seq.block_table[idx]
            dst = self.gpu.take()
            self.gpu.release(src)
            seq.block_table[idx] = dst
            copies.append((src, dst))
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        while len(seq.block_table) < total:
            seq.block_table.append(self.gpu.take())
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        for block_id in child.block_table:
            self.gpu.share(block_id)

    def free(self, seq: Sequence) -> None:
        # Tail blocks first: they are the least likely to be shared, so evicted first.
        for block_id in reversed(seq.block_table):
            self.gpu.release(block_id)
        seq.block_table = []
        seq.num_cached_blocks = 0

    # -- swapping -----------------------------------------------------------------------------
    @staticmethod
    def _unique_blocks(seqs: list[Sequence]) -> set[int]:
        return {b for s in seqs for b in s.block_table}

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return len(self._unique_blocks(seqs)) <= self.cpu.num_free_blocks

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move seqs' blocks to the host pool; returns (device, host) pairs to copy."""
        return self._move(seqs, self.gpu, self.cpu)

    def free_host(self, seq: Sequence) -> None:
        """Drop a swapped-out sequence's host blocks (it was aborted while swapped)."""
        for block_id in seq.block_table:
            self.cpu.release(block_id)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def num_swap_in_blocks(self, seqs: list[Sequence]) -> int:
        return len(self._unique_blocks(seqs))

    def swap_in(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """Move seqs' blocks back to the device; returns (host, device) pairs to copy."""
        pairs = self._move(seqs, self.cpu, self.gpu)
        for s in seqs:
            s.num_cached_blocks = 0  # new device blocks: register them again
            self.cache_full_blocks(s, s.num_computed_tokens)
        return pairs

    @staticmethod
    def _move(seqs: list[Sequence], src: BlockPool, dst: BlockPool) -> list[tuple[int, int]]:
        # Blocks shared between the group's sequences move once and stay shared.
        mapping: dict[int, int] = {}
        for s in seqs:
            for i, block_id in enumerate(s.block_table):
                if block_id in mapping:
                    dst.share(mapping[block_id])
                else:
                    mapping[block_id] = dst.take()
                src.release(block_id)
                s.block_table[i] = mapping[block_id]
        return list(mapping.items())
