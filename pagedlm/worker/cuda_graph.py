"""CUDA graphs for pure decode steps, captured at padded batch sizes as vLLM captures them.

A decode step of a small model on a GPU is launch-bound: hundreds of small kernels, each a few
microseconds of CPU work to launch, for a few microseconds of GPU work. A CUDA graph records a
step's launches once and replays them with one call, so the CPU no longer sets the pace.

A graph replays fixed kernels on fixed memory, so the step's inputs live in static buffers
(StaticDecodeBatch) that each step copies into, and a step of n rows runs the graph of the
smallest capture size >= n, the rows past n being padding that touches nothing: slot -1 (the
KV-cache write skips it), sequence length 0 (decode attention returns zeros for it), token 0
and position 0 (valid lookups). The graph's output is its own tensor in the graphs' memory
pool; rows [:n] are the step's hidden states, valid until the next replay.

What runs inside a graph must not depend on host values that differ between the capture and a
replay: the model sees the padded size (num_decode_tokens, the buffers' shapes) and block
tables of the widest width a sequence can need, cdiv(max_model_len, block_size), whatever the
step; the decode attention bounds its loops by the sequence lengths it loads on the device.
Nothing in the decode path may synchronise with the host (.item(), .tolist(), a host copy).
Only the Triton attention backend promises both (and the padding rows' semantics), so the
others run eagerly.

Eligible steps: a CUDA device, enforce_eager off, pure decode (speculative verification rows
are decode rows), at most the largest capture size, no LoRA (its per-step adapter indices are
not in the buffers), one rank (pipeline stages exchange hidden states on the host side; NCCL
calls inside graphs are not set up). Anything else runs eagerly, with the same values.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch

from pagedlm.attention.layer import Attention
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.config import EngineConfig
from pagedlm.utils import cdiv

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]

# Backends whose decode path is graph-safe (no host sync, grid from shapes only) and that skip
# slot -1 and return zeros for sequence length 0 (the padding rows).
GRAPH_SAFE_BACKENDS = frozenset({"triton"})

# Eager runs per size before its capture: the first compiles the Triton kernels for the size's
# shapes and moves lazily placed tables (rotary) to the device; the second runs as a replay
# will, with everything in place (torch's docs warm up on a side stream the same way).
_WARMUP_RUNS = 2


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to max_num_seqs (vLLM's list, capped), and
    max_num_seqs itself when it is not on the list, so that every decode batch of up to
    max_num_seqs rows has a graph."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def padded_size(num_rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest capture size >= num_rows (sizes ascending), or None: run eagerly."""
    if num_rows < 1:
        return None
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


def attention_backend_names(model: torch.nn.Module) -> set[str]:
    return {m.backend.name for m in model.modules() if isinstance(m, Attention)}


def graphs_off_reason(config: EngineConfig, model: torch.nn.Module, device: torch.device,
                      has_lora: bool) -> str | None:
    """Why this worker's decode steps run eagerly, or None: capture graphs. Checked once."""
    mc, pc = config.model_config, config.parallel_config
    if mc.enforce_eager:
        return "enforce_eager=True"
    if has_lora:
        return "LoRA adapters choose their weights per step"
    if pc.pipeline_parallel_size > 1 or pc.tensor_parallel_size > 1:
        return "more than one rank (pipeline or tensor parallelism)"
    if mc.runner == "pooling":
        return "a pooling model has no decode steps"
    if device.type != "cuda":
        return f"device {device.type} (CUDA graphs need a CUDA device)"
    names = attention_backend_names(model)
    if not names or not names <= GRAPH_SAFE_BACKENDS:
        return (f"attention backend {', '.join(sorted(names)) or 'none'} is not graph-safe "
                f"({', '.join(sorted(GRAPH_SAFE_BACKENDS))} is)")
    return None


