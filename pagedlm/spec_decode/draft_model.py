"""The draft-model proposer: a small model sharing the target's tokenizer drafts k tokens.

It runs in the target's worker and keeps its K/V in the TARGET's block tables: K/V tensors of
its own, with as many blocks as the target's pool, indexed by the same block ids. Why not a pool
of its own (as first built), or draft blocks reserved at admission: the target shares blocks
(prefix caching, n > 1 forks), so a separate pool of the same size ran short when the target's
did not, and a sequence skipped drafting depending on what else was running (its seeded
output then depended on load, which --deterministic rules out); reserving at admission would
count again the blocks the target shares, and let fewer requests in. In the target's tables the
draft never runs short: every position it writes (the committed tokens, then d1..d_{k-1}, up
to L+k-2) has a slot the scheduler reserved (lookahead slots reach L-1+k).

A block id holds different tokens over time (freed and reused; shared through prefix caching
or a fork, written by one sequence's draft and read by another's), so the proposer records per
block what its draft K/V holds: the chain hash of the tokens before the block and the tokens
written in it. Each propose() keeps the longest prefix of a sequence's committed tokens that
its blocks hold (a shared or reused block counts when its record matches: the draft gets
prefix caching for free; a copy-on-write copy or a swapped-in block has no matching record and
is computed again), computes the rest of the committed tokens in one flat batch (decode rows
first, then prefill chunks, as the model runner lays out a step), then decodes k-1 more steps
with every sequence in one batch.

Drafts are greedy (argmax), so Proposal.probs is None: a one-hot q. Rejection sampling stays
exact with any q (it accepts d with probability min(1, p(d)/q(d)) and resamples from
max(p - q, 0)); a one-hot q changes only how often drafts are accepted at temperature > 0
(p(d) instead of the overlap of p and q), and saves the [k, V] softmax rows per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedlm.config import CacheConfig, ModelConfig
from pagedlm.model_executor.model_loader.loader import get_model
from pagedlm.spec_decode.proposer import Proposal, ProposalRequest
from pagedlm.worker.cache_engine import CacheEngine, kv_bytes_per_block
from pagedlm.worker.model_runner import _FlatBatch
from pagedlm.worker.step_inputs import build_step_tensors

_ROOT = 0  # the chain hash of no tokens


def _chain(prefix: int, tokens: list[int]) -> int:
    return hash((prefix, tuple(tokens)))


@dataclass
class _BlockKV:
    """What the draft's K/V in one block holds: positions [0, len(tokens)) of the block, for a
    sequence whose tokens before the block chain-hash to `prefix`."""
    prefix: int
    tokens: list[int]
    full: int | None = None  # the chain hash through the block, once it is full


@dataclass
class _DraftSeq:
    hashes: list[int]  # the chain hash through each full block of its committed tokens
    # Its own catch-up history, not the cache's state (which other sequences' drafts fill in):
    # the committed tokens its catch-ups fed and the drafts fed after them. Whether it drafts
    # in a step is decided from these, so under --deterministic it depends on nothing else.
    fed: int = 0
    fed_drafts: list[int] = field(default_factory=list)


@dataclass
class _Plan:
    """A sequence's part of one propose()."""
    index: int  # in the requests
    block_ids: list[int]  # the target's block table
    keep: int  # committed tokens whose K/V its blocks hold
    num_new: int  # committed tokens computed now (from keep)
    k: int  # drafts wanted (0: catch-up only this step)


