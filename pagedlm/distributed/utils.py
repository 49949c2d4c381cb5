"""Pure helpers for pipeline parallelism: which layers a stage owns, what passes between stages.

Nothing here touches torch.distributed, so the config can use it without a process group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The [start, end) layer range of pipeline stage `pp_rank` out of `pp_size`.

    Stages are contiguous and as even as possible. As in vLLM, the layers left over go one each
    to the stages before the last (counting back from the second-to-last), because the last
    stage also runs the final norm and the LM head: 30 layers over 4 stages -> 7, 8, 8, 7.
    """
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} out of range for pipeline_parallel_size {pp_size}")
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size ({pp_size}) is larger than the number of "
                         f"layers ({num_layers})")
    sizes = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        sizes[-2 - i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


@dataclass
class IntermediateTensors:
    """What a non-last pipeline stage hands to the next: the hidden states and the residual
    stream (the decoder layers fuse the residual add into the next RMSNorm, so both travel)."""
    hidden_states: torch.Tensor
    residual: torch.Tensor

    def to_dict(self) -> dict[str, torch.Tensor]:
        """For GroupCoordinator.send_tensor_dict."""
        return {"hidden_states": self.hidden_states, "residual": self.residual}

    @classmethod
    def from_dict(cls, d: dict[str, torch.Tensor]) -> "IntermediateTensors":
        return cls(d["hidden_states"], d["residual"])
