"""The token bitmask that crosses from the engine to the sampler (pure torch, no backend).

The layout is the one xgrammar and llguidance share: int32 words, 32 tokens per word, token t
allowed iff bit (t % 32) of word (t // 32) is set.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_BITS = torch.arange(32, dtype=torch.int32)


@dataclass
class GrammarBitmask:
    """The step's masks: bitmask[i] applies to row rows[i] of the sampler's logits."""
    rows: list[int]
    bitmask: torch.Tensor  # int32, (len(rows), ceil(vocab_size / 32))


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def apply_grammar_bitmask(logits: torch.Tensor, mask: GrammarBitmask) -> torch.Tensor:
    """Set the disallowed tokens' logits of the masked rows to -inf, in place; columns past the
    bitmask (the padded part of the vocabulary) are disallowed too."""
    words = mask.bitmask.to(logits.device)
    allowed = ((words.unsqueeze(-1) >> _BITS.to(logits.device)) & 1).bool()
    allowed = allowed.view(len(mask.rows), -1)
    width = logits.shape[1]
    if allowed.shape[1] >= width:
        allowed = allowed[:, :width]
    else:
        pad = allowed.new_zeros(len(mask.rows), width - allowed.shape[1])
        allowed = torch.cat([allowed, pad], dim=1)
    rows = torch.tensor(mask.rows, dtype=torch.long, device=logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits
