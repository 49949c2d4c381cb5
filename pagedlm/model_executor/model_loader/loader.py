"""Build a model from its config and load its safetensors weights (this rank's part of them)."""
from __future__ import annotations

import contextlib
import functools
import logging

import torch
from torch import nn

from pagedlm import panel_cache
from pagedlm.attention.backends import get_attn_backend
from pagedlm.config import ModelConfig
from pagedlm.distributed.parallel_state import get_pp_group, get_tp_group
from pagedlm.kernels import gemv
from pagedlm.model_executor.layers.linear_method import (LinearMethodBase, panels_in_arena,
                                                         use_deterministic_linear_methods,
                                                         weights_on_meta)
from pagedlm.model_executor.layers.quantization import get_quantization_config
from pagedlm.model_executor.layers.quantization.base import weight_formats
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.model_executor.model_loader.model_path import ensure_float_weights
from pagedlm.model_executor.model_loader.weight_utils import iterate_safetensors
from pagedlm.model_executor.models.registry import get_model_class
from pagedlm.utils import dtype_name

__all__ = ["get_model", "iterate_safetensors"]

logger = logging.getLogger(__name__)


def get_model(config: ModelConfig, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model for this process's rank, loaded and ready.

    Tensor- and pipeline-parallel ranks come from the groups of
    pagedlm.distributed.parallel_state (size 1 when none were initialised): each rank builds
    only its heads, features and layers, and loads its slices of the full checkpoint tensors.
    """
    cls = get_model_class(config.architecture)
    quant_config = get_quantization_config(config.quantization, config.model_dir,
                                           deterministic=config.deterministic)
    # Chosen once, for every layer, for the queries' dtype (float32 whatever the weights').
    attn_backend = get_attn_backend(config.compute_dtype, device,
                                    deterministic=config.deterministic)
    old = torch.get_default_dtype()
    # Built to compute in float32; store_weights_in then narrows the matrices to config.dtype.
    torch.set_default_dtype(config.compute_dtype)
    try:
        # Built in place: every weight is created with torch.empty (nothing is initialised just
        # to be overwritten) and each parameter keeps its weight_loader attribute and ties,
        # which moving from the meta device with to_empty() would drop.
        with torch.device(device), contextlib.ExitStack() as stack:
            if quant_config is not None and quant_config.weights_from_file:
                stack.enter_context(weights_on_meta())
            model = cls(config, attn_backend)
    finally:
        torch.set_default_dtype(old)
    if config.deterministic:
        use_deterministic_linear_methods(model)
    if quant_config is None or not quant_config.weights_from_file:
        ensure_float_weights(config.model_dir)  # a GGUF file's, written once
    weights = iterate_safetensors(config.model_dir)
    if quant_config is not None:
        quant_config.apply(model)
        weights = quant_config.weights(weights)
    materialize_weights(model, device)
    store_weights_in(model, config.dtype)
    process_as_loaded(model)
    mapped, write = _panels_from_cache(model, config, device)
    with panels_in_arena():  # and the panels processing packs (a tied LM head's)
        model.load_weights(weights)
        round_other_weights(model, config.dtype)
        model.process_weights_after_loading()
    if write is not None:
        model.panel_cache_write = write  # the worker starts it once the panels stay put
    if mapped is not None:
        logger.info("panels mapped from %s", mapped.path)
    if quant_config is not None:
        quant_config.process_weights_after_loading(model)
    if quant_config is not None:
        logger.info("quantization=%r: linear layers by weight format: %s",
                    config.quantization, dict(weight_formats(model)))
    return model.eval().requires_grad_(False)


def _panels_from_cache(model: nn.Module, config: ModelConfig, device: torch.device | str,
                       ) -> tuple[panel_cache.MappedPanels | None,
                                  panel_cache.PanelCacheWrite | None]:
    """The panels' file of this checkpoint (panel_cache.py) mapped and placed in the model's
    layers, or else the write that keeps them for the next load; (None, None) where the load
    does not qualify: one worker on the CPU, 2-byte weights from the checkpoint unquantized."""
    if (panel_cache.mode() == "off" or torch.device(device).type != "cpu"
            or config.quantization is not None
            or config.dtype not in (torch.bfloat16, torch.float16)
            or get_tp_group().world_size * get_pp_group().world_size != 1):
        return None, None
    # The layers whose panels loading packs as their rows arrive: the ones the file holds.
    layers = {name: module for name, module in model.named_modules()
              if isinstance(getattr(module, "linear_method", None), LinearMethodBase)
              and module.linear_method.process_when_loaded(module)}
    path = panel_cache.cache_file(config.model_dir, dtype_name(config.dtype))
    if not layers or path is None:
        return None, None
    # What decides the panels' bytes besides the checkpoint: the build's panel layout.
    layout = {"width": gemv.panel_width(), "bf16_pairs": gemv.bf16_pairs()}
    mapped = panel_cache.open_cached(path)
    if mapped is not None and _place_panels(mapped, layers, layout):
        return mapped, None
    if mapped is not None:
        logger.info("panels' file %s does not match the model: packing from the checkpoint",
                    path)
    return None, panel_cache.PanelCacheWrite(path, config.model_dir, layers, layout)


def _place_panels(mapped: panel_cache.MappedPanels, layers: dict[str, nn.Module],
                  layout: dict) -> bool:
    """Make each layer's panels its view of the file, marked `panels_mapped` so that its
    loader skips packing the checkpoint's rows (UnquantizedLinearMethod.put_rows); False, and
    no layer touched, unless the file holds exactly these layers' panels, in this build's
    layout and in the shape and dtype the kernel would pack them."""
    if mapped.layout != layout or set(mapped.entries) != set(layers):
        return False

    def meta(shape, dtype):
        return torch.empty(shape, dtype=dtype, device="meta")

    for name, module in layers.items():
        entry, weight = mapped.entries[name], module.weight
        expected = gemv.empty_panels(*weight.shape, weight.dtype, zeros=meta)
        if (expected is None or tuple(expected.shape) != entry.shape
                or dtype_name(weight.dtype) != entry.dtype):
            return False
    for name, module in layers.items():
        module.panel_weight = mapped.view(name)
        module.panels_mapped = True
    return True


def materialize_weights(model: nn.Module, device: torch.device | str) -> None:
    """Give real (uninitialised) storage to the weights built on the meta device
    (weights_on_meta) that no quantization method took to receive the file's tensors."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, old in list(module._parameters.items()):
            if old is None or not old.is_meta or getattr(old, "gguf_parts", None) is not None:
                continue
            if id(old) not in made:
                new = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device=device),
                                   requires_grad=False)
                new.__dict__.update(old.__dict__)  # weight_loader and the loaders' other marks
                made[id(old)] = new
            setattr(module, name, made[id(old)])


