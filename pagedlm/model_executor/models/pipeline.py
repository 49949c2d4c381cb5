"""What a model builds on this rank's pipeline stage (the role of vLLM's make_layers).

A stage builds only its own decoder layers, the embedding where it is needed, and the final norm
and LM head on the last stage; the modules it does not build stay None, and CausalLMBase skips
their checkpoint weights. The models read this rank's place once, here, instead of each one
asking the process group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from pagedlm.distributed.parallel_state import get_pp_group
from pagedlm.distributed.utils import get_pp_indices


@dataclass(frozen=True)
class PPStage:
    """This rank's pipeline stage: its place and its layers [start_layer, end_layer) (global
    indices)."""
    is_first: bool
    is_last: bool
    start_layer: int
    end_layer: int

    @classmethod
    def of_this_rank(cls, num_layers: int) -> PPStage:
        pp = get_pp_group()
        start, end = get_pp_indices(num_layers, pp.rank_in_group, pp.world_size)
        return cls(pp.is_first_rank, pp.is_last_rank, start, end)

    def holds_embedding(self, tied_lm_head: bool) -> bool:
        """The first stage embeds the input; the last needs the embedding too when its LM head
        is tied to it."""
        return self.is_first or (tied_lm_head and self.is_last)


def make_layers(stage: PPStage, layer_fn: Callable[[int], nn.Module]) -> nn.ModuleDict:
    """The stage's decoder layers, layer_fn(global index) each. Keyed by the global index, so
    parameter names match the checkpoint's."""
    return nn.ModuleDict({str(i): layer_fn(i) for i in range(stage.start_layer, stage.end_layer)})
