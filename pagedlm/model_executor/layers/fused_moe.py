"""A mixture-of-experts MLP: top-k routing and SiLU-gated experts stacked in two weights.

Each expert e is down_e(silu(gate_e(x)) * up_e(x)). All experts' gate and up matrices live in
one parameter w13_weight [E, 2*I/tp, H] (this rank's gate rows, then its up rows) and the down
matrices in w2_weight [E, H, I/tp].

Tensor parallelism splits every expert's intermediate dimension, as a column-then-row MLP:
each rank computes its slice of every expert, its down projection gives a partial sum, and one
all-reduce over the TP group completes the block (or the caller reduces, reduce_results=False,
when it adds a shared expert's partial sum first). Each rank keeps every expert, so routing is
the same everywhere and needs no exchange of tokens.

The experts run per expert, not per token: the (token, choice) pairs are sorted by expert, each
expert with tokens does one GEMM pair over its contiguous group, and the weighted results are
added back to their tokens with one index_add.

Deterministic (ModelConfig.deterministic): a token's result must not depend on the batch, but
how many tokens an expert gets does, and a torch GEMM's sum order changes with its row count.
The experts then run on pagedlm's kernels, which give each output element one sum order at
every row count: the panel kernel over per-expert packed copies where it exists, the GEMV
kernel otherwise (gemv.py); silu(gate) * up runs on the native per-row kernel (torch's SiLU
gives vector blocks and leftover elements different bits), and each token's weighted expert
outputs are summed in its own top-k order. Routing is per row already (a
softmax and top-k along each token's logits).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedlm.distributed.parallel_state import get_tp_group
from pagedlm.kernels import fused_ops, gemv
from pagedlm.model_executor.layers.activation import per_element
from pagedlm.model_executor.layers.linear import ReplicatedLinear
from pagedlm.model_executor.model_loader.weight_utils import check_shape

# Checkpoint role of an expert's matrix -> which stacked weight it belongs to and, for w13,
# which half (gate first, as SiluAndMul expects).
_ROLES = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1),
          "w2": ("w2", None), "down_proj": ("w2", None)}
_CANONICAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# "<prefix>.experts.<e>.<role>.weight": one expert's matrix as checkpoints store it.
_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def expert_param(name: str) -> tuple[str, tuple[int, str]] | None:
    """For one expert's checkpoint matrix, (our stacked parameter's name, its shard id) as
    load_weights_into takes them from a rename; None for any other weight."""
    m = _EXPERT_NAME.match(name)
    if m is None:
        return None
    prefix, expert, role = m.group(1), int(m.group(2)), m.group(3)
    return f"{prefix}.{_ROLES[role][0]}_weight", (expert, _CANONICAL.get(role, role))


def split_stacked_experts(weights: Iterable[tuple[str, torch.Tensor]]
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with experts stored stacked, as transformers 5 holds them in memory
    (`<prefix>.experts.gate_up_proj` [E, 2I, H], gate rows first; `<prefix>.experts.down_proj`
    [E, H, I]), turned into the per-expert names save_pretrained writes; others pass through."""
    for name, tensor in weights:
        if name.endswith(".experts.gate_up_proj") and tensor.dim() == 3:
            prefix = name.removesuffix(".gate_up_proj")
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.gate_proj.weight", gate[e]
                yield f"{prefix}.{e}.up_proj.weight", up[e]
        elif name.endswith(".experts.down_proj") and tensor.dim() == 3:
            prefix = name.removesuffix(".down_proj")
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor


