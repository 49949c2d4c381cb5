"""What every model class shares: logits, post-load weight processing, and which checkpoint
weights belong to this pipeline stage."""
from __future__ import annotations

import torch
from torch import nn

from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead
from pagedlm.model_executor.models.pipeline import PPStage


class CausalLMBase(nn.Module):
    """Base of the model classes (see registry.py for the interface they implement).

    stage_modules: the top-level modules that only some pipeline stages build (embeddings,
    final norm, LM head); a stage without one skips its checkpoint weights. Decoder layers are
    `<layers_name>.<global index>` and belong to the stage holding [start_layer, end_layer)
    (see pipeline.py).
    """

    stage_modules: tuple[str, ...] = ("embed_tokens", "norm", "lm_head")
    layers_name: str = "layers"
    lm_head: nn.Module | None
    stage: PPStage

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the whole vocabulary (gathered over the TP ranks)."""
        if self.lm_head is None:
            raise RuntimeError("only the last pipeline stage computes logits")
        return self.lm_head(hidden).float()

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            method = getattr(module, "linear_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
            elif module is not self and hasattr(module, "process_weights_after_loading"):
                module.process_weights_after_loading()  # a layer of its own kind (FusedMoE)
        if isinstance(getattr(self, "lm_head", None), ParallelLMHead):
            self.lm_head.look_up_from_panels()  # tied 2-byte weights: one copy, the panels

    def _on_this_stage(self, name: str) -> bool:
        """Whether a (renamed) checkpoint weight belongs to a module this stage has."""
        head, _, rest = name.partition(".")
        if head == self.layers_name:
            return self.stage.start_layer <= int(rest.split(".", 1)[0]) < self.stage.end_layer
        if head in self.stage_modules:
            return getattr(self, head) is not None
        return True
