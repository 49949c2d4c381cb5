"""Linear layers, plain and tensor-parallel, whose matmul goes through a LinearMethod.

The layer owns the shapes and how a checkpoint tensor is sliced for this rank (each parameter's
`weight_loader` takes the FULL checkpoint tensor); the LinearMethod owns the weight format and
the matmul (`create_weights`, `apply`, `process_weights_after_loading`; linear_method.py).
Quantized formats plug in as further LinearMethods (see quantization/).

Tensor parallelism (Megatron style): a ColumnParallelLinear splits the output features across
the TP ranks (each computes a slice; no communication unless gather_output), a
RowParallelLinear splits the input features (each computes a partial sum, then one all-reduce).
An MLP or attention block is column-then-row, so it costs one all-reduce.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedlm.distributed.parallel_state import get_tp_group
from pagedlm.model_executor.layers.linear_method import LinearMethodBase, UnquantizedLinearMethod
from pagedlm.model_executor.model_loader.weight_utils import check_shape, default_weight_loader


def divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


class LinearBase(nn.Module):
    """y = x W^T + b over a flat batch x [num_tokens, in_features]; the TP group is looked up
    once, at construction."""

    def __init__(self, input_size: int, output_size: int,
                 linear_method: LinearMethodBase | None = None) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_group = get_tp_group()
        self.tp_rank, self.tp_size = self.tp_group.rank_in_group, self.tp_group.world_size
        self.linear_method = linear_method or UnquantizedLinearMethod()
        self.params_dtype = torch.get_default_dtype()

    def _create(self, input_size_per_partition: int, output_partition_sizes: list[int],
                bias_size: int | None) -> None:
        self.linear_method.create_weights(self, input_size_per_partition, output_partition_sizes,
                                          self.input_size, self.output_size, self.params_dtype,
                                          self.weight_loader)
        if bias_size is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(torch.empty(bias_size, dtype=self.params_dtype),
                                     requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        raise NotImplementedError

    def _put_rows(self, param: nn.Parameter, first: int, rows: torch.Tensor) -> None:
        """param's rows [first, first + len(rows)) = rows: the weight's through its method
        (straight into panels where it packs them as they load), else copied."""
        put_rows = getattr(self.linear_method, "put_rows", None)
        if param is self.weight and put_rows is not None and put_rows(self, first, rows):
            return
        param.data.narrow(0, first, rows.shape[0]).copy_(rows)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, tp_size={self.tp_size}, "
                f"bias={self.bias is not None}")


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 linear_method: LinearMethodBase | None = None) -> None:
        super().__init__(input_size, output_size, linear_method)
        self._create(input_size, [output_size], output_size if bias else None)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if param is not self.weight:
            default_weight_loader(param, loaded_weight, shard_id)
            return
        assert shard_id is None, f"ReplicatedLinear got shard {shard_id!r}"
        check_shape(loaded_weight, param.shape)
        self._put_rows(param, 0, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across the TP ranks: rank r holds rows [r*n, (r+1)*n) of W (and
    of b). With gather_output the slices are all-gathered into the full output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 gather_output: bool = False, linear_method: LinearMethodBase | None = None,
                 output_sizes: list[int] | None = None) -> None:
        super().__init__(input_size, output_size, linear_method)
        self.gather_output = gather_output
        self.output_size_per_partition = divide(output_size, self.tp_size)
        # The stacked matrices' rows on this rank ([q, k, v], [gate, up]; one for a plain layer).
        self.output_sizes = output_sizes or [output_size]
        partition_sizes = [divide(s, self.tp_size) for s in self.output_sizes]
        self._create(input_size, partition_sizes,
                     self.output_size_per_partition if bias else None)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        assert shard_id is None, f"{type(self).__name__} got shard {shard_id!r}"
        full = (self.output_size, *param.shape[1:])
        check_shape(loaded_weight, full)
        n = param.shape[0]
        self._put_rows(param, 0, loaded_weight.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_method.apply(self, x, self.bias)
        return self.tp_group.all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices in one matmul (gate and up: output_sizes [I, I]). Each
    rank holds its slice of each, stacked: [gate_r; up_r]. shard_id is the matrix's index."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 gather_output: bool = False,
                 linear_method: LinearMethodBase | None = None) -> None:
        super().__init__(input_size, sum(output_sizes), bias, gather_output, linear_method,
                         output_sizes)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        assert isinstance(shard_id, int), f"{type(self).__name__} needs a shard index"
        check_shape(loaded_weight, (self.output_sizes[shard_id], *param.shape[1:]))
        size = divide(self.output_sizes[shard_id], self.tp_size)
        offset = sum(divide(s, self.tp_size) for s in self.output_sizes[:shard_id])
        self._put_rows(param, offset, loaded_weight.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections in one matmul, split by attention head.

    Each rank holds total_num_heads / tp query heads and total_num_kv_heads / tp KV heads. When
    the TP size exceeds the KV heads (GQA), KV heads are replicated instead: each rank holds one,
    rank r the KV head r // (tp / total_num_kv_heads), so the query heads of a rank still read
    the KV head they are grouped with. shard_id is "q", "k" or "v".
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False,
                 linear_method: LinearMethodBase | None = None) -> None:
        tp_size = get_tp_group().world_size
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.num_kv_head_replicas = 1
        q, kv = self.num_heads * head_size, self.num_kv_heads * head_size
        super().__init__(hidden_size, (q + 2 * kv) * tp_size, bias, False, linear_method,
                         [q * tp_size, kv * tp_size, kv * tp_size])

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        if shard_id == "q":
            offset, size, total, start = 0, q, self.total_num_heads, self.tp_rank * q
        elif shard_id in ("k", "v"):
            offset = q if shard_id == "k" else q + kv
            size, total = kv, self.total_num_kv_heads
            start = (self.tp_rank // self.num_kv_head_replicas) * kv
        else:
            raise AssertionError(f"QKVParallelLinear needs shard 'q', 'k' or 'v', got {shard_id!r}")
        check_shape(loaded_weight, (total * self.head_size, *param.shape[1:]))
        self._put_rows(param, offset, loaded_weight.narrow(0, start, size))


class RowParallelLinear(LinearBase):
    """Input features split across the TP ranks: rank r holds columns [r*n, (r+1)*n) of W and
    computes a partial sum, all-reduced over the TP group (reduce_results). The bias is whole
    on every rank and added once, after the reduce. input_is_parallel: x is already this
    rank's slice (the output of a ColumnParallelLinear); otherwise it is sliced here."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 input_is_parallel: bool = True, reduce_results: bool = True,
                 linear_method: LinearMethodBase | None = None) -> None:
        super().__init__(input_size, output_size, linear_method)
        self.input_is_parallel, self.reduce_results = input_is_parallel, reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self._create(self.input_size_per_partition, [output_size], output_size if bias else None)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if param is self.bias:  # replicated
            default_weight_loader(param, loaded_weight, shard_id)
            return
        assert shard_id is None, f"RowParallelLinear got shard {shard_id!r}"
        # A block-quantized weight's dim 1 counts blocks of `input_block` input features
        # (trailing dims: the bytes of a block); a rank's slice must start on a block.
        block = getattr(param, "input_block", 1)
        n = self.input_size_per_partition
        if n % block:
            raise ValueError(f"tensor_parallel_size={self.tp_size} splits {self.input_size} "
                             f"input features into {n} per rank, not a multiple of the "
                             f"{block}-weight quantization block; choose a "
                             f"tensor_parallel_size that keeps them whole.")
        check_shape(loaded_weight, (self.output_size, self.input_size // block,
                                    *param.shape[2:]))
        self._put_rows(param, 0, loaded_weight.narrow(1, self.tp_rank * n // block, n // block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.linear_method.apply(self, x, self.bias)
        if not self.input_is_parallel:
            n = self.input_size_per_partition
            x = x.narrow(-1, self.tp_rank * n, n).contiguous()
        if not self.reduce_results:
            # Partial sums for the caller to reduce: only rank 0 adds the bias, so the sum has
            # it once.
            return self.linear_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        y = self.tp_group.all_reduce(self.linear_method.apply(self, x))
        return y.add_(self.bias) if self.bias is not None else y