@dataclass(frozen=True)
class Routing:
    """Each token's chosen experts, best first, and the weights their outputs are summed with."""
    topk_ids: torch.Tensor  # [num_tokens, top_k] int64
    topk_weights: torch.Tensor  # [num_tokens, top_k] float32


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Softmax over the router logits (in float32), the top_k experts, and their probabilities,
    rescaled to sum to 1 when `renormalize` (Mixtral; Qwen's norm_topk_prob)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(ids, weights)


def sigmoid_per_element(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid with every element through the same code (activation.per_element says
    why), for gates under the deterministic mode."""
    return per_element(torch.sigmoid, x)


class TopKRouter(ReplicatedLinear):
    """The gate: hidden states -> router logits (a linear layer held whole on every rank, so
    its checkpoint name is `<gate>.weight`) -> this step's Routing."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 renormalize: bool) -> None:
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number "
                             f"of experts ({num_experts}).")
        super().__init__(hidden_size, num_experts, bias=False)
        self.top_k, self.renormalize = top_k, renormalize

    def forward(self, x: torch.Tensor) -> Routing:
        return select_experts(super().forward(x), self.top_k, self.renormalize)


class FusedMoE(nn.Module):

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 reduce_results: bool = True, deterministic: bool = False) -> None:
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_rank, self.tp_size = self.tp_group.rank_in_group, self.tp_group.world_size
        if intermediate_size % self.tp_size:
            raise ValueError(f"tensor_parallel_size ({self.tp_size}) must divide the experts' "
                             f"intermediate size ({intermediate_size}).")
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.intermediate_size_per_partition = n = intermediate_size // self.tp_size
        self.reduce_results = reduce_results
        self.deterministic = deterministic
        # Deterministic, on builds with the panel kernel: every expert's packed matrices.
        self.w13_panels: torch.Tensor | None = None
        self.w2_panels: torch.Tensor | None = None
        # Uninitialised: the loader fills every expert (and says which it did not).
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * n, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, n),
                                      requires_grad=False)
        for param, roles in ((self.w13_weight, ("w1", "w3")), (self.w2_weight, ("w2",))):
            param.weight_loader = self.weight_loader
            param.expected_shards = {(e, r) for e in range(num_experts) for r in roles}

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: tuple[int, str]) -> None:
        """Copy this rank's slice of one expert's full checkpoint matrix: w1/w3 [I, H] (rows
        split over the ranks), w2 [H, I] (columns split)."""
        expert, role = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: the config has "
                             f"{self.num_experts} experts.")
        n, rank = self.intermediate_size_per_partition, self.tp_rank
        which, half = _ROLES[role]
        if which == "w13":
            check_shape(loaded_weight, (self.intermediate_size, self.hidden_size))
            param.data[expert].narrow(0, half * n, n).copy_(loaded_weight.narrow(0, rank * n, n))
        else:
            check_shape(loaded_weight, (self.hidden_size, self.intermediate_size))
            param.data[expert].copy_(loaded_weight.narrow(1, rank * n, n))

    def process_weights_after_loading(self) -> None:
        """Deterministic: check the experts can run on the native kernels, and pack them for
        the panel kernel where it exists."""
        if not self.deterministic:
            return
        if not (gemv.runs(self.w13_weight[0]) and gemv.runs(self.w2_weight[0])):
            raise ValueError(f"deterministic=True needs pagedlm's native kernels for the "
                             f"experts; {self.w13_weight.dtype} experts cannot run on them "
                             f"(float32 only, and not with PAGEDLM_DISABLE_KERNELS).")
        w13 = [gemv.pack_panels(w) for w in self.w13_weight]
        if all(p is not None for p in w13):
            self.w13_panels = torch.stack(w13)
            self.w2_panels = torch.stack([gemv.pack_panels(w) for w in self.w2_weight])

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [T, H] -> sum over each token's experts of weight * expert(x) [T, H] (this rank's
        partial sum when reduce_results is False)."""
        num_tokens, top_k = routing.topk_ids.shape
        flat_ids = routing.topk_ids.reshape(-1)
        # Stable, so within an expert the tokens stay in order.
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // top_k
        weight_of = routing.topk_weights.reshape(-1)[order]
        # One host sync per layer for the group sizes; the loop below is over experts.
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        grouped = x[token_of]
        out = torch.empty_like(grouped)
        expert = self._expert_invariant if self.deterministic else self._expert
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            out[start:end] = expert(grouped[start:end], e)
            start = end
        out.mul_(weight_of.unsqueeze(1).to(out.dtype))
        if self.deterministic:
            # Back to [token, choice] order, then each token's sum in its own top-k order.
            per_choice = torch.empty_like(out)
            per_choice[order] = out
            per_choice = per_choice.view(num_tokens, top_k, -1)
            y = per_choice[:, 0].clone()
            for j in range(1, top_k):
                y += per_choice[:, j]
        else:
            y = torch.zeros_like(x).index_add_(0, token_of, out)
        if self.reduce_results:
            y = self.tp_group.all_reduce(y)
        return y

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        n = self.intermediate_size_per_partition
        h = F.linear(x, self.w13_weight[e])
        return F.linear(F.silu(h[:, :n]) * h[:, n:], self.w2_weight[e])

    def _expert_invariant(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """What _expert computes, with one sum order per output element whatever x's rows."""
        if self.w13_panels is not None:
            h = gemv.gemm_panels(x, self.w13_panels[e], self.w13_weight.shape[1])
            return gemv.gemm_panels(fused_ops.silu_and_mul(h), self.w2_panels[e],
                                    self.hidden_size)
        h = gemv.gemv(x, self.w13_weight[e])
        return gemv.gemv(fused_ops.silu_and_mul(h), self.w2_weight[e])

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, tp_size={self.tp_size}")
