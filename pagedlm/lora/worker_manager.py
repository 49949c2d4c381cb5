"""The worker's side of LoRA: loads adapters by id from their path (each TP rank its own
slices), keeps up to `max_cpu_loras` of them prepared, evicting the least recently used, and
puts each step's adapters into the device slots."""
from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from pagedlm.lora.models import LoRAModel, LoRAModelManager, SlotWeights
from pagedlm.lora.request import LoRARequest
from pagedlm.model_io import LoRAStats


class WorkerLoRAManager:

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, pipeline_parallel: bool = False,
                 deterministic: bool = False) -> None:
        self.max_cpu_loras = max_cpu_loras
        self.max_lora_rank = max_lora_rank
        self.manager = LoRAModelManager(model, max_loras, max_lora_rank, pipeline_parallel,
                                        deterministic)
        self._cache: OrderedDict[int, tuple[LoRARequest, SlotWeights]] = OrderedDict()
        self.stats = LoRAStats()

    @property
    def batch(self):
        return self.manager.batch

    def add_adapter(self, req: LoRARequest, protected: frozenset[int] = frozenset()) -> None:
        """Load and validate `req` unless cached (ValueError naming what is wrong; nothing is
        kept then). Evicts the least recently used adapters not in `protected` past
        max_cpu_loras."""
        cached = self._cache.get(req.lora_int_id)
        if cached is not None:
            if cached[0].lora_path != req.lora_path:
                raise ValueError(f"lora_int_id {req.lora_int_id} is already used for "
                                 f"{cached[0].lora_path!r}, not {req.lora_path!r}.")
            self._cache.move_to_end(req.lora_int_id)
            return
        lora = LoRAModel.from_local_checkpoint(req.lora_path, req.lora_int_id,
                                               self.max_lora_rank)
        prepared = self.manager.prepare(lora)
        self.stats.num_loads += 1
        self._cache[req.lora_int_id] = (req, prepared)
        for lora_id in list(self._cache):
            if len(self._cache) <= self.max_cpu_loras:
                break
            if lora_id not in protected and lora_id != req.lora_int_id:
                self._evict(lora_id)
                self.stats.num_evictions += 1

    def remove_adapter(self, lora_id: int) -> bool:
        if lora_id not in self._cache:
            return False
        self._evict(lora_id)
        return True

    def _evict(self, lora_id: int) -> None:
        del self._cache[lora_id]
        self.manager.deactivate(lora_id)

    def set_active_loras(self, token_loras: list[LoRARequest | None],
                         token_counts: list[int], device: torch.device) -> None:
        """The step's adapters: token_loras[i] runs token_counts[i] consecutive tokens of the
        flat batch (None: the base model)."""
        needed = {r.lora_int_id: r for r in token_loras if r is not None}
        if not needed:
            self.manager.batch.set(None)
            return
        for req in needed.values():
            self.add_adapter(req, protected=frozenset(needed))  # reload if evicted
        slots = self.manager.set_active_loras(
            {i: self._cache[i][1] for i in needed})
        for i in needed:
            self._cache.move_to_end(i)
        per_seq = torch.tensor([slots[r.lora_int_id] if r is not None else -1
                                for r in token_loras], device=device)
        self.manager.batch.set(torch.repeat_interleave(
            per_seq, torch.tensor(token_counts, device=device)))

    def get_stats(self) -> LoRAStats:
        s = self.stats
        return LoRAStats(s.num_loads, s.num_evictions, self.manager.num_slot_loads,
                         list(self._cache), list(self.manager.slot_ids))
