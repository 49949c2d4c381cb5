"""The Worker: one rank's model shard, KV cache and ModelRunner on one device.

With tensor parallelism each rank holds its share of every layer's heads and features and its
own heads' KV cache; with pipeline parallelism a rank holds a contiguous stage of layers, takes
the previous stage's hidden states and sends its own on. Every rank gets the same
ExecuteModelRequest and builds the same flat batch; the last stage's TP rank 0 (the output rank)
returns the sampled tokens, the others return None.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from pagedlm import huge_pages, kernels
from pagedlm.config import EngineConfig
from pagedlm.distributed import (IntermediateTensors, default_backend,
                                 ensure_model_parallel_initialized, get_pp_group, get_tp_group,
                                 init_distributed_environment)
from pagedlm.distributed.parallel_state import destroy_distributed_environment
from pagedlm.lora.request import LoRARequest
from pagedlm.lora.worker_manager import WorkerLoRAManager
from pagedlm.model_executor.model_loader.loader import get_model
from pagedlm.model_io import ExecuteModelRequest, LoRAStats, ModelRunnerOutput
from pagedlm.utils import available_memory_bytes, cdiv
from pagedlm.spec_decode.draft_config import draft_model_config
from pagedlm.spec_decode.draft_model import DraftModelProposer
from pagedlm.spec_decode.ngram import NgramProposer
from pagedlm.worker.cache_engine import CacheEngine, kv_bytes_per_block
from pagedlm.worker.cuda_graph import capture_cuda_graphs
from pagedlm.worker.malloc_tuning import (keep_freed_memory, map_each_weight,
                                          release_freed_memory)
from pagedlm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:

    def __init__(self, config: EngineConfig, eos_token_ids: frozenset[int], rank: int = 0,
                 local_rank: int = 0, distributed_init_method: str | None = None) -> None:
        self.config = config
        self.model_config = config.model_config
        self.cache_config = config.cache_config
        self.eos_token_ids = eos_token_ids
        self.rank = rank
        self.local_rank = local_rank
        self.distributed_init_method = distributed_init_method
        self.model: torch.nn.Module | None = None
        self.runner: ModelRunner | None = None
        self.proposer = None  # speculative decoding's (load_model builds it)
        self.cache_engine: CacheEngine | None = None
        # This worker's device: cuda:<local_rank> with several workers on CUDA, else the
        # configured one (DeviceConfig.worker_device).
        self.device = config.device_config.worker_device(
            local_rank, config.parallel_config.world_size)

    # -- start-up -----------------------------------------------------------------------------
    def init_device(self) -> None:
        """Keep freed memory for the next step's tensors (malloc_tuning.py), pin this worker's
        threads, make its GPU current (CUDA) and join the process groups (only with several
        workers: NCCL for the device groups on CUDA, gloo on the CPU)."""
        pc = self.config.parallel_config
        if self.device.type == "cuda":
            # Before any CUDA call, so that every allocation and stream of this process is on
            # its own GPU.
            torch.cuda.set_device(self.device)
        keep_freed_memory()
        if pc.threads_per_worker:
            torch.set_num_threads(pc.threads_per_worker)
            os.environ["OMP_NUM_THREADS"] = str(pc.threads_per_worker)
        if pc.world_size > 1:
            init_distributed_environment(pc.world_size, self.rank, self.distributed_init_method,
                                         self.local_rank, default_backend(self.device))
            ensure_model_parallel_initialized(pc.tensor_parallel_size,
                                              pc.pipeline_parallel_size)

    def load_model(self) -> None:
        t = time.perf_counter()
        mc = self.model_config
        # Only 2-byte checkpoints free their plain weights while loading (packed as they
        # arrive), so only they map each weight on its own (malloc_tuning.py). For the others
        # it made every load fault its weights in afresh instead of reusing the heap a previous
        # model in the process had freed: a further default-model LLM() in one process took
        # 0.9-1.1 s and 245-275k page faults against 0.5-0.7 s and 42-70k.
        if mc.quantization is None and mc.dtype in (torch.bfloat16, torch.float16):
            map_each_weight()
        self.model = get_model(mc, self.device)
        if self.device.type == "cpu":  # every decode step streams the panels (huge_pages.py)
            huge_pages.gather_panels(self.model, release=release_freed_memory)
        write = getattr(self.model, "panel_cache_write", None)
        if write is not None:  # the panels for the next load, written while this one serves
            del self.model.panel_cache_write
            write.start()
        # What loading freed goes back before the KV cache is sized from the memory available,
        # and the settings for steps replace those for loading (malloc_tuning.py).
        release_freed_memory()
        keep_freed_memory()
        logger.info("rank %d: model weights loaded in %.2fs", self.rank,
                    time.perf_counter() - t)
        # Build (first run only) and load the native attention kernel now rather than in the
        # middle of the first request; without a compiler this warns and falls back. A CUDA
        # model runs none of them.
        if self.device.type == "cpu":
            kernels.available()
        self.lora_manager = None
        lc = self.config.lora_config
        if lc is not None:
            self.lora_manager = WorkerLoRAManager(
                self.model, lc.max_loras, lc.max_lora_rank, lc.max_cpu_loras,
                pipeline_parallel=self.config.parallel_config.pipeline_parallel_size > 1,
                deterministic=self.model_config.deterministic)
        self.proposer = self._build_proposer()
        self.runner = ModelRunner(self.model_config, self.model, self.cache_config.block_size,
                                  self.eos_token_ids, self.lora_manager, self.proposer)

    def _build_proposer(self):
        """Speculative decoding's proposer, or None."""
        sc = self.config.speculative_config
        if sc is None:
            return None
        if sc.method == "ngram":
            return NgramProposer(sc)
        # A draft model (one worker only: EngineConfig refuses it with TP/PP). Its KV pool is
        # sized with the target's in initialize_cache.
        draft_config = draft_model_config(sc.model, self.model_config)
        return DraftModelProposer(draft_config, self.cache_config, 0, self.device)

    def _kv_shape(self) -> tuple[int, int]:
        """This rank's KV heads and layers."""
        tp, pp = get_tp_group(), get_pp_group()
        return (self.model_config.get_num_kv_heads(tp.world_size),
                self.model_config.get_num_layers(pp.world_size, pp.rank_in_group))

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, host blocks) this rank can hold; the executor takes the minimum."""
        cc, sc = self.cache_config, self.config.scheduler_config
        per_block = kv_bytes_per_block(self.model_config, cc.block_size, *self._kv_shape(),
                                       dtype=cc.kv_dtype(self.model_config.dtype))
        # A draft model's pool has as many blocks as the target's.
        per_block += getattr(self.proposer, "kv_bytes_per_block", 0)
        num_cpu_blocks = cc.swap_space_bytes // per_block
        if self.device.type == "cuda":
            return self._num_cuda_blocks(per_block), num_cpu_blocks
        if cc.reserves_memory:
            # An explicit size is committed at start-up: past the free RAM it would meet the
            # OOM killer there instead of this message.
            if cc.num_gpu_blocks_override is not None:
                field, blocks = "num_gpu_blocks_override", cc.num_gpu_blocks_override
            else:
                field, blocks = "kv_cache_memory_bytes", cc.kv_cache_memory_bytes // per_block
            free = available_memory_bytes()
            if blocks * per_block > free:
                raise ValueError(f"{field}: {blocks} KV blocks take {blocks * per_block} bytes, "
                                 f"more than the {free} bytes of memory available")
            return blocks, num_cpu_blocks
        # A share of the memory free now, but no more than the longest possible batch needs.
        # Workers on one node share its memory.
        budget = int(available_memory_bytes() * cc.gpu_memory_utilization
                     / self.config.parallel_config.world_size)
        max_tokens = sc.max_num_seqs * sc.max_model_len
        return min(budget // per_block, cdiv(max_tokens, cc.block_size)), num_cpu_blocks

    def _num_cuda_blocks(self, per_block: int) -> int:
        """Blocks of this GPU's KV pool: the explicit size, or gpu_memory_utilization of the
        GPU memory free after the model is loaded, less a headroom for a step's activations
        (the widest step's logits in float32, and its hidden and MLP rows a few times over;
        CUDA graphs and the allocator's fragmentation take the rest of 1 - utilization)."""
        cc, sc, mc = self.cache_config, self.config.scheduler_config, self.model_config
        torch.cuda.synchronize(self.device)
        free, _total = torch.cuda.mem_get_info(self.device)
        if cc.reserves_memory:
            if cc.num_gpu_blocks_override is not None:
                field, blocks = "num_gpu_blocks_override", cc.num_gpu_blocks_override
            else:
                field, blocks = "kv_cache_memory_bytes", cc.kv_cache_memory_bytes // per_block
            if blocks * per_block > free:
                raise ValueError(f"{field}: {blocks} KV blocks take {blocks * per_block} bytes, "
                                 f"more than the {free} bytes free on {self.device}")
            return blocks
        tokens = sc.max_num_batched_tokens
        width = max(mc.hidden_size, mc.get_hf("intermediate_size", mc.hidden_size))
        elem = torch.empty((), dtype=mc.compute_dtype).element_size()
        headroom = tokens * (4 * mc.vocab_size + 8 * width * elem)
        budget = int(free * cc.gpu_memory_utilization) - headroom
        if budget < per_block:
            raise ValueError(f"gpu_memory_utilization={cc.gpu_memory_utilization}: {free} bytes "
                             f"free on {self.device} leave no room for a KV block after "
                             f"{headroom} bytes of activations (max_num_batched_tokens="
                             f"{tokens}); raise it or lower max_num_batched_tokens")
        max_tokens = sc.max_num_seqs * sc.max_model_len
        return min(budget // per_block, cdiv(max_tokens, cc.block_size))

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int = 0) -> None:
        self.cache_engine = CacheEngine(self.model_config, self.cache_config, num_gpu_blocks,
                                        num_cpu_blocks, *self._kv_shape(), device=self.device)
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.initialize_cache(num_gpu_blocks)
        # The graphs write into this cache, so they are captured once it exists.
        self.runner.cuda_graphs = capture_cuda_graphs(
            self.config, self.model, self.cache_engine.kv_caches, self.runner.device,
            has_lora=self.lora_manager is not None)

    # -- each step ----------------------------------------------------------------------------
    def execute_model(self, req: ExecuteModelRequest) -> ModelRunnerOutput | None:
        # Swap-outs first: the blocks they vacate may be written this very step.
        self.cache_engine.swap_out(req.blocks_to_swap_out)
        self.cache_engine.swap_in(req.blocks_to_swap_in)
        self.cache_engine.copy_blocks(req.blocks_to_copy)
        if not req.has_work:
            self.runner.update_states(req)  # drop finished requests all the same
            return None
        tp, pp = get_tp_group(), get_pp_group()
        comm_before = tp.comm_s + pp.comm_s
        intermediate = None
        if not pp.is_first_rank:
            intermediate = IntermediateTensors.from_dict(pp.recv_tensor_dict())
        output = self.runner.execute_model(req, self.cache_engine.kv_caches, intermediate)
        if isinstance(output, IntermediateTensors):
            pp.send_tensor_dict(output.to_dict())
            return None
        output.timings.comm_s = tp.comm_s + pp.comm_s - comm_before
        return output if tp.is_first_rank else None

    # -- LoRA adapters --------------------------------------------------------------------------
    def add_lora(self, req: LoRARequest, protected: frozenset[int] = frozenset()
                 ) -> str | None:
        """Load (and validate) an adapter now rather than in a step, evicting none of
        `protected`: its error message, or None. Returned, not raised, as a raising worker stops
        the executor."""
        try:
            self.lora_manager.add_adapter(req, protected)
        except ValueError as e:
            return str(e)
        return None

    def remove_lora(self, lora_id: int) -> bool:
        return self.lora_manager.remove_adapter(lora_id)

    def lora_stats(self) -> LoRAStats:
        return self.lora_manager.get_stats()

    def shutdown(self) -> None:
        destroy_distributed_environment()
