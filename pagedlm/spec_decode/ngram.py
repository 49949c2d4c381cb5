"""N-gram prompt lookup (vLLM's "ngram" method, llama.cpp's lookup decoding).

A sequence whose last n tokens already occurred earlier in it (prompt or output) probably goes
on as it did then: the k tokens that followed the most recent earlier occurrence are proposed.
n runs from prompt_lookup_max down to prompt_lookup_min, the longest match winning. Answers that
quote their prompt (edit this code, repeat this list) are where it pays.

One numpy pass per n over the whole batch, padded to its longest sequence: every sequence's
windows are compared with its suffix at once, so the cost per step does not grow with a Python
loop over tokens.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedlm.speculative_config import SpeculativeConfig
from pagedlm.spec_decode.proposer import Proposal, ProposalRequest


class NgramProposer:
    """Proposer (spec_decode/proposer.py) without state: drop() has nothing to free."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def drop(self, seq_ids: list[int]) -> None:
        pass

    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]:
        if not requests:
            return []
        lens = np.array([len(r.token_ids) for r in requests], dtype=np.int64)
        ks = np.array([r.num_tokens for r in requests], dtype=np.int64)
        width = int(lens.max())
        tokens = np.full((len(requests), width), -1, dtype=np.int64)
        for i, r in enumerate(requests):
            tokens[i, :len(r.token_ids)] = r.token_ids
        rows = np.arange(len(requests))
        # Where each sequence's proposal starts (-1: no match yet).
        start = np.full(len(requests), -1, dtype=np.int64)
        for n in range(min(self.max_n, width - 1), self.min_n - 1, -1):
            todo = (start < 0) & (lens > n)
            if not todo.any():
                continue
            suffix = tokens[rows[:, None], lens[:, None] - n + np.arange(n)]  # [B, n]
            windows = sliding_window_view(tokens, n, axis=1)  # [B, width - n + 1, n]
            hits = (windows == suffix[:, None, :]).all(axis=2)
            # Earlier occurrences only: the window must end before the last token.
            pos = np.arange(hits.shape[1])
            hits &= pos[None, :] < (lens - n)[:, None]
            found = hits.any(axis=1) & todo
            last = hits.shape[1] - 1 - np.argmax(hits[:, ::-1], axis=1)  # most recent
            start = np.where(found, last + n, start)
        k_max = int(ks.max())
        idx = start[:, None] + np.arange(k_max)[None, :]
        take = (start[:, None] >= 0) & (idx < lens[:, None]) & (np.arange(k_max) < ks[:, None])
        drafts = tokens[rows[:, None], np.clip(idx, 0, width - 1)]
        counts = take.sum(axis=1)  # a prefix of each row: idx grows along it
        return [Proposal(drafts[i, :counts[i]].tolist()) for i in range(len(requests))]