class StaticDecodeBatch:
    """The inputs of a decode step of up to max_rows rows, in buffers that stay put, and the
    padding of a step to a capture size. Rows [0, dirty) may hold a real step's values, the
    rest are padding rows; only rows that held a step and are now past it are re-padded."""

    def __init__(self, max_rows: int, block_table_width: int, device: torch.device) -> None:
        self.max_rows, self.block_table_width = max_rows, block_table_width
        self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        # A padding row's table is never read (length 0); real rows read only the columns
        # their length needs, so columns past a step's width may keep older values.
        self.block_tables = torch.zeros(max_rows, block_table_width, dtype=torch.int32,
                                        device=device)
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.dirty = 0

    def metadata(self, size: int) -> AttentionMetadata:
        """A decode step of `size` rows over the buffers (a new object: backends cache
        per-step work on it)."""
        return AttentionMetadata(slot_mapping=self.slot_mapping[:size], num_decode_tokens=size,
                                 decode_block_tables=self.block_tables[:size],
                                 decode_mask=None, prefills=[],
                                 decode_seq_lens=self.seq_lens[:size])

    def fits(self, num_rows: int, meta: AttentionMetadata) -> bool:
        """Whether a step is a pure decode step these buffers can hold."""
        tables = meta.decode_block_tables
        return (not meta.prefills and meta.num_decode_tokens == num_rows
                and 0 < num_rows <= self.max_rows and tables is not None
                and meta.decode_seq_lens is not None and tables.dim() == 2
                and tables.shape[1] <= self.block_table_width)

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata) -> None:
        """Copy a step's n rows in (device to device, on the current stream) and make the
        rows past them padding."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.decode_seq_lens)
        tables = meta.decode_block_tables
        self.block_tables[:n, :tables.shape[1]].copy_(tables)
        if n < self.dirty:
            self.input_ids[n:self.dirty].zero_()
            self.positions[n:self.dirty].zero_()
            self.slot_mapping[n:self.dirty].fill_(-1)
            self.seq_lens[n:self.dirty].zero_()
        self.dirty = n


class CUDAGraphRunner:
    """The model's forward for pure decode steps, one CUDA graph per capture size.

    capture() records them (after the KV cache exists: the graphs write into it); run()
    replays the graph of a step's padded size. `replays` counts the steps that ran a graph."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], sizes: Sequence[int],
                 block_table_width: int, device: torch.device) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        # The graphs write into these caches' memory: a step over any other cache runs eagerly.
        self._cache_ptr = kv_caches[0][0].data_ptr()
        self.sizes = sorted(sizes)
        self.batch = StaticDecodeBatch(self.sizes[-1], block_table_width, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Kept alive with their graphs: each graph reads its metadata's views and writes
        # its output, which must not be handed to a later capture's allocations.
        self._metas: dict[int, AttentionMetadata] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0
        self.capture_s = 0.0  # seconds capture() took (warm-up runs included)

    def forward_static(self, size: int, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """The model on the buffers' first `size` rows: what a graph of that size records."""
        b = self.batch
        return self.model(b.input_ids[:size], b.positions[:size], self.kv_caches,
                          meta if meta is not None else b.metadata(size))

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        with torch.cuda.device(self.device):
            self._capture_all()
        self.capture_s = time.perf_counter() - t0
        logger.info("captured CUDA graphs for %d decode batch sizes (%s) in %.2fs",
                    len(self.sizes), ", ".join(map(str, self.sizes)), self.capture_s)

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()  # one pool: the graphs never run at once
        side = torch.cuda.Stream(device=self.device)
        # Largest first, so the smaller graphs fit in the memory the larger ones freed.
        for size in reversed(self.sizes):
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(_WARMUP_RUNS):
                    self.forward_static(size)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            meta = self.batch.metadata(size)  # fresh: nothing cached on it by a warm-up run
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward_static(size, meta)
            self.graphs[size], self._metas[size], self._outputs[size] = graph, meta, out
        torch.cuda.synchronize(self.device)

    def size_for(self, num_rows: int, kv_caches: list[KVCache],
                 meta: AttentionMetadata) -> int | None:
        """The graph a step runs (its padded size), or None: run it eagerly."""
        if (not kv_caches or kv_caches[0][0].data_ptr() != self._cache_ptr
                or not self.batch.fits(num_rows, meta)):
            return None
        size = padded_size(num_rows, self.sizes)
        return size if size in self.graphs else None

    def run(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states [n, hidden] through the graph of `size` (from size_for)."""
        self.batch.load(input_ids, positions, meta)
        self.graphs[size].replay()
        self.replays += 1
        return self._outputs[size][:input_ids.shape[0]]


def capture_cuda_graphs(config: EngineConfig, model: torch.nn.Module,
                        kv_caches: list[KVCache], device: torch.device,
                        has_lora: bool) -> CUDAGraphRunner | None:
    """The worker's graph runner, captured, or None (the reason is logged)."""
    reason = graphs_off_reason(config, model, device, has_lora)
    if reason is not None:
        log = logger.debug if device.type != "cuda" else logger.info
        log("CUDA graphs off: %s", reason)
        return None
    sc, block_size = config.scheduler_config, config.cache_config.block_size
    runner = CUDAGraphRunner(model, kv_caches, capture_sizes(sc.max_num_seqs),
                             cdiv(sc.max_model_len, block_size), device)
    try:
        runner.capture()
    except RuntimeError:
        # Something in the decode path cannot be captured (a host sync, an allocation the
        # capture refuses): the engine still serves, eagerly, and says why.
        logger.warning("CUDA graph capture failed; decode steps run eagerly", exc_info=True)
        return None
    return runner
