"""The BlockManager: sequences' block tables over a device pool and a host (swap) pool.

Each sequence owns a block table (logical block i -> physical block id). Forked sequences share
blocks; a shared block is copied before it is written to (copy-on-write). With prefix caching a
full block is known by a hash chained over its parent's hash, its token ids and extra keys
(core/block_hash.py), so a new prompt starts from the longest prefix already in the cache.
Swapping moves a group's blocks to the host pool and back; the CacheEngine does the copies the
returned (src, dst) pairs describe.
"""
from __future__ import annotations

from typing import Callable

from pagedlm.core.block_hash import ExtraKeys, get_block_hash_fn
from pagedlm.core.block_pool import BlockPool
from pagedlm.sequence import Sequence
from pagedlm.utils import cdiv

# (pool name: "device" or "cpu", number of blocks, enable prefix caching) -> the pool. An
# observer may hand one in that counts the pools' operations (metrics/tracer.py).
PoolFactory = Callable[[str, int, bool], BlockPool]


def plain_pool(name: str, num_blocks: int, enable_caching: bool = False) -> BlockPool:
    return BlockPool(num_blocks, enable_caching)


class BlockManager:
    """The one place that knows how many blocks a step needs: the scheduler asks it
    (`can_allocate_slots`, `allocate_slots`, `swap_in`, `can_ever_fit`) and does no block
    arithmetic of its own."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 num_cpu_blocks: int = 0, enable_prefix_caching: bool = False,
                 hash_algo: str = "sha256", pool_factory: PoolFactory = plain_pool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Admissions keep a few blocks back so running sequences can still grow next step.
        self.watermark_blocks = int(watermark * num_blocks)
        # The device pool is the KV cache the model reads (host RAM on a CPU engine); the cpu
        # pool holds swapped-out blocks.
        self.device = pool_factory("device", num_blocks, enable_prefix_caching)
        self.cpu = pool_factory("cpu", num_cpu_blocks, False)
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_block = get_block_hash_fn(hash_algo)
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found
        # The blocks registered in the prefix cache since the step's schedule began: they are
        # registered before the step computes them (see allocate_slots), so a step that fails
        # must take them back.
        self._step_registrations: list[int] = []

    # -- state ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.device.num_free_blocks

    @property
    def ref_counts(self) -> list[int]:
        return self.device.ref_counts

    def usage(self) -> float:
        return 1.0 - self.device.num_free_blocks / self.num_blocks

    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # -- what fits --------------------------------------------------------------------------
    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    @property
    def max_admissible_blocks(self) -> int:
        """The most blocks a request may need at admission: the cache less the watermark."""
        return self.num_blocks - self.watermark_blocks

    def _shared_prompt_blocks(self, seq_lens: list[int], shared_tokens: int) -> int:
        shared = shared_tokens // self.block_size
        return sum(map(self.num_blocks_for, seq_lens)) - shared * (len(seq_lens) - 1)

    def can_ever_fit(self, seq_lens: list[int], shared_tokens: int = 0) -> bool:
        """Whether sequences of these lengths, from scratch, could ever be admitted: the rule
        add_request checks prompts against, so a prompt it accepts is never dropped unrun.
        `shared_tokens`: a multiple of the block size the sequences share (their prompt)."""
        return self._shared_prompt_blocks(seq_lens, shared_tokens) <= self.max_admissible_blocks

    def shared_prompt_tokens(self, seqs: list[Sequence]) -> int:
        """The tokens whose blocks a group's sequences share: those of their prompt's full
        blocks (forked from one prompt, each copies the partial one on its first write); 0
        for one sequence."""
        if len(seqs) < 2:
            return 0
        n = seqs[0].num_prompt_tokens
        return n - n % self.block_size

    def can_ever_fit_group(self, seqs: list[Sequence], seq_lens: list[int]) -> bool:
        """can_ever_fit for a group's sequences at these lengths, sharing their prompt: counted
        n times, the speculating decode of a long prompt's group gave up its drafts where it
        would have been preempted and come back with them (--deterministic's promise)."""
        return self.can_ever_fit(seq_lens, self.shared_prompt_tokens(seqs))

    def can_share_prompt(self, seq_lens: list[int], shared_tokens: int) -> bool:
        """Whether sequences without blocks sharing their first `shared_tokens` tokens' blocks
        (a multiple of the block size) fit in the pool now, less the watermark (an admission).
        Cached blocks they might start from count as new: it errs towards waiting."""
        return self._room_for(self._shared_prompt_blocks(seq_lens, shared_tokens), True)

    # -- prefix caching -----------------------------------------------------------------------
    @staticmethod
    def _extra_keys(seq: Sequence, block_index: int) -> ExtraKeys:
        # Salt and adapter only need to enter the first block: the chain carries them on.
        if block_index:
            return ()
        keys: ExtraKeys = (seq.cache_salt,) if seq.cache_salt is not None else ()
        return keys + seq.lora_key if seq.lora_key is not None else keys

    def _block_content(self, seq: Sequence, i: int) -> tuple:
        bs = self.block_size
        parent = seq.block_hashes[i - 1] if i else None
        return parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]), self._extra_keys(seq, i)

    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        """Hashes of the full blocks among seq's first num_tokens tokens."""
        hashes = seq.block_hashes
        while (len(hashes) + 1) * self.block_size <= num_tokens:
            hashes.append(self.hash_block(*self._block_content(seq, len(hashes))))

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding seq's longest cached prefix. At least one token is left to compute,
        since the step needs its logits."""
        if not self.enable_prefix_caching:
            return []
        self._extend_hashes(seq, len(seq.token_ids) - 1)
        blocks = []
        for i, h in enumerate(seq.block_hashes):
            block_id = self.device.lookup(h, self._block_content(seq, i))
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def _use_cached_prefix(self, seq: Sequence, blocks: list[int]) -> None:
        """Start a fresh sequence from its cached prefix blocks."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return
        self.prefix_queries += len(seq.token_ids)
        self.prefix_hits += len(blocks) * self.block_size
        for b in blocks:
            self.device.share(b)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size
        seq.num_cached_blocks = len(blocks)

    def _cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full blocks among seq's first num_tokens tokens (computed this step)."""
        # Nothing newly full (most steps of a decode): every block hash up to here exists, since
        # num_cached_blocks <= len(block_hashes) always.
        if not self.enable_prefix_caching or num_tokens // self.block_size <= seq.num_cached_blocks:
            return
        self._extend_hashes(seq, num_tokens)
        full = min(num_tokens // self.block_size, len(seq.block_table))
        for i in range(seq.num_cached_blocks, full):
            if self.device.register(seq.block_table[i], seq.block_hashes[i],
                                    self._block_content(seq, i)):
                self._step_registrations.append(seq.block_table[i])
        seq.num_cached_blocks = max(seq.num_cached_blocks, full)

    def begin_step(self) -> None:
        self._step_registrations.clear()

    def forget_step_registrations(self) -> None:
        """The step's registered blocks unfindable again: its K/V may never have been written
        (a Ctrl-C in the forward, a failed worker)."""
        for block_id in self._step_registrations:
            self.device.forget(block_id)
        self._step_registrations.clear()

    # -- allocation ---------------------------------------------------------------------------
    def _new_blocks(self, seq: Sequence, num_new_tokens: int, pool: BlockPool,
                    num_prefix_blocks: int = 0) -> int:
        """Blocks seq takes for its next num_new_tokens (a copy-on-write included); a fresh
        sequence starting from num_prefix_blocks cached blocks counts from there."""
        computed = max(seq.num_computed_tokens, num_prefix_blocks * self.block_size)
        have = max(len(seq.block_table), num_prefix_blocks)
        needed = max(0, cdiv(computed + num_new_tokens, self.block_size) - have)
        if self._shared_write_block(seq, pool) is not None:
            needed += 1
        return needed

    def _shared_write_block(self, seq: Sequence, pool: BlockPool) -> int | None:
        """Index in the block table of a shared block the next token would be written into."""
        idx = seq.num_computed_tokens // self.block_size
        if idx < len(seq.block_table) and pool.ref_counts[seq.block_table[idx]] > 1:
            return idx
        return None

    def _num_blocks_needed(self, seqs: list[Sequence], num_new_tokens: list[int],
                           prefixes: dict[Sequence, list[int]]) -> int:
        revived = {b for p in prefixes.values() for b in p if self.device.is_free(b)}
        return len(revived) + sum(
            self._new_blocks(s, n, self.device, len(prefixes.get(s, ())))
            for s, n in zip(seqs, num_new_tokens))

    def _room_for(self, num_blocks: int, admission: bool) -> bool:
        reserve = self.watermark_blocks if admission else 0
        return self.device.num_free_blocks - num_blocks >= reserve

    def can_allocate_slots(self, seqs: list[Sequence], num_new_tokens: list[int],
                           admission: bool = False,
                           prefixes: dict[Sequence, list[int]] | None = None) -> bool:
        return self._room_for(self._num_blocks_needed(seqs, num_new_tokens, prefixes or {}),
                              admission)

    def allocate_slots(self, seqs: list[Sequence], num_new_tokens: list[int],
                       admission: bool = False,
                       prefixes: dict[Sequence, list[int]] | None = None
                       ) -> list[tuple[int, int]] | None:
        """Room for each seq's next num_new_tokens, all or nothing: the (src, dst) block copies
        to make (copy-on-write), or None if the pool cannot cover them (less the watermark for
        admissions). `prefixes`: fresh sequences' cached prefix blocks, taken first so that no
        allocation evicts one of them. The full blocks computed this step are registered now,
        so a prompt admitted later in the same step already shares them (every layer writes the
        step's K/V before it reads any)."""
        if not prefixes and not admission and len(seqs) == 1:
            # A running sequence whose own blocks have room for its tokens (a decode, mostly):
            # nothing to take or copy, and no room to check (the rule below counts 0 blocks).
            seq, n = seqs[0], num_new_tokens[0]
            end = seq.num_computed_tokens + n
            if (end <= len(seq.block_table) * self.block_size
                    and self._shared_write_block(seq, self.device) is None):
                self._cache_full_blocks(seq, min(end, len(seq.token_ids)))
                return []
        prefixes = prefixes or {}
        if not self._room_for(self._num_blocks_needed(seqs, num_new_tokens, prefixes),
                              admission):
            return None
        for s, blocks in prefixes.items():
            self._use_cached_prefix(s, blocks)
        copies = []
        for s, n in zip(seqs, num_new_tokens):
            copies += self._allocate(s, n)
            # Committed tokens only: speculative lookahead slots (past the sequence's tokens)
            # hold drafts that may be rejected, so no block is hashed over them.
            self._cache_full_blocks(s, min(s.num_computed_tokens + n, len(s.token_ids)))
        return copies

    def _allocate(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        copies = []
        idx = self._shared_write_block(seq, self.device)
        if idx is not None:
            src = seq.block_table[idx]
            dst = self.device.take()
            self.device.release(src)
            seq.block_table[idx] = dst
            copies.append((src, dst))
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        while len(seq.block_table) < total:
            seq.block_table.append(self.device.take())
        return copies

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past what seq's tokens need: the lookahead slots of drafts
        that were rejected (or never proposed). Never registered, so they free plainly."""
        keep = self.num_blocks_for(len(seq.token_ids))
        while len(seq.block_table) > keep:
            self.device.release(seq.block_table.pop())

    def share_prompt(self, leader: Sequence, seq: Sequence, num_blocks: int) -> None:
        """seq, a sequence of leader's group without blocks of its own, takes leader's first
        num_blocks blocks: full blocks of the prompt they share, computed already."""
        assert not seq.block_table and not seq.num_computed_tokens
        assert leader.num_computed_tokens >= num_blocks * self.block_size
        seq.block_table = leader.block_table[:num_blocks]
        for block_id in seq.block_table:
            self.device.share(block_id)
        seq.num_computed_tokens = num_blocks * self.block_size
        # The same tokens hash alike: the leader's registered blocks are seq's too.
        n = min(num_blocks, leader.num_cached_blocks)
        seq.block_hashes[:n] = leader.block_hashes[:n]
        seq.num_cached_blocks = n

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        for block_id in child.block_table:
            self.device.share(block_id)

    def free(self, seq: Sequence) -> None:
        # Tail blocks first: they are the least likely to be shared, so evicted first.
        for block_id in reversed(seq.block_table):
            self.device.release(block_id)
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
        return self._move(seqs, self.device, self.cpu)

    def free_host(self, seq: Sequence) -> None:
        """Drop a swapped-out sequence's host blocks (it was aborted while swapped)."""
        for block_id in seq.block_table:
            self.cpu.release(block_id)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def swap_in_blocks(self, seqs: list[Sequence], scheduled: list[Sequence],
                       num_new_tokens: list[int]) -> int:
        """The device blocks swap_in would take: above max_admissible_blocks, it never can."""
        return len(self._unique_blocks(seqs)) + sum(
            self._new_blocks(s, n, self.cpu) for s, n in zip(scheduled, num_new_tokens))

    def swap_in(self, seqs: list[Sequence], scheduled: list[Sequence], num_new_tokens: list[int]
                ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]] | None:
        """Move seqs' blocks back to the device with room for the scheduled seqs' next tokens
        (an admission: the watermark holds), all or nothing. Returns the (host, device) pairs to
        copy and the copy-on-write pairs, or None if the device pool cannot take them."""
        if not self._room_for(self.swap_in_blocks(seqs, scheduled, num_new_tokens),
                              admission=True):
            return None
        pairs = self._move(seqs, self.cpu, self.device)
        for s in seqs:
            s.num_cached_blocks = 0  # new device blocks: register them again
            self._cache_full_blocks(s, s.num_computed_tokens)
        copies = self.allocate_slots(scheduled, num_new_tokens)
        assert copies is not None  # counted above
        return pairs, copies

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
