"""Reading checkpoint tensors and copying them into parameters.

Every parameter of a model carries a `weight_loader(param, loaded_weight, shard_id=None)`
attribute: the parallel layers' loaders take the FULL checkpoint tensor and copy the slice this
rank owns; `default_weight_loader` copies a whole tensor. Our GGUF files are converted to an HF
safetensors directory first, so this one path serves both formats.
"""
from __future__ import annotations

import glob
import os
from typing import Iterator

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


def iterate_safetensors(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the directory's *.safetensors files."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {model_dir}.")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def describe_missing(missing: list[str]) -> str:
    """The error message for parameters the checkpoint did not fill."""
    return (f"the checkpoint lacks weights for {missing[:4]}"
            f"{' and more' if len(missing) > 4 else ''}.")
