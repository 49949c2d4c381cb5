"""DeviceConfig: where the model, the KV cache and each step's tensors live (vLLM's shape).

"cpu" is the default everywhere (EngineArgs.device); "auto" picks CUDA when torch sees a GPU.
A worker of a tensor-parallel group on CUDA uses cuda:<local_rank> whatever index is given
here: the index only chooses the GPU of a single-worker engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")  # or "cuda:N"


@dataclass(frozen=True)
class DeviceConfig:
    # What the user asked for ("auto", "cpu", "cuda", "cuda:N" or a torch.device); resolved
    # in __post_init__ to a torch.device.
    device: str | torch.device = "auto"
    device_type: str = field(init=False)

    def __post_init__(self) -> None:
        asked = self.device
        if isinstance(asked, str) and asked == "auto":
            resolved = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            try:
                resolved = torch.device(asked)
            except (RuntimeError, TypeError):
                resolved = None
            if resolved is None or resolved.type not in ("cpu", "cuda"):
                raise ValueError(f"device must be one of {list(DEVICE_CHOICES)} or 'cuda:N', "
                                 f"got {asked!r}.")
        if resolved.type == "cpu" and resolved.index is not None:
            resolved = torch.device("cpu")  # one CPU device: "cpu:0" is "cpu"
        if resolved.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {asked!r}: CUDA is not available here (torch "
                                 f"{torch.__version__}, torch.cuda.is_available() is False).")
            count = torch.cuda.device_count()
            if resolved.index is not None and not 0 <= resolved.index < count:
                raise ValueError(f"device {asked!r}: this machine has {count} CUDA "
                                 f"device(s).")
        object.__setattr__(self, "device", resolved)
        object.__setattr__(self, "device_type", resolved.type)

    @property
    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def worker_device(self, local_rank: int, world_size: int) -> torch.device:
        """The device of one worker: cuda:<local_rank> with several workers on CUDA (each
        process owns one GPU), the configured device otherwise."""
        if self.device_type == "cuda":
            if world_size > 1:
                return torch.device("cuda", local_rank)
            return torch.device("cuda", self.device.index or 0)
        return self.device
