"""Verifying drafted tokens: which drafts a target step accepts, and the token after them.

A speculating sequence is m+1 consecutive sample rows: row j scores the token after the j-th
draft (row 0 the token after the last committed one). The Sampler (sampler.py) turns each row's
logits into the distribution plain sampling would draw from (penalties, constraints, grammar,
temperature, truncation) and hands it here with the drafts:
- greedy: the drafts are accepted while each equals the argmax of the row before it, then the
  argmax of the first mismatching row (or of the last row) follows. Exactly the tokens plain
  greedy decoding emits one step at a time.
- random: draft d at row j is accepted when u * q_j(d) <= p_j(d) (u uniform, q the proposer's
  distribution, one-hot for a deterministic proposal); the first rejection emits a token drawn
  from max(p_j - q_j, 0) and stops; when all are accepted a bonus token is drawn from the last
  row. Each emitted token is then distributed exactly as plain sampling's (Leviathan et al.
  2023, Chen et al. 2023).
Both work on all spans of a step at once (drafts padded to the longest span).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftSpan:
    first_row: int  # the sample row scoring the token after t (row j scores after d_j)
    token_ids: list[int]  # d1..dm (m >= 1); the span has m+1 consecutive sample rows
    # [m, V] the proposer's distribution at each draft; None: a deterministic proposal (one-hot
    # q), e.g. n-gram lookup.
    probs: torch.Tensor | None = None

    @property
    def rows(self) -> range:
        return range(self.first_row, self.first_row + len(self.token_ids) + 1)


@dataclass
class DraftMetadata:
    spans: list[DraftSpan]


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row, drawn with probability proportional to the row's weights (>= 0, not
    necessarily normalised) by the row's uniform u in [0, 1)."""
    cdf = weights.cumsum(dim=-1)
    # Zero-weight tokens have a flat CDF step, so `right=True` never lands on them.
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True)
    return tokens.squeeze(1).clamp_(max=weights.shape[1] - 1)


@dataclass
class _Padded:
    drafts: torch.Tensor  # [S, M] int64, 0 past a span's drafts
    lengths: torch.Tensor  # [S] int64: m of each span
    valid: torch.Tensor  # [S, M] bool: j < m
    offsets: torch.Tensor  # [S] int64: each span's first row among the spans' rows


def _pad(spans: list[DraftSpan], device: torch.device) -> _Padded:
    """On `device`, the logits' (a CUDA step never mixes host and device tensors)."""
    longest = max(len(s.token_ids) for s in spans)
    drafts = torch.tensor([s.token_ids + [0] * (longest - len(s.token_ids)) for s in spans],
                          dtype=torch.long, device=device)
    lengths = torch.tensor([len(s.token_ids) for s in spans], dtype=torch.long, device=device)
    valid = torch.arange(longest, device=device).unsqueeze(0) < lengths.unsqueeze(1)
    offsets = torch.cumsum(lengths + 1, 0) - (lengths + 1)
    return _Padded(drafts, lengths, valid, offsets)


def _num_accepted(accept: torch.Tensor) -> torch.Tensor:
    """[S, M] bool -> [S]: the length of each row's leading run of True."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def accept_greedy(argmax: torch.Tensor, spans: list[DraftSpan]) -> torch.Tensor:
    """argmax: [sum(m+1)] the argmax of each span row, spans concatenated in order. Returns the
    number of tokens each span emits (accepted drafts + 1); its emitted tokens are its first
    rows' argmax (equal to the accepted drafts, then the correction or bonus token)."""
    pad = _pad(spans, argmax.device)
    idx = (pad.offsets.unsqueeze(1)
           + torch.arange(pad.drafts.shape[1], device=argmax.device).unsqueeze(0))
    # A padded position's index may run into the next span; `valid` masks it.
    idx = idx.clamp_(max=argmax.shape[0] - 1)
    accept = (argmax[idx] == pad.drafts) & pad.valid
    return _num_accepted(accept) + 1


def accept_random(probs: torch.Tensor, spans: list[DraftSpan], uniforms: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """probs: [sum(m+1), V] each span row's target distribution, spans concatenated in order.
    uniforms: [S, M+1] each span's draws (columns 0..m-1 test its drafts, column M draws its
    last token). Returns (tokens [sum(m+1)], emitted [S]): a span's first `emitted` rows of
    tokens are what it emits, the rest are its drafts (meaningless)."""
    dev = probs.device
    pad = _pad(spans, dev)
    num_spans, longest = pad.drafts.shape
    idx = pad.offsets.unsqueeze(1) + torch.arange(longest, device=dev).unsqueeze(0)
    idx = idx.clamp_(max=probs.shape[0] - 1)
    p_draft = probs[idx, pad.drafts]  # [S, M]: p_j(d_{j+1})
    q_draft = torch.ones_like(p_draft)
    has_probs = [s.probs is not None for s in spans]
    general = torch.tensor(has_probs, device=dev)
    q = None
    if any(has_probs):  # known on the host: no device sync
        # [G, M, V] the proposals' distributions, zero past a span's drafts.
        q = torch.nn.utils.rnn.pad_sequence(
            [s.probs.to(dev, probs.dtype) for s in spans if s.probs is not None],
            batch_first=True)
        q_draft[general] = q.gather(2, pad.drafts[general].unsqueeze(2)).squeeze(2)
    accept = (uniforms[:, :longest] * q_draft <= p_draft) & pad.valid
    accepted = _num_accepted(accept)  # [S]
    rejected = accepted < pad.lengths
    last_rows = pad.offsets + accepted
    weights = probs[last_rows]  # a copy: [S, V]
    # The residual max(p - q, 0) where a draft was rejected; one-hot q zeroes the draft's token.
    rows = (rejected & ~general).nonzero().squeeze(1)
    if len(rows):
        weights[rows, pad.drafts[rows, accepted[rows]]] = 0.0
    if q is not None:
        g_rows = general.nonzero().squeeze(1)
        g_rejected = rejected[g_rows]
        g_rows = g_rows[g_rejected]
        if len(g_rows):
            q_last = q[g_rejected.nonzero().squeeze(1), accepted[g_rows]]  # [R, V]
            weights[g_rows] = (weights[g_rows] - q_last).clamp_(min=0.0)
    # Rounding can leave a residual without mass (p and q equal to float precision):
    # then p itself, which the residual equals up to that rounding.
    empty = weights.sum(dim=-1) <= 0
    if empty.any():
        weights[empty] = probs[last_rows[empty]]
    last = inverse_cdf(weights, uniforms[:, longest])
    tokens = torch.zeros(probs.shape[0], dtype=torch.long, device=dev)
    tokens[idx[pad.valid]] = pad.drafts[pad.valid]
    tokens[last_rows] = last
    return tokens, accepted + 1