def _stored_in_dtype(module: nn.Module) -> bool:
    """Whether `module`'s weight is one of the matrices ModelConfig.dtype stores: a linear
    layer's (quantized ones too, before they pack it), an embedding table, the LM head."""
    return (isinstance(module, VocabParallelEmbedding)
            or isinstance(getattr(module, "linear_method", None), LinearMethodBase))


def store_weights_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Give the model's matrices (`_stored_in_dtype`) `dtype` parameters before loading, which
    rounds the checkpoint into them; the model was built in float32, its compute dtype. A
    parameter two modules share (an LM head tied to the embedding) stays one parameter. MoE
    experts stay float32 (round_other_weights): their matmuls run on float32 kernels."""
    if dtype == torch.float32:
        return
    narrowed: dict[int, nn.Parameter] = {}
    for module in model.modules():
        old = module._parameters.get("weight") if _stored_in_dtype(module) else None
        if old is None or old.dtype != torch.float32 or old.is_meta:
            continue
        if id(old) not in narrowed:
            new = nn.Parameter(torch.empty(old.shape, dtype=dtype, device=old.device),
                               requires_grad=False)
            new.__dict__.update(old.__dict__)  # weight_loader and the loaders' other marks
            narrowed[id(old)] = new
        module.weight = narrowed[id(old)]


def process_as_loaded(model: nn.Module) -> None:
    """Have each layer whose processing frees its plain weight (LinearMethodBase.
    process_when_loaded: a 2-byte weight packed into panels) processed as soon as the
    checkpoint has filled that weight (its `when_loaded`, which load_weights_into calls), not
    once the whole checkpoint is in, when every plain weight was resident at once and the
    panels grew beside them (1B bfloat16 Llama: 3.65 GiB load peak in LLM(), 2.0 GiB of it
    the weights; benchmarks/load_memory.py). A tied LM head then also gives the embedding's
    lookups to its panels and drops the table (look_up_from_panels). The model's own
    process_weights_after_loading still runs afterwards; it leaves a processed layer as is."""
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        if isinstance(method, LinearMethodBase) and method.process_when_loaded(module):
            module.weight.when_loaded = functools.partial(_process_loaded, module)


def _process_loaded(module: nn.Module) -> None:
    module.linear_method.process_weights_after_loading(module)
    if isinstance(module, ParallelLMHead):
        module.look_up_from_panels()


def round_other_weights(model: nn.Module, dtype: torch.dtype) -> None:
    """After loading: the float32 parameters store_weights_in left (norms, biases, position
    tables, MoE experts) keep float32 storage but hold their values rounded to `dtype`, so
    every weight of the model is the checkpoint in `dtype`, as transformers holds it."""
    if dtype == torch.float32:
        return
    for param in model.parameters():
        if param.dtype == torch.float32 and not param.is_meta:
            # In slices: a stack of experts is rounded without a second copy of it.
            for part in param.data.view(-1).split(1 << 22):
                part.copy_(part.to(dtype))
