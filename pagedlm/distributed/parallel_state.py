"""Distributed state: the process groups of tensor and pipeline parallelism.

A worker process calls, once, before building its model::

    init_distributed_environment(world_size, rank, "tcp://host:port", local_rank, backend)
    ensure_model_parallel_initialized(tensor_parallel_size, pipeline_parallel_size)

and `get_tp_group()` / `get_pp_group()` then describe its place. Rank layout, as in vLLM: the
world is tp * pp ranks; tensor-parallel groups are contiguous ranks and pipeline groups are
strided, so with tp=2, pp=2 the TP groups are [0, 1] and [2, 3] (one per pipeline stage) and the
PP groups [0, 2] and [1, 3]. Rank r has tp rank r % tp and pipeline stage r // tp.

Every `GroupCoordinator` holds a device group (gloo on CPU, nccl on CUDA) for tensors and a gloo
CPU group for pickled metadata. A group of world size 1 makes no collective call at all: its
methods return their input. Without `init_distributed_environment` (one process, TP=1, PP=1:
the uni-process path and the unit tests) the accessors return such size-1 groups, so nothing
outside needs to initialise anything.
"""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------------------------
# Tensor dicts: the metadata goes as one pickled object, the tensors as tensors.


class TensorMetadata(NamedTuple):
    device: str  # device type of the sender's tensor: "cpu" stays on the CPU at the receiver
    dtype: torch.dtype
    size: torch.Size


class _Container(NamedTuple):
    kind: str  # "dict", "list" or "tuple"
    size: int  # number of items, which follow it in the metadata


