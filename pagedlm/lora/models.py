"""PEFT adapters (LoRAModel) and the LoRA layers and device slots of one model (LoRAModelManager).

Which modules can take an adapter is read off the model itself, not written per architecture:
every parallel linear layer (layers.lora_layer_class) can, under its own name (o_proj,
down_proj, a checkpoint-fused qkv_proj) or under the checkpoint names its `stacked_params` fold
into it (q_proj -> qkv_proj shard "q"), as vLLM's packed_modules_mapping.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

from pagedlm.lora.layers import BaseLayerWithLoRA, LoRABatch, lora_layer_class

_CONFIG = "adapter_config.json"
_SAFETENSORS = "adapter_model.safetensors"
_BIN = "adapter_model.bin"


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past any float (JSON allows 10**400)
        return False


@dataclass
class LoRAModel:
    """One adapter as read from disk: checkpoint module path -> (A [r, in], B [out, r]), with B
    already multiplied by the scaling (alpha / r, or alpha / sqrt(r) with rslora), so the layers
    only add x A^T B^T."""
    lora_id: int
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def from_local_checkpoint(cls, path: str, lora_id: int, max_lora_rank: int) -> "LoRAModel":
        if not os.path.isdir(path):
            raise ValueError(f"lora_path {path!r} is not a directory.")
        cfg_file = os.path.join(path, _CONFIG)
        if not os.path.isfile(cfg_file):
            raise ValueError(f"lora_path {path!r} has no {_CONFIG}: not a PEFT adapter.")
        try:
            with open(cfg_file) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
            raise ValueError(f"lora_path {path!r}: cannot read {_CONFIG}: {e}") from None
        except RecursionError:
            raise ValueError(f"lora_path {path!r}: {_CONFIG} is nested too deeply.") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"lora_path {path!r}: {_CONFIG} must hold a JSON object, got "
                             f"{type(cfg).__name__}.")
        if cfg.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"lora_path {path!r}: peft_type {cfg.get('peft_type')!r} is not "
                             f"supported (only LORA).")
        if cfg.get("use_dora") not in (None, False):
            raise ValueError(f"lora_path {path!r}: use_dora={cfg['use_dora']!r} is not "
                             f"supported.")
        if cfg.get("bias", "none") not in ("none", None):
            raise ValueError(f"lora_path {path!r}: bias={cfg['bias']!r} is not supported "
                             f"(only 'none').")
        if cfg.get("modules_to_save"):
            raise ValueError(f"lora_path {path!r}: modules_to_save {cfg['modules_to_save']} is "
                             f"not supported (target modules only).")
        if cfg.get("alpha_pattern"):
            raise ValueError(f"lora_path {path!r}: alpha_pattern is not supported.")
        rank = cfg.get("r")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise ValueError(f"lora_path {path!r}: rank r={rank!r} is not a positive integer.")
        alpha = cfg.get("lora_alpha", rank)
        # A NaN or infinite scaling would reach every token of a step, as a bad weight would.
        if (not isinstance(alpha, (int, float)) or isinstance(alpha, bool)
                or not _finite(alpha)):
            raise ValueError(f"lora_path {path!r}: lora_alpha={alpha!r} is not a finite number.")
        use_rslora = cfg.get("use_rslora", False)
        if not isinstance(use_rslora, bool):
            raise ValueError(f"lora_path {path!r}: use_rslora={use_rslora!r} is not a boolean.")
        tensors = cls._read_tensors(path)

        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            for kind in ("lora_A", "lora_B"):
                marker = f".{kind}."
                if marker in key:
                    module = key.split(marker, 1)[0].removeprefix("base_model.model.")
                    pairs.setdefault(module, {})[kind] = tensor
                    break
            else:
                raise ValueError(f"lora_path {path!r}: tensor {key!r} is not a lora_A / lora_B "
                                 f"weight (embedding adapters and extra modules are not "
                                 f"supported).")
            # A NaN or infinity would reach every token of a step: the slots' deltas are
            # computed together, and 0 x inf is NaN (layers.py).
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise ValueError(f"lora_path {path!r}: tensor {key!r} holds NaN or infinite "
                                 f"values.")
        if not pairs:
            raise ValueError(f"lora_path {path!r}: the adapter has no LoRA weights.")
        weights = {}
        max_rank = 0
        for module, pair in pairs.items():
            if set(pair) != {"lora_A", "lora_B"}:
                raise ValueError(f"lora_path {path!r}: module {module!r} lacks "
                                 f"{({'lora_A', 'lora_B'} - set(pair)).pop()}.")
            a, b = pair["lora_A"], pair["lora_B"]
            r = a.shape[0]  # rank_pattern may give a module its own rank
            if r < 1:
                raise ValueError(f"lora_path {path!r}: module {module!r} has rank 0.")
            max_rank = max(max_rank, r)
            scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
            scaled = b.float() * scaling
            if not torch.isfinite(scaled).all():  # a huge alpha overflows float32
                raise ValueError(f"lora_path {path!r}: module {module!r}: lora_B times the "
                                 f"scaling ({scaling:g}) overflows float32.")
            weights[module] = (a.float(), scaled)
        if max_rank > max_lora_rank:
            raise ValueError(f"lora_path {path!r}: rank {max_rank} is larger than max_lora_rank "
                             f"({max_lora_rank}).")
        return cls(lora_id, max_rank, weights)

    @staticmethod
    def _read_tensors(path: str) -> dict[str, torch.Tensor]:
        st, binf = os.path.join(path, _SAFETENSORS), os.path.join(path, _BIN)
        try:
            if os.path.isfile(st):
                from safetensors.torch import load_file
                return load_file(st)
            if os.path.isfile(binf):
                # weights_only: a pickled adapter must not be able to run code.
                return torch.load(binf, map_location="cpu", weights_only=True)
        except Exception as e:  # a corrupt file: any of several libraries' errors
            raise ValueError(f"lora_path {path!r}: cannot read the adapter weights: {e}") from None
        raise ValueError(f"lora_path {path!r} has neither {_SAFETENSORS} nor {_BIN}.")


# A prepared adapter: LoRA layer name -> this rank's slot content (A, B^T).
SlotWeights = dict[str, tuple[torch.Tensor, torch.Tensor]]


class LoRAModelManager:
    """Replaces the model's supported layers with LoRA layers and owns their `max_loras` device
    slots. `prepare` turns a LoRAModel into this rank's slot content (validated against the base
    model); `set_active_loras` puts the step's adapters into slots."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int,
                 pipeline_parallel: bool = False, deterministic: bool = False) -> None:
        self.model = model
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        # With pipeline stages a valid adapter names layers this rank does not have.
        self.pipeline_parallel = pipeline_parallel
        self.batch = LoRABatch(max_loras, deterministic)
        self.layers: dict[str, BaseLayerWithLoRA] = {}
        for name, module in list(model.named_modules()):
            cls = lora_layer_class(module)
            if cls is not None:
                self.layers[name] = cls(module, self.batch, max_lora_rank)
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr,
                        self.layers[name])
        own = {name.rpartition(".")[2] for name in self.layers}
        # checkpoint module name -> (our layer's name, shard id), as the loader folds them.
        self.packed = {frag: tuple(target) for frag, target in
                       getattr(model, "stacked_params", {}).items() if target[0] in own}
        self.supported = sorted(own | set(self.packed))
        self.slot_ids: list[int | None] = [None] * max_loras
        self._slot_used = [0] * max_loras
        self._clock = 0
        self.num_slot_loads = 0

    # -- adapters -> slot content ---------------------------------------------------------------
    def _layer_for(self, module: str) -> tuple[str | None, object]:
        """(our LoRA layer's name or None if not on this rank, shard id) for a checkpoint
        module path; ValueError for a module kind no layer supports."""
        prefix, _, leaf = module.rpartition(".")
        target, shard = self.packed.get(leaf, (leaf, None))
        if target not in {n.rpartition(".")[2] for n in self.layers}:
            raise ValueError(f"target module {leaf!r} ({module}) is not supported for LoRA; "
                             f"supported modules: {', '.join(self.supported)}.")
        parts = f"{prefix}.{target}".split(".") if prefix else [target]
        for i in range(len(parts)):
            name = ".".join(parts[i:])
            if name in self.layers:
                return name, shard
        if self.pipeline_parallel:
            return None, shard
        raise ValueError(f"target module {module!r} has no counterpart in the base model.")

    def prepare(self, lora: LoRAModel) -> SlotWeights:
        grouped: dict[str, dict[object, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, ab in lora.weights.items():
            name, shard = self._layer_for(module)
            if name is None:
                continue
            shards = grouped.setdefault(name, {})
            if (shard is None and shards) or None in shards:
                raise ValueError(f"target module {module!r}: the adapter targets {name} both "
                                 f"whole and by its parts.")
            shards[shard] = ab
        return {name: self.layers[name].slice_weights(name, shards)
                for name, shards in grouped.items()}

    # -- slots ----------------------------------------------------------------------------------
    def set_active_loras(self, needed: dict[int, SlotWeights]) -> dict[int, int]:
        """Put every adapter of the step (lora id -> its slot content) into a slot, replacing the
        least recently used ones the step does not need; lora id -> slot."""
        assert len(needed) <= self.max_loras, "the scheduler admits at most max_loras adapters"
        self._clock += 1
        slots = {}
        for lora_id in needed:
            if lora_id in self.slot_ids:
                slots[lora_id] = self.slot_ids.index(lora_id)
        for lora_id, weights in needed.items():
            if lora_id in slots:
                continue
            free = [s for s in range(self.max_loras) if s not in slots.values()]
            # Lowest free slots first, so the step's slots stay a short prefix (LoRABatch).
            slot = min(free, key=lambda s: (self.slot_ids[s] is not None, self._slot_used[s], s))
            self._write_slot(slot, lora_id, weights)
            slots[lora_id] = slot
        for s in slots.values():
            self._slot_used[s] = self._clock
        return slots

    def deactivate(self, lora_id: int) -> None:
        if lora_id in self.slot_ids:
            self._write_slot(self.slot_ids.index(lora_id), None, None)

    def _write_slot(self, slot: int, lora_id: int | None, weights: SlotWeights | None) -> None:
        # Empty until every layer is written: a Ctrl-C midway left the slot half zeroed (an
        # eviction) or half loaded, still marked as its adapter, which then ran on it (wrong
        # tokens, for good).
        self.slot_ids[slot] = None
        for name, layer in self.layers.items():
            layer.set_slot(slot, None if weights is None else weights.get(name))
        self.slot_ids[slot] = lora_id
        if lora_id is not None:
            self.num_slot_loads += 1
