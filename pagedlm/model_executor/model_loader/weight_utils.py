"""Reading checkpoint tensors and copying them into parameters.

Every parameter of a model carries a `weight_loader(param, loaded_weight, shard_id=None)`
attribute: the parallel layers' loaders take the FULL checkpoint tensor and copy the slice this
rank owns; `default_weight_loader` copies a whole tensor. A parameter may also carry
`when_loaded()`, called once the checkpoint has wholly filled it (loader.process_as_loaded).
Our GGUF files are converted to an HF safetensors directory first, so this one path serves
both formats.
"""
from __future__ import annotations

import glob
import os
from typing import Callable, Iterable, Iterator, Mapping

import torch
from safetensors import safe_open


class WeightShapeError(ValueError):
    """A checkpoint tensor of the wrong shape. The model's load_weights, which knows the
    tensor's name, turns it into a ValueError naming the weight."""

    def __init__(self, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
        super().__init__(f"has shape {got}, expected {expected}")
        self.got, self.expected = got, expected


def check_shape(loaded_weight: torch.Tensor, expected: tuple[int, ...] | torch.Size) -> None:
    """Raise WeightShapeError unless `loaded_weight` has exactly the (full, unsharded) shape."""
    if tuple(loaded_weight.shape) != tuple(expected):
        raise WeightShapeError(tuple(loaded_weight.shape), tuple(expected))


def default_weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor,
                          shard_id: object = None) -> None:
    """Copy a whole tensor into an unsharded parameter."""
    assert shard_id is None, f"default_weight_loader got shard {shard_id!r}"
    check_shape(loaded_weight, param.shape)
    param.data.copy_(loaded_weight)


# A file is read through a fresh map every this many bytes of tensors. A tensor is a view of
# its handle's map, which keeps every page it touched resident until the handle and all its
# tensors are gone: read through one handle, a 2.1 GB bf16 checkpoint stayed resident beside
# the weights copied out of it (1B Llama, dtype=bfloat16: peak RSS 4.34 GiB, 3.0-3.5 with
# this; 2.39 after loading either way).
_BYTES_PER_MAP = 64 * 2**20


def iterate_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the directory's *.safetensors files. The tensors are
    views of the file: a consumer copies what it keeps before asking for the next."""
    files = sorted(glob.glob(os.path.join(glob.escape(model_dir), "*.safetensors")))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {model_dir}.")
    for path in files:
        handle, mapped = None, 0
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
        for name in names:
            if handle is None or mapped >= _BYTES_PER_MAP:
                handle, mapped = safe_open(path, framework="pt"), 0
            tensor = handle.get_tensor(name)
            mapped += tensor.numel() * tensor.element_size()
            yield name, tensor
            del tensor  # the last view of an old map: its pages leave with it


def describe_missing(missing: list[str]) -> str:
    """The error message for parameters the checkpoint did not fill."""
    return (f"the checkpoint lacks weights for {missing[:4]}"
            f"{' and more' if len(missing) > 4 else ''}.")


def load_weights_into(module: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *,
                      stacked_params: Mapping[str, tuple[str, object]] = {},
                      rename: Callable[[str], str | tuple[str, object] | None] = lambda name: name,
                      on_this_rank: Callable[[str], bool] = lambda name: True) -> None:
    """Load full checkpoint tensors into `module`'s parameters, through each one's
    weight_loader (default_weight_loader when it has none), and check nothing is left empty.

    rename: checkpoint name -> our parameter name, or None to skip the tensor (buffers such as
    rotary inv_freq, a tied LM head), or (parameter name, shard id) for a tensor whose shard
    the name alone gives (one expert's matrix in a stacked MoE weight; stacked_params is then
    not consulted). A parameter with an `expected_shards` attribute is complete when exactly
    those shards were loaded. stacked_params: a name fragment -> (the fused parameter
    it is part of, its shard id), e.g. "q_proj" -> ("qkv_proj", "q"). on_this_rank: whether
    a (renamed) parameter belongs to this pipeline stage; others are skipped silently.

    Errors are ValueErrors naming the checkpoint weight: a wrong shape, a weight with no
    parameter, and every parameter of this rank the checkpoint did not (wholly) fill.
    """
    params: dict[str, torch.nn.Parameter | None] = dict(module.named_parameters())  # tied: once
    loaded: dict[str, set] = {}  # parameter name -> the shards loaded into it
    shards_of: dict[str, set] = {}  # fused module name -> the shards that fill it
    for stacked, shard in stacked_params.values():
        shards_of.setdefault(stacked, set()).add(shard)

    def complete(name: str, param: torch.nn.Parameter) -> bool:
        return loaded.get(name, set()) == getattr(
            param, "expected_shards", shards_of.get(name.rsplit(".", 2)[-2], {None}))

    # A complete parameter's when_loaded, run once the next tensor has been asked for, not at
    # once: the reader may have let go of the map holding the tensor that completed it by then
    # (1B bfloat16 Llama, `pagedlm serve`: load peak 2.47 -> 2.41 GiB).
    pending: Callable[[], None] | None = None
    for ckpt_name, tensor in weights:
        if pending is not None:
            pending, run = None, pending
            run()
        name = rename(ckpt_name)
        if name is None:
            continue
        shard = None
        if isinstance(name, tuple):
            name, shard = name
            frag = None
        else:
            frag = next((f for f in stacked_params if f".{f}." in name), None)
        if frag is not None:
            stacked, shard = stacked_params[frag]
            name = name.replace(f".{frag}.", f".{stacked}.")
        if not on_this_rank(name):
            continue
        if name not in params:
            raise ValueError(f"unexpected weight {ckpt_name!r} in the checkpoint.")
        param = params[name]
        if param is None:
            raise ValueError(f"weight {ckpt_name!r} fills {name!r}, which the checkpoint had "
                             f"already filled.")
        if hasattr(tensor, "dequantized") and not getattr(param, "takes_blocks", False):
            # Quantized blocks (GGUFBlocks) for a parameter that holds floats, e.g. a position
            # table: it gets them dequantized.
            tensor = tensor.dequantized()
        try:
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard)
        except WeightShapeError as e:
            raise ValueError(f"weight {ckpt_name!r} {e}.") from None
        loaded.setdefault(name, set()).add(shard)
        when_loaded = getattr(param, "when_loaded", None)
        if when_loaded is not None and complete(name, param):
            # Its layer is processed next (loader.process_as_loaded), which may free the
            # parameter for another form: nothing here may keep it alive.
            params[name] = param = None
            pending = when_loaded
    if pending is not None:
        pending()
    # load_optional: a parameter the checkpoint may or may not fill (a quantized copy of a
    # weight whose float version is loaded anyway); its layer checks what it got. A None
    # entry was complete and processed already.
    missing = [name for name, param in params.items()
               if param is not None and not getattr(param, "load_optional", False)
               and not complete(name, param)]
    if missing:
        raise ValueError(describe_missing(missing))
