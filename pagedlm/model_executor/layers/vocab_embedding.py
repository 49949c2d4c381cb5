"""Token embedding and LM head, split by vocabulary range over the tensor-parallel ranks.

The vocabulary is padded up to a multiple of padding_size * tp_size (as vLLM pads to 64), so
every rank holds an equal range of rows; the padding rows are zero and their logits are cut off
before the sampler sees them. No vocabulary size is therefore rejected for a TP size.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.distributed.parallel_state import get_tp_group
from pagedlm.kernels import gemv
from pagedlm.model_executor.layers.linear_method import (LinearMethodBase, UnquantizedLinearMethod,
                                                         float_weight_device)
from pagedlm.model_executor.model_loader.weight_utils import check_shape
from pagedlm.utils import cdiv

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int) -> int:
    return cdiv(vocab_size, pad_to) * pad_to


class VocabParallelEmbedding(nn.Module):
    """Rows of the embedding matrix for each token id; rank r holds the rows of the vocabulary
    range [r*n, (r+1)*n). Each rank looks up the ids in its range (zeros elsewhere), and an
    all-reduce over the TP group sums the ranks' parts into every row.

    The weight starts uninitialised: it is always loaded (nn.Embedding's random init on the
    meta device imports torch._dynamo, ~1.5 s)."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE) -> None:
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_rank, self.tp_size = self.tp_group.rank_in_group, self.tp_group.world_size
        self.org_vocab_size = num_embeddings
        self.embedding_dim = embedding_dim
        # What the model computes in: models are built under it as the default dtype
        # (ModelConfig.compute_dtype, model_loader.get_model).
        self.compute_dtype = torch.get_default_dtype()
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size * self.tp_size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim,
                                               device=float_weight_device()),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        """Copy this rank's vocabulary range of the full [vocab, dim] tensor; zero the padding."""
        assert shard_id is None
        # Trailing dims from the parameter: a quantized head's rows are blocks, not floats.
        check_shape(loaded_weight, (self.org_vocab_size, *param.shape[1:]))
        # Rows of the real vocabulary in this rank's range (none for a rank of pure padding,
        # which only happens with a vocabulary smaller than the padding).
        n = max(0, min(self.vocab_end_index, self.org_vocab_size) - self.vocab_start_index)
        if n:
            param.data[:n].copy_(loaded_weight.narrow(0, self.vocab_start_index, n))
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows [num_tokens, dim] in the compute dtype: on the CPU a 2-byte table
        (ModelConfig.dtype) is widened row by row as it is read, since activations compute in
        float32 there; on a GPU activations compute in the table's own dtype (a no-op)."""
        if self.tp_size == 1:
            return self._rows(input_ids)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill_(outside, 0)
        out = self._rows(local_ids).masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(out)

    def _rows(self, local_ids: torch.Tensor) -> torch.Tensor:
        # A table kept in quantized blocks (quantization="gguf") brings its own lookup, which
        # dequantizes only the rows asked for.
        lookup = getattr(self, "row_lookup", None)
        if lookup is not None:
            return lookup(local_ids)
        return F.embedding(local_ids, self.weight).to(self.compute_dtype)

    def extra_repr(self) -> str:
        return (f"vocab={self.org_vocab_size} (padded {self.num_embeddings_padded}), "
                f"rows [{self.vocab_start_index}, {self.vocab_end_index}), "
                f"dim={self.embedding_dim}")


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the vocabulary: each rank multiplies by its rows of the head (through the
    linear method, so the oneDNN packing applies), then the slices are all-gathered so every TP
    rank, and so the sampler, sees the full vocabulary; the padding is cut off.

    With tied embeddings, `tie_weights` shares the embedding's parameter (same vocabulary split)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE,
                 linear_method: LinearMethodBase | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_size)
        if bias:
            raise NotImplementedError("ParallelLMHead has no bias")
        self.bias = None
        self.linear_method = linear_method or UnquantizedLinearMethod()
        self.packed_weight = self.panel_weight = None

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> "ParallelLMHead":
        assert embed_tokens.num_embeddings_padded == self.num_embeddings_padded
        self.weight = embed_tokens.weight
        self.weight_shared = True  # the lookups read it: the linear method must keep it
        # A weak reference: as an attribute the embedding would become a submodule twice.
        self._tied_embedding = weakref.ref(embed_tokens)
        return self

    def look_up_from_panels(self) -> None:
        """After loading: with tied 2-byte weights on the panel kernel, the head's panels hold
        the table a second time, so the embedding's lookups read their rows from the panels
        (the same values) and the table is dropped for a meta stand-in: 2 bytes a parameter
        instead of 4."""
        tied = getattr(self, "_tied_embedding", None)
        embed, panels = tied() if tied is not None else None, self.panel_weight
        if (embed is None or panels is None or embed.weight is not self.weight
                or self.weight.element_size() != 2
                or getattr(embed, "row_lookup", None) is not None):
            return
        embed.row_lookup = functools.partial(_panel_rows, panels, self.weight.shape[1])
        stand_in = nn.Parameter(torch.empty_like(self.weight, device="meta"),
                                requires_grad=False)
        embed.weight = self.weight = stand_in

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden [num_tokens, dim] -> float32 logits [num_tokens, vocab]."""
        logits = self.linear_method.apply(self, hidden_states)
        logits = self.tp_group.all_gather(logits, dim=-1)
        if self.num_embeddings_padded != self.org_vocab_size:
            logits = logits[..., :self.org_vocab_size].contiguous()
        return logits


def _panel_rows(panels: torch.Tensor, k: int, local_ids: torch.Tensor) -> torch.Tensor:
    """Float32 rows of the [N, k] matrix packed as panels (gemv.pack_panels' layout, which
    for bfloat16 depends on the build; padding rows are zero, as the table's are)."""
    return gemv.panel_rows(panels, local_ids, k)
