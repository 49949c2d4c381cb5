"""The token bitmask that crosses from the engine to the sampler.

The layout is the one xgrammar and llguidance share: int32 words, 32 tokens per word, token t
allowed iff bit (t % 32) of word (t // 32) is set.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class GrammarBitmask:
    """The step's masks: one row per sampled row of the step (rows without a grammar are left
    all ones and never read); `rows` are the ones to apply."""
    rows: list[int]
    bitmask: torch.Tensor  # int32, (number of sampled rows, ceil(vocab_size / 32))
    vocab_size: int  # ids from here on (the logits' padding) are never allowed


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@functools.cache
def _kernel():
    """xgrammar's C++ kernel where installed: at 64 rows of a 49k vocabulary it took a third of
    the time of the best torch expression we found (a byte lookup table), a tenth of bit shifts."""
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        return None
    return apply_token_bitmask_inplace


@functools.cache
def _byte_bits(device: torch.device) -> torch.Tensor:
    return torch.tensor([[(b >> i) & 1 for i in range(8)] for b in range(256)], dtype=torch.bool,
                        device=device)


def apply_grammar_bitmask(logits: torch.Tensor, mask: GrammarBitmask) -> torch.Tensor:
    """Set the disallowed tokens' logits of mask.rows to -inf, in place."""
    width = logits.shape[1]
    vocab = min(width, mask.vocab_size)
    bitmask = mask.bitmask.to(logits.device)
    kernel = _kernel() if logits.device.type == "cpu" else None
    if kernel is not None:
        kernel(logits, bitmask, vocab_size=vocab, indices=mask.rows)
    else:
        rows = torch.tensor(mask.rows, dtype=torch.long, device=logits.device)
        # Little-endian int32 words as bytes are the tokens in order, 8 per byte.
        words = bitmask[rows].contiguous().view(torch.uint8).long()
        allowed = _byte_bits(logits.device)[words].view(len(mask.rows), -1)[:, :vocab]
        logits[rows, :vocab] = logits[rows, :vocab].masked_fill(~allowed, float("-inf"))
    if width > mask.vocab_size:
        logits[mask.rows, mask.vocab_size:] = float("-inf")
    return logits