def _split_tensor_dict(d: dict) -> tuple[list[tuple[tuple, Any]], list[torch.Tensor]]:
    """`d` flattened depth-first into (key path, value) pairs, and its tensors.

    Each tensor is replaced by its TensorMetadata and appended to the tensor list in the same
    order; each nested dict, list or tuple is recorded at its own path as a container entry
    before its items, so the receiver rebuilds the exact structure. Plain values stay as they
    are (they are pickled with the metadata).
    """
    metadata: list[tuple[tuple, Any]] = []
    tensors: list[torch.Tensor] = []

    def walk(path: tuple, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            metadata.append((path, TensorMetadata(value.device.type, value.dtype, value.size())))
            tensors.append(value)
        elif isinstance(value, dict):
            metadata.append((path, _Container("dict", len(value))))
            for k, v in value.items():
                walk(path + (k,), v)
        elif isinstance(value, (list, tuple)):
            metadata.append((path, _Container(type(value).__name__, len(value))))
            for i, v in enumerate(value):
                walk(path + (i,), v)
        else:
            metadata.append((path, value))

    if not isinstance(d, dict):
        raise TypeError(f"expected a dict, got {type(d).__name__}")
    walk((), d)
    return metadata, tensors


def _merge_tensor_dict(metadata: list[tuple[tuple, Any]], tensors: list[torch.Tensor]) -> dict:
    """The inverse of _split_tensor_dict, given the (received) tensors in the same order."""
    entries, tensor_iter = iter(metadata), iter(tensors)

    def build() -> tuple[Any, Any]:  # (key within its parent, value)
        path, value = next(entries)
        key = path[-1] if path else None
        if isinstance(value, TensorMetadata):
            return key, next(tensor_iter)
        if isinstance(value, _Container):
            items = [build() for _ in range(value.size)]
            if value.kind == "dict":
                return key, dict(items)
            seq = [v for _, v in items]
            return key, tuple(seq) if value.kind == "tuple" else seq
        return key, value

    return build()[1]


def _object_to_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _tensor_to_object(t: torch.Tensor) -> Any:
    return pickle.loads(t.numpy().tobytes())


# ----------------------------------------------------------------------------------------------


class GroupCoordinator:
    """One process's view of one parallel group (the world, its TP group or its PP group).

    `src` / `dst` arguments are ranks within the group; `ranks`, `rank`, `next_rank` and
    `prev_rank` are global ranks. Tensors on the CPU go over the gloo CPU group, others over the
    device group. With world_size 1 no method calls torch.distributed: the collectives return
    their input, and send/recv (which have no peer) raise.
    """

    def __init__(self, ranks: list[int], rank: int, device_group: Any = None,
                 cpu_group: Any = None, device: torch.device | str = "cpu",
                 name: str = "") -> None:
        if len(ranks) > 1 and (device_group is None or cpu_group is None):
            raise ValueError(f"group {name!r} of {len(ranks)} ranks needs process groups")
        self.name = name
        self.ranks = list(ranks)
        self.rank = rank
        self.rank_in_group = self.ranks.index(rank)
        self.world_size = len(self.ranks)
        self.device_group = device_group
        self.cpu_group = cpu_group
        self.device = torch.device(device)
        # Seconds spent in tensor collectives and stage transfers (the engine's step breakdown
        # reports it as communication).
        self.comm_s = 0.0

    @classmethod
    def single(cls, name: str = "") -> "GroupCoordinator":
        """A group of one process (rank 0): every collective is the identity."""
        return cls([0], 0, name=name)

    def __repr__(self) -> str:
        return (f"GroupCoordinator({self.name!r}, ranks={self.ranks}, "
                f"rank_in_group={self.rank_in_group})")

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next process in the group (wrapping around)."""
        return self.ranks[(self.rank_in_group + 1) % self.world_size]

    @property
    def prev_rank(self) -> int:
        return self.ranks[(self.rank_in_group - 1) % self.world_size]

    def _group(self, t: torch.Tensor) -> Any:
        return self.cpu_group if t.device.type == "cpu" else self.device_group

    # -- collectives -------------------------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns `t`."""
        if self.world_size == 1:
            return t
        t0 = time.perf_counter()
        dist.all_reduce(t, group=self._group(t))
        self.comm_s += time.perf_counter() - t0
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `t` concatenated along `dim` (in rank order), on every rank."""
        if self.world_size == 1:
            return t
        t0 = time.perf_counter()
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t, group=self._group(t))
        out = torch.cat(parts, dim=dim)
        self.comm_s += time.perf_counter() - t0
        return out

    def gather(self, t: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Every rank's `t` concatenated along `dim` on rank `dst`; None on the others."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        parts = ([torch.empty_like(t) for _ in range(self.world_size)]
                 if self.rank_in_group == dst else None)
        dist.gather(t, parts, dst=self.ranks[dst], group=self._group(t))
        return torch.cat(parts, dim=dim) if parts is not None else None

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`t` of rank `src` copied into `t` of every rank (same shape and dtype); returns it."""
        if self.world_size == 1:
            return t
        dist.broadcast(t, src=self.ranks[src], group=self._group(t))
        return t

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """A picklable object of rank `src`, over the CPU group."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank_in_group == src else None]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def broadcast_tensor_dict(self, tensor_dict: dict | None = None, src: int = 0
                              ) -> dict:
        """A (nested) dict of tensors and plain values from rank `src` to the group.

        The metadata (keys, plain values, tensor shapes and dtypes) goes as one pickled object
        over the CPU group; each tensor is then broadcast as a tensor. Returns the dict on every
        rank (on `src`, the one it was given). Tuples and lists keep their type.
        """
        if self.world_size == 1:
            return tensor_dict
        if self.rank_in_group == src:
            metadata, tensors = _split_tensor_dict(tensor_dict)
            self.broadcast_object(metadata, src)
            for t in tensors:
                if t.numel():
                    self.broadcast(t.contiguous(), src)
            return tensor_dict
        metadata = self.broadcast_object(None, src)
        tensors = self._empty_tensors(metadata)
        for t in tensors:
            if t.numel():
                self.broadcast(t, src)
        return _merge_tensor_dict(metadata, tensors)

    # -- point to point (pipeline stages) ----------------------------------------------------

    def _peer(self, r: int | None, step: int, what: str) -> int:
        if self.world_size == 1:
            raise RuntimeError(f"{what}: group {self.name!r} has no other rank")
        return self.ranks[(self.rank_in_group + step) % self.world_size if r is None else r]

    def send(self, t: torch.Tensor, dst: int | None = None) -> None:
        """Send `t` to rank `dst` of the group (default: the next rank)."""
        t = t.contiguous()
        dist.send(t, dst=self._peer(dst, 1, "send"), group=self._group(t))

    def recv(self, size: torch.Size | tuple[int, ...], dtype: torch.dtype,
             src: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """A tensor of the given size and dtype from rank `src` (default: the previous rank)."""
        peer = self._peer(src, -1, "recv")
        t = torch.empty(size, dtype=dtype, device=device or self.device)
        dist.recv(t, src=peer, group=self._group(t))
        return t

    def send_object(self, obj: Any, dst: int | None = None) -> None:
        """A picklable object over the CPU group: its byte count, then its bytes."""
        peer = self._peer(dst, 1, "send_object")
        data = _object_to_tensor(obj)
        dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=peer, group=self.cpu_group)
        dist.send(data, dst=peer, group=self.cpu_group)

    def recv_object(self, src: int | None = None) -> Any:
        peer = self._peer(src, -1, "recv_object")
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=peer, group=self.cpu_group)
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(data, src=peer, group=self.cpu_group)
        return _tensor_to_object(data)

    def send_tensor_dict(self, tensor_dict: dict, dst: int | None = None) -> None:
        """As broadcast_tensor_dict, to one rank (default: the next stage)."""
        t0 = time.perf_counter()
        metadata, tensors = _split_tensor_dict(tensor_dict)
        self.send_object(metadata, dst)
        for t in tensors:
            if t.numel():
                self.send(t, dst)
        self.comm_s += time.perf_counter() - t0

    def recv_tensor_dict(self, src: int | None = None) -> dict:
        """What send_tensor_dict of rank `src` (default: the previous stage) sent."""
        t0 = time.perf_counter()
        metadata = self.recv_object(src)
        tensors = self._empty_tensors(metadata)
        peer = self._peer(src, -1, "recv_tensor_dict")
        for t in tensors:
            if t.numel():
                dist.recv(t, src=peer, group=self._group(t))
        self.comm_s += time.perf_counter() - t0
        return _merge_tensor_dict(metadata, tensors)

    def _empty_tensors(self, metadata: list[tuple[tuple, Any]]) -> list[torch.Tensor]:
        """Receive buffers: CPU tensors stay on the CPU, device tensors land on our device."""
        return [torch.empty(m.size, dtype=m.dtype,
                            device="cpu" if m.device == "cpu" else self.device)
                for _, m in metadata if isinstance(m, TensorMetadata)]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    def destroy(self) -> None:
        for g in {id(g): g for g in (self.device_group, self.cpu_group) if g is not None}.values():
            dist.destroy_process_group(g)
        self.device_group = self.cpu_group = None


# ----------------------------------------------------------------------------------------------
# The process's groups.


@dataclass
class _ModelParallelGroups:
    world: GroupCoordinator
    tp: GroupCoordinator
    pp: GroupCoordinator


# The one piece of module-level mutable state, on purpose: parallel groups belong to the
# process (torch.distributed's own default group is process-wide too), and the layers deep
# inside a model need them without every constructor threading them through. It is set once by
# ensure_model_parallel_initialized and cleared by destroy_model_parallel; nothing else here is
# global.
_GROUPS: _ModelParallelGroups | None = None


def default_backend(device: torch.device | str) -> str:
    """nccl for CUDA devices, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed_environment(world_size: int, rank: int, distributed_init_method: str,
                                 local_rank: int = 0, backend: str = "gloo",
                                 timeout_s: float | None = None) -> None:
    """Join the process group (torch.distributed's default group). Idempotent.

    distributed_init_method: e.g. "tcp://127.0.0.1:29500" (every rank the same). With nccl the
    process's CUDA device becomes cuda:local_rank.
    """
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"torch.distributed is already initialised as rank "
                               f"{dist.get_rank()} of {dist.get_world_size()}, not {rank} of "
                               f"{world_size}")
        return
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    kwargs = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group(backend=backend, init_method=distributed_init_method,
                            world_size=world_size, rank=rank, **kwargs)


