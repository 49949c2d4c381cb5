"""Token embedding lookup."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """Rows of the embedding matrix for each token id. The weight starts uninitialised: it is
    always loaded (nn.Embedding's random init on the meta device imports torch._dynamo, ~1.5 s)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
