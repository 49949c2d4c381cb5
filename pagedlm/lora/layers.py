"""LoRA-aware versions of the parallel linear layers.

Each wrapper holds the base layer and, for every one of the `max_loras` device slots, a stacked
A [R, in] and B [R, out] (B kept transposed so a slot's rows are contiguous), where
R = shards x max_lora_rank: a packed layer (QKV, gate/up) gives each of its stacked matrices
its own rank block, since a PEFT adapter has one A per checkpoint module (q_proj, k_proj, ...).
All slots sit side by side, so one step's tokens of any mix of adapters take two GEMMs:

    y += where(mask, x @ A_cat^T, 0) @ B_cat   mask[t, c] where column c is token t's slot

(`where`, not a product with a 0/1 mask: an adapter whose A overflows to infinity for a token
would make 0 x inf = NaN in every other token's row, the base model's included; loading refuses
non-finite weights, models.py.)

The mask is built once per step and width (LoRABatch) and shared by every layer. A step with no
adapter skips all of it.

Deterministic (ModelConfig.deterministic): those two GEMMs' sum orders change with the number of
tokens and of slots in the step, so a token's delta would depend on its batch. Each slot's
tokens then take two calls of the GEMV kernel on that slot's own A [R, in] and B [out, R], whose
sum for one output is one row against one row in a fixed order whatever the row count
(gemv.py); tokens without an adapter get no delta at all.

Tensor parallelism follows the base layer: a column layer's B is sliced by the base layer's own
weight_loader (so QKV head replication is handled the same way), a row layer's A is sliced on
its input; its delta is added to the partial sum before the all-reduce, which sums it as well.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedlm.kernels import gemv
from pagedlm.model_executor.layers.linear import (ColumnParallelLinear,
                                                  MergedColumnParallelLinear, QKVParallelLinear,
                                                  RowParallelLinear)


class LoRABatch:
    """The step's token -> slot mapping, shared by every LoRA layer of one model."""

    def __init__(self, max_loras: int, deterministic: bool = False) -> None:
        self.max_loras = max_loras
        self.deterministic = deterministic
        self.active = False
        self.num_slots = 0  # slots [0, num_slots) cover every adapter in the step
        self.token_slots: torch.Tensor | None = None
        self._masks: dict[int, torch.Tensor] = {}
        # Deterministic: (slot, the indices of its tokens) for each slot with tokens this step.
        self.slot_rows: list[tuple[int, torch.Tensor]] = []

    def set(self, token_slots: torch.Tensor | None) -> None:
        """token_slots [num_tokens]: each token's slot, -1 for the base model; None: no adapter
        in this step."""
        self._masks.clear()
        self.token_slots = token_slots
        self.active = token_slots is not None
        self.num_slots = int(token_slots.max()) + 1 if self.active else 0
        self.slot_rows = []
        if self.active and self.deterministic:
            for slot in range(self.num_slots):
                rows = torch.nonzero(token_slots == slot).squeeze(1)
                if rows.numel():
                    self.slot_rows.append((slot, rows))

    def mask(self, rank_per_slot: int) -> torch.Tensor:
        """[tokens, slots x rank_per_slot] bool: True where the column is the token's slot."""
        m = self._masks.get(rank_per_slot)
        if m is None:
            cols = torch.arange(self.num_slots * rank_per_slot,
                                device=self.token_slots.device) // rank_per_slot
            m = self.token_slots.unsqueeze(1) == cols.unsqueeze(0)
            self._masks[rank_per_slot] = m
        return m