def _make_group(group_ranks: list[list[int]], rank: int, backend: str, device: torch.device,
                name: str) -> GroupCoordinator:
    """Create every group of one kind (all ranks must call this, in the same order) and return
    the one this rank belongs to. Size-1 groups get no process group: they never communicate."""
    mine = None
    for ranks in group_ranks:
        device_group = cpu_group = None
        if len(ranks) > 1:
            device_group = dist.new_group(ranks, backend=backend)
            cpu_group = device_group if backend == "gloo" else dist.new_group(ranks,
                                                                              backend="gloo")
        if rank in ranks:
            mine = GroupCoordinator(ranks, rank, device_group, cpu_group, device, name)
    assert mine is not None, f"rank {rank} is in no {name} group"
    return mine


def ensure_model_parallel_initialized(tensor_parallel_size: int,
                                      pipeline_parallel_size: int) -> None:
    """Create the world, TP and PP groups (once; a second call must ask for the same sizes).

    Without an initialised torch.distributed only 1 x 1 is allowed, and the accessors keep
    returning size-1 groups.
    """
    global _GROUPS
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if _GROUPS is not None:
        if (_GROUPS.tp.world_size, _GROUPS.pp.world_size) != (tp, pp):
            raise RuntimeError(f"model parallel groups already initialised with "
                               f"tensor_parallel_size={_GROUPS.tp.world_size}, "
                               f"pipeline_parallel_size={_GROUPS.pp.world_size}")
        return
    if not dist.is_initialized():
        if tp * pp != 1:
            raise RuntimeError("call init_distributed_environment before asking for "
                               f"tensor_parallel_size={tp}, pipeline_parallel_size={pp}")
        return
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size != tp * pp:
        raise ValueError(f"world size {world_size} is not tensor_parallel_size ({tp}) x "
                         f"pipeline_parallel_size ({pp})")
    backend = dist.get_backend()
    device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
              else torch.device("cpu"))
    world = _make_group([list(range(world_size))], rank, backend, device, "world")
    tp_group = _make_group([list(range(s * tp, (s + 1) * tp)) for s in range(pp)],
                           rank, backend, device, "tp")
    pp_group = _make_group([list(range(t, world_size, tp)) for t in range(tp)],
                           rank, backend, device, "pp")
    _GROUPS = _ModelParallelGroups(world, tp_group, pp_group)


def model_parallel_is_initialized() -> bool:
    return _GROUPS is not None


def get_world_group() -> GroupCoordinator:
    return _GROUPS.world if _GROUPS is not None else GroupCoordinator.single("world")


def get_tp_group() -> GroupCoordinator:
    return _GROUPS.tp if _GROUPS is not None else GroupCoordinator.single("tp")


def get_pp_group() -> GroupCoordinator:
    return _GROUPS.pp if _GROUPS is not None else GroupCoordinator.single("pp")


def destroy_model_parallel() -> None:
    global _GROUPS
    if _GROUPS is not None:
        for g in (_GROUPS.tp, _GROUPS.pp, _GROUPS.world):
            g.destroy()
    _GROUPS = None


def destroy_distributed_environment() -> None:
    """Destroy the groups and leave torch.distributed (safe to call when never initialised)."""
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
