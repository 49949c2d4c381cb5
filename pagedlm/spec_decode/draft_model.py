"""The draft-model proposer: a small model sharing the target's tokenizer drafts k tokens.

It runs in the target's worker with its own small paged KV cache (a fixed pool of blocks, its
own block tables) and keeps that cache in step with the target's committed tokens: each
propose() keeps the longest common prefix of what it computed (rejected drafts are rolled
back), computes the committed tokens it has not seen yet in one flat batch (decode rows first,
then prefill chunks, as the model runner lays out a step), then decodes k-1 more steps with
every sequence in one batch.

Drafts are greedy (argmax), so Proposal.probs is None: a one-hot q. Rejection sampling stays
exact with any q (it accepts d with probability min(1, p(d)/q(d)) and resamples from
max(p - q, 0)); a one-hot q changes only how often drafts are accepted at temperature > 0
(p(d) instead of the overlap of p and q), and saves the [k, V] softmax rows per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedlm.config import CacheConfig, ModelConfig
from pagedlm.model_executor.model_loader.loader import get_model
from pagedlm.spec_decode.proposer import Proposal, ProposalRequest
from pagedlm.utils import cdiv
from pagedlm.worker.cache_engine import CacheEngine, kv_bytes_per_block
from pagedlm.worker.model_runner import ModelRunner, _FlatBatch


@dataclass
class _DraftSeq:
    token_ids: list[int]  # the tokens whose K/V are in the draft's cache, in position order
    block_ids: list[int]
    num_committed: int = 0  # a prefix of token_ids the target committed (never rolled back)


class DraftModelProposer:
    """Proposer (spec_decode/proposer.py) of a draft model with a pool of KV blocks.

    The worker sizes the pool with the target's (the same block count, each block's bytes
    counted in kv_bytes_per_block): every token the target can cache, the draft can too."""

    def __init__(self, config: ModelConfig, cache_config: CacheConfig, num_blocks: int = 0,
                 device: torch.device | str = "cpu", model: torch.nn.Module | None = None,
                 max_catchup_tokens: int = 2048) -> None:
        """config: draft_config.draft_model_config's; cache_config: the target's (block size,
        KV dtype); num_blocks: the pool (0: initialize_cache later); model: the loaded draft
        (default: loaded now); max_catchup_tokens: a sequence's committed tokens computed per
        propose() (the default is the engine's chunked-prefill budget)."""
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
        """(Re)allocate the pool; every sequence's state is dropped."""
        self.num_blocks = num_blocks
        self.kv_caches = CacheEngine(self.config, self.cache_config, num_blocks).kv_caches
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0 first
        self.seqs.clear()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def drop(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            seq = self.seqs.pop(seq_id, None)
            if seq is not None:
                self.free_blocks += reversed(seq.block_ids)

    def _sync(self, req: ProposalRequest, drafting: set[int]
              ) -> tuple[_DraftSeq, int, int] | None:
        """Roll the sequence's cache back to the longest prefix it shares with the committed
        tokens and give it blocks for the step: (seq, tokens kept, k), or None when it drafts
        nothing this step (k = 0, or the pool cannot hold it even after the sequences not
        drafting this step gave theirs back: its own are then given back too, so a sequence
        that does not fit never holds blocks the others could use)."""
        tokens, length = req.token_ids, len(req.token_ids)
        # Fed: the committed tokens not yet cached and d1..d_{k-1}, at positions up to L+k-2.
        k = min(req.num_tokens, self.config.max_model_len - length + 1)
        if k <= 0 or length == 0:
            return None
        seq = self.seqs.setdefault(req.seq_id, _DraftSeq([], []))
        cached = seq.token_ids
        # At least the last committed token is fed: its logits give d1.
        limit = min(len(cached), length - 1)
        # The committed prefix only grows (comparing it whole would cost O(length) a step).
        keep = min(seq.num_committed, limit)
        if keep and cached[keep - 1] != tokens[keep - 1]:  # not this sequence's history
            keep = 0
        while keep < limit and cached[keep] == tokens[keep]:
            keep += 1
        del cached[keep:]
        need = cdiv(length + k - 1, self.block_size)
        short = need - len(seq.block_ids) - len(self.free_blocks)
        if short > 0:
            # Sequences not drafting this step (preempted, or backed off to k = 0) give their
            # blocks first, in the order they first drafted; they catch up when they draft again.
            for idle in [i for i in self.seqs if i not in drafting]:
                if short <= 0:
                    break
                short -= len(self.seqs[idle].block_ids)
                self.drop([idle])
        if short > 0:
            self.drop([req.seq_id])
            return None
        while len(seq.block_ids) > need:
            self.free_blocks.append(seq.block_ids.pop())
        while len(seq.block_ids) < need:
            seq.block_ids.append(self.free_blocks.pop())
        return seq, keep, k

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        drafts: list[list[int]] = [[] for _ in requests]
        drafting = {r.seq_id for r in requests}
        synced = [(i, self._sync(r, drafting)) for i, r in enumerate(requests)]
        active = [(i, *s) for i, s in synced if s is not None]
        if not active:
            return [Proposal([]) for _ in requests]
        # The catch-up: each sequence's uncached committed tokens, at most max_catchup_tokens
        # of them (a long prompt's first draft would stall the step as an unchunked prefill
        # does); one not caught up drafts nothing this step. Per sequence, not per step, so
        # that whether it drafts depends on its own history only (--deterministic).
        rows = [(i, seq, keep, k, min(len(requests[i].token_ids) - keep,
                                      self.max_catchup_tokens))
                for i, seq, keep, k in active]
        # Decode rows first, then prefill chunks.
        rows.sort(key=lambda r: not (r[4] == 1 and r[2] > 0))
        batch = self._new_batch()
        for i, seq, keep, _, n in rows:
            self._add_rows(batch, seq, requests[i].token_ids[keep:keep + n], keep,
                           decode=n == 1 and keep > 0)
        sampled = [j for j, (i, _, keep, _, n) in enumerate(rows)
                   if keep + n == len(requests[i].token_ids)]
        for i, seq, keep, _, n in rows:
            seq.token_ids += requests[i].token_ids[keep:keep + n]
            seq.num_committed = len(seq.token_ids)
        for j, d in zip(sampled, self._greedy(batch, sampled)):
            drafts[rows[j][0]].append(d)
        rows = [rows[j] for j in sampled]
        # k-1 more steps, one decode row per sequence still drafting.
        step = 1
        while True:
            drafting = [(i, seq) for i, seq, _, k, _ in rows if k > step]
            if not drafting:
                break
            batch = self._new_batch()
            for i, seq in drafting:
                last = drafts[i][-1]
                self._add_rows(batch, seq, [last], len(seq.token_ids), decode=True)
                seq.token_ids.append(last)
            for (i, _), d in zip(drafting, self._greedy(batch, range(len(drafting)))):
                drafts[i].append(d)
            step += 1
        return [Proposal(d) for d in drafts]

    @staticmethod
    def _new_batch() -> _FlatBatch:
        return _FlatBatch([], [], [], [], [], {})

    def _add_rows(self, batch: _FlatBatch, seq: _DraftSeq, tokens: list[int], start: int,
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
        dev = self.device
        meta = ModelRunner._build_attn_metadata(batch, dev)
        hidden = self.model(torch.tensor(batch.input_ids, device=dev),
                            torch.tensor(batch.positions, device=dev), self.kv_caches, meta)
        if not sampled:  # catch-up chunks only: their K/V is what was wanted
            return []
        last = torch.tensor([batch.last_row[j] for j in sampled], device=dev)
        return self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