class DraftModelProposer:
    """Proposer (spec_decode/proposer.py) of a draft model keeping its K/V in the target's
    block ids.

    The worker sizes its K/V tensors with the target's pool (the same block count, each
    block's bytes counted in kv_bytes_per_block)."""

    def __init__(self, config: ModelConfig, cache_config: CacheConfig, num_blocks: int = 0,
                 device: torch.device | str = "cpu", model: torch.nn.Module | None = None,
                 max_catchup_tokens: int = 2048) -> None:
        """config: draft_config.draft_model_config's; cache_config: the target's (block size,
        KV dtype); num_blocks: the target's pool (0: initialize_cache later); model: the loaded
        draft (default: loaded now); max_catchup_tokens: a sequence's committed tokens
        computed per propose() (the default is the engine's chunked-prefill budget)."""
        self.config = config
        self.max_catchup_tokens = max_catchup_tokens
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.model = model if model is not None else get_model(config, device)
        self.device = next(p.device for p in self.model.parameters() if not p.is_meta)
        self.kv_bytes_per_block = kv_bytes_per_block(
            config, self.block_size, dtype=cache_config.kv_dtype(config.dtype))
        self.seqs: dict[int, _DraftSeq] = {}
        self.initialize_cache(num_blocks)

    def initialize_cache(self, num_blocks: int) -> None:
        """(Re)allocate the K/V tensors for block ids 0..num_blocks-1; every record and every
        sequence's state is dropped."""
        self.num_blocks = num_blocks
        self.kv_caches = CacheEngine(self.config, self.cache_config, num_blocks,
                                     device=self.device).kv_caches
        self.written: list[_BlockKV | None] = [None] * num_blocks
        self.seqs.clear()

    def drop(self, seq_ids: list[int]) -> None:
        # The blocks' records stay: they describe the K/V, whoever holds the block next.
        for seq_id in seq_ids:
            self.seqs.pop(seq_id, None)

    # -- the cache's content ------------------------------------------------------------------
    def _extend_hashes(self, seq: _DraftSeq, tokens: list[int]) -> None:
        """A sequence's committed tokens only grow: hash the blocks they filled since."""
        bs, hashes = self.block_size, seq.hashes
        while len(hashes) < len(tokens) // bs:
            i = len(hashes)
            hashes.append(_chain(hashes[-1] if i else _ROOT, tokens[i * bs:(i + 1) * bs]))

    def _held(self, seq: _DraftSeq, tokens: list[int], table: list[int]) -> int:
        """How many leading committed tokens the blocks' draft K/V holds (at most L-1: the
        last one is always fed, its logits give d1)."""
        bs, limit = self.block_size, len(tokens) - 1
        prefix = _ROOT
        for i, block in enumerate(table):
            lo = i * bs
            rec = self.written[block]
            if lo >= limit or rec is None or rec.prefix != prefix:
                return min(lo, limit)
            if i < len(seq.hashes) and rec.full == seq.hashes[i]:
                prefix = rec.full
                continue
            n = 0
            for a, b in zip(rec.tokens, tokens[lo:lo + bs]):
                if a != b:
                    break
                n += 1
            return min(lo + n, limit)
        return min(len(table) * bs, limit)

    def _record(self, seq: _DraftSeq, table: list[int], content: list[int], base: int,
                start: int, end: int) -> None:
        """The draft wrote positions [start, end) of the sequence (its blocks held the ones
        before). content[x - base] is the token at position x; base is a block boundary no
        later than the end of its hashed committed blocks (a draft step passes the tail, not
        a copy of the whole sequence)."""
        bs = self.block_size
        for i in range(start // bs, (end - 1) // bs + 1):
            j = min(i, len(seq.hashes))
            prefix = seq.hashes[j - 1] if j else _ROOT
            for b in range(j, i):  # blocks holding drafts
                prefix = _chain(prefix, content[b * bs - base:(b + 1) * bs - base])
            lo = i * bs - base
            tokens = content[lo:min(end - base, lo + bs)]
            self.written[table[i]] = _BlockKV(prefix, tokens,
                                              _chain(prefix, tokens) if len(tokens) == bs
                                              else None)

    # -- one step -----------------------------------------------------------------------------
    def _plan(self, index: int, req: ProposalRequest) -> _Plan | None:
        """What the sequence computes this step, or None (k = 0: nothing asked)."""
        tokens, length, table = req.token_ids, len(req.token_ids), req.block_ids
        # Fed: the committed tokens not yet cached and d1..d_{k-1}, at positions up to L+k-2,
        # within the draft's context and the slots the target reserved.
        k = min(req.num_tokens, self.config.max_model_len - length + 1,
                len(table) * self.block_size - length + 1)
        if k <= 0 or length == 0:
            return None
        seq = self.seqs.setdefault(req.seq_id, _DraftSeq([]))
        self._extend_hashes(seq, tokens)
        # Its own history: the committed tokens it fed, then the drafts that were accepted.
        own = min(seq.fed, length - 1)
        for d in seq.fed_drafts:
            if own >= length - 1 or tokens[own] != d:
                break
            own += 1
        keep = self._held(seq, tokens, table)
        # The catch-up is budgeted per sequence (a long prompt's first draft would stall the
        # step as an unchunked prefill does) over its own history: one not caught up by its
        # own catch-ups drafts nothing this step, however much of its prefix others computed.
        if length - own <= self.max_catchup_tokens:
            seq.fed, seq.fed_drafts = length, []
            return _Plan(index, table, keep, length - keep, k)
        seq.fed, seq.fed_drafts = own + self.max_catchup_tokens, []
        return _Plan(index, table, keep,
                     max(0, min(length - 1 - keep, self.max_catchup_tokens)), 0)

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        drafts: list[list[int]] = [[] for _ in requests]
        plans = [p for i, r in enumerate(requests)
                 if (p := self._plan(i, r)) is not None and p.num_new]
        if not plans:
            return [Proposal([]) for _ in requests]
        # The catch-up, decode rows first, then prefill chunks.
        plans.sort(key=lambda p: not (p.num_new == 1 and p.keep > 0))
        batch = self._new_batch()
        for p in plans:
            tokens = requests[p.index].token_ids
            self._add_rows(batch, p, tokens[p.keep:p.keep + p.num_new], p.keep,
                           decode=p.num_new == 1 and p.keep > 0)
        sampled = [j for j, p in enumerate(plans) if p.k]
        for p in plans:
            req = requests[p.index]
            self._record(self.seqs[req.seq_id], p.block_ids, req.token_ids, 0, p.keep,
                         p.keep + p.num_new)
        for j, d in zip(sampled, self._greedy(batch, sampled)):
            drafts[plans[j].index].append(d)
        plans = [plans[j] for j in sampled]
        # k-1 more steps, one decode row per sequence still drafting.
        step = 1
        while drafting := [p for p in plans if p.k > step]:
            batch = self._new_batch()
            for p in drafting:
                req = requests[p.index]
                position = len(req.token_ids) + step - 1
                self._add_rows(batch, p, [drafts[p.index][-1]], position, decode=True)
                seq = self.seqs[req.seq_id]
                base = len(seq.hashes) * self.block_size
                self._record(seq, p.block_ids, req.token_ids[base:] + drafts[p.index], base,
                             position, position + 1)
            for p, d in zip(drafting, self._greedy(batch, range(len(drafting)))):
                drafts[p.index].append(d)
            step += 1
        for p in plans:
            self.seqs[requests[p.index].seq_id].fed_drafts = drafts[p.index][:-1]
        return [Proposal(d) for d in drafts]

    @staticmethod
    def _new_batch() -> _FlatBatch:
        return _FlatBatch([], [], [], [], [], {})

    def _add_rows(self, batch: _FlatBatch, seq: _Plan, tokens: list[int], start: int,
                  decode: bool) -> None:
        """Lay out `tokens` at positions start.. as the model runner lays out a step."""
        bs, table = self.block_size, seq.block_ids
        row0 = len(batch.input_ids)
        batch.input_ids += tokens
        batch.positions += range(start, start + len(tokens))
        batch.slots += [table[p // bs] * bs + p % bs for p in range(start, start + len(tokens))]
        batch.last_row[len(batch.last_row)] = len(batch.input_ids) - 1
        if decode:
            batch.decodes.append((seq, start))
        else:
            batch.prefills.append((seq, start, row0, len(batch.input_ids)))

    def _greedy(self, batch: _FlatBatch, sampled) -> list[int]:
        """Run the batch; the argmax token after the last row of each of the sampled
        sequences (indices in the batch's order)."""
        step = build_step_tensors(batch, [batch.last_row[j] for j in sampled], self.device)
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.attn_metadata)
        if not sampled:  # catch-up chunks only: their K/V is what was wanted
            return []
        return self.model.compute_logits(hidden[step.sample_rows]).argmax(dim=-1).tolist()
