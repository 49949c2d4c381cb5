"""What a proposer is given and returns.

The scheduler reserves k lookahead slots for a speculating sequence before any proposal exists;
the model runner then asks its proposer for at most k draft tokens per such sequence, lays the
sequence out as m+1 decode rows (its last sampled token and the m drafts) and lets the sampler
verify them by rejection sampling. A proposer may keep per-sequence state (a draft model's
catch-up history): `drop` frees it when the sequence finishes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class ProposalRequest:
    seq_id: int
    token_ids: list[int]  # the sequence's committed tokens (prompt + output), t last
    num_tokens: int  # k: propose at most this many
    # Its KV block table (the target's, lookahead slots included): a draft model keeps its own
    # K/V under the same block ids, so it is never short of blocks the target has.
    block_ids: list[int]


@dataclass
class Proposal:
    token_ids: list[int]  # len <= k; empty = nothing to propose
    # [len, V]: the proposer's distribution at each draft, or None for a deterministic proposal
    # (a one-hot q, as n-gram lookup's).
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, requests: list[ProposalRequest]) -> list[Proposal]: ...

    def drop(self, seq_ids: list[int]) -> None: ...  # finished sequences: free their state