class BaseLayerWithLoRA(nn.Module):
    """Shared by the wrappers: the slot buffers, the delta and the slot writes."""

    # Shard ids of the stacked matrices, as the base layer's weight_loader takes them.
    shard_ids: tuple = (None,)

    def __init__(self, base_layer: nn.Module, batch: LoRABatch, max_lora_rank: int) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.batch = batch
        self.max_lora_rank = max_lora_rank
        self.rank_per_slot = len(self.shard_ids) * max_lora_rank
        out_dim, in_dim = base_layer.weight.shape  # this rank's partition
        # The activations' dtype, float32, also under a 2-byte model dtype (ModelConfig's
        # compute_dtype): A and B are small, and the delta adds to float32 outputs.
        # (The device of the panels where a 2-byte weight was dropped for them: linear_method.py.)
        panels = getattr(base_layer, "panel_weight", None)
        dtype = torch.float32
        dev = panels.device if panels is not None else base_layer.weight.device
        n = batch.max_loras * self.rank_per_slot
        self.register_buffer("lora_a", torch.zeros(n, in_dim, dtype=dtype, device=dev),
                             persistent=False)
        self.register_buffer("lora_b_t", torch.zeros(n, out_dim, dtype=dtype, device=dev),
                             persistent=False)
        # Deterministic: each slot's B [out, R] as well, the layout the GEMV kernel reads.
        if batch.deterministic and not gemv.runs(self.lora_a):
            raise ValueError("deterministic=True needs pagedlm's native kernels for LoRA, "
                             "which do not run here (PAGEDLM_DISABLE_KERNELS, or no C "
                             "compiler).")
        self.register_buffer("lora_b", torch.zeros(batch.max_loras, out_dim, self.rank_per_slot,
                                                   dtype=dtype, device=dev)
                             if batch.deterministic else None, persistent=False)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_b is not None:
            return self._delta_per_slot(x)
        w = self.batch.num_slots * self.rank_per_slot
        shrunk = x @ self.lora_a[:w].T
        return torch.where(self.batch.mask(self.rank_per_slot), shrunk, 0.0) @ self.lora_b_t[:w]

    def _delta_per_slot(self, x: torch.Tensor) -> torch.Tensor:
        """What `delta` computes, each slot's tokens on their own, one sum order per output."""
        out = torch.zeros(x.shape[0], self.lora_b.shape[1], dtype=x.dtype, device=x.device)
        r = self.rank_per_slot
        for slot, rows in self.batch.slot_rows:
            shrunk = gemv.gemv(x[rows], self.lora_a[slot * r:(slot + 1) * r])
            out[rows] = gemv.gemv(shrunk, self.lora_b[slot])
        return out

    # -- adapter weights ----------------------------------------------------------------------
    @property
    def full_input_size(self) -> int:
        return self.base_layer.input_size

    def shard_output_sizes(self) -> list[int]:
        return [self.base_layer.output_size]

    def slice_weights(self, name: str, shards: dict[object, tuple[torch.Tensor, torch.Tensor]]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slot content (A [R, in_part], B^T [R, out_part]) from full checkpoint
        tensors: shard id -> (A [r, in], B [out_of_shard, r]), or {None: ...} for an adapter on
        the whole (fused) module. ValueError naming the module for shapes that do not fit."""
        out_part, in_part = self.base_layer.weight.shape
        a = torch.zeros(self.rank_per_slot, in_part, dtype=self.lora_a.dtype)
        b = torch.zeros(out_part, self.rank_per_slot, dtype=self.lora_a.dtype)
        sizes = self.shard_output_sizes()
        for shard, (lora_a, lora_b) in shards.items():
            r = lora_a.shape[0]
            if shard is None:
                idx, expected_out = 0, sum(sizes)
            else:
                idx = self.shard_ids.index(shard)
                expected_out = sizes[idx]
            if lora_a.dim() != 2 or lora_a.shape[1] != self.full_input_size:
                raise ValueError(f"adapter module {name}: lora_A has shape {tuple(lora_a.shape)}"
                                 f", but the base model needs [rank, {self.full_input_size}].")
            if lora_b.dim() != 2 or tuple(lora_b.shape) != (expected_out, r):
                raise ValueError(f"adapter module {name}: lora_B has shape {tuple(lora_b.shape)}"
                                 f", but the base model needs [{expected_out}, {r}].")
            cols = slice(idx * self.max_lora_rank, idx * self.max_lora_rank + r)
            a[cols] = self._slice_a(lora_a.to(a.dtype))
            self._load_b(b[:, cols], lora_b.to(b.dtype), shard)
        return a, b.T.contiguous()

    def _slice_a(self, lora_a: torch.Tensor) -> torch.Tensor:
        return lora_a

    def _load_b(self, dst: torch.Tensor, lora_b: torch.Tensor, shard: object) -> None:
        """dst [out_part, r] <- this rank's rows of lora_b, through the base layer's loader."""
        if shard is not None or self.shard_ids == (None,):
            self.base_layer.weight_loader(dst, lora_b, shard)
            return
        # A fused module's adapter: its B spans all stacked matrices; split it the same way.
        for sid, part in zip(self.shard_ids, lora_b.split(self.shard_output_sizes(), dim=0)):
            self.base_layer.weight_loader(dst, part, sid)

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        rows = slice(slot * self.rank_per_slot, (slot + 1) * self.rank_per_slot)
        if weights is None:
            self.lora_a[rows].zero_()
            self.lora_b_t[rows].zero_()
        else:
            self.lora_a[rows].copy_(weights[0])
            self.lora_b_t[rows].copy_(weights[1])
        if self.lora_b is not None:
            self.lora_b[slot].copy_(self.lora_b_t[rows].T)

    def extra_repr(self) -> str:
        return f"slots={self.batch.max_loras}, rank_per_slot={self.rank_per_slot}"


class ColumnParallelLinearWithLoRA(BaseLayerWithLoRA):

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if not self.batch.active:
            return base(x)
        y = base.linear_method.apply(base, x, base.bias)
        y = y + self.delta(x)
        return base.tp_group.all_gather(y, dim=-1) if base.gather_output else y


class MergedColumnParallelLinearWithLoRA(ColumnParallelLinearWithLoRA):

    def __init__(self, base_layer, batch, max_lora_rank) -> None:
        self.shard_ids = self.stacked_shard_ids(base_layer)
        super().__init__(base_layer, batch, max_lora_rank)

    @staticmethod
    def stacked_shard_ids(base_layer) -> tuple:
        return tuple(range(len(base_layer.output_sizes)))

    def shard_output_sizes(self) -> list[int]:
        return list(self.base_layer.output_sizes)


class QKVParallelLinearWithLoRA(MergedColumnParallelLinearWithLoRA):

    @staticmethod
    def stacked_shard_ids(base_layer) -> tuple:
        return ("q", "k", "v")

    def shard_output_sizes(self) -> list[int]:
        # Full (unsharded) sizes: the checkpoint's q, k and v rows.
        b = self.base_layer
        return [b.total_num_heads * b.head_size, b.total_num_kv_heads * b.head_size,
                b.total_num_kv_heads * b.head_size]


class RowParallelLinearWithLoRA(BaseLayerWithLoRA):

    def _slice_a(self, lora_a: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        n = base.input_size_per_partition
        return lora_a.narrow(1, base.tp_rank * n, n)

    def _load_b(self, dst, lora_b, shard) -> None:
        dst.copy_(lora_b)  # the output is whole on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        if not self.batch.active:
            return base(x)
        apply = base.linear_method.apply
        if base.tp_size == 1:
            return apply(base, x, base.bias) + self.delta(x)
        if not base.input_is_parallel:
            n = base.input_size_per_partition
            x = x.narrow(-1, base.tp_rank * n, n).contiguous()
        if not base.reduce_results:
            return apply(base, x, base.bias if base.tp_rank == 0 else None) + self.delta(x)
        y = base.tp_group.all_reduce(apply(base, x) + self.delta(x))
        return y.add_(base.bias) if base.bias is not None else y


def lora_layer_class(module: nn.Module) -> type[BaseLayerWithLoRA] | None:
    """The LoRA wrapper for a base layer, or None where adapters are not supported on it (the
    LM head and embeddings are not linear layers here; expert weights are not either)."""
    # Most specific first: the packed layers subclass ColumnParallelLinear.
    for base_cls, lora_cls in ((QKVParallelLinear, QKVParallelLinearWithLoRA),
                               (MergedColumnParallelLinear, MergedColumnParallelLinearWithLoRA),
                               (ColumnParallelLinear, ColumnParallelLinearWithLoRA),
                               (RowParallelLinear, RowParallelLinearWithLoRA)):
        if isinstance(module, base_cls):
            return lora_cls
    return None
