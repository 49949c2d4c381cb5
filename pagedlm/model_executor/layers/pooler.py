"""The pooler of the pooling runner: one vector per prompt from the model's final hidden states
(after the final norm), accumulated over the chunks a chunked prefill splits a prompt into."""
from __future__ import annotations

import torch

from pagedlm.pooling_params import PoolerConfig, PoolingParams


class Pooler:
    """Runs on the output rank. Per request it keeps only what the pooling type needs between
    chunks: nothing for LAST, a float32 running sum and count for MEAN."""

    def __init__(self, config: PoolerConfig) -> None:
        self.config = config
        self._sums: dict[str, tuple[torch.Tensor, int]] = {}

    def add_chunk(self, req_id: str, hidden: torch.Tensor, start: int, done: bool
                  ) -> torch.Tensor | None:
        """hidden: the rows of this step's chunk of the prompt, which begins at position
        `start`; done: the chunk ends the prompt. Returns the pooled vector when done."""
        if self.config.pooling_type == "LAST":
            return hidden[-1].float().cpu() if done else None
        if start == 0:  # the first chunk, or a recompute after preemption: start over
            total, count = torch.zeros(hidden.shape[-1], dtype=torch.float32,
                                       device=hidden.device), 0
        elif req_id in self._sums:
            total, count = self._sums[req_id]
        else:
            # Only if earlier tokens were skipped (a prefix-cache hit): MEAN would miss them.
            raise RuntimeError(f"MEAN pooling of request {req_id} starts at position {start}: "
                               f"its first tokens' hidden states were never computed")
        total = total + hidden.float().sum(dim=0)
        count += hidden.shape[0]
        if not done:
            self._sums[req_id] = (total, count)
            return None
        self._sums.pop(req_id, None)
        return (total / count).cpu()

    def drop(self, req_id: str) -> None:
        """A request finished or was aborted mid-prompt."""
        self._sums.pop(req_id, None)


def finalize_embedding(pooled: torch.Tensor, params: PoolingParams,
                       default_normalize: bool) -> list[float]:
    """Truncate to the requested dimensions (matryoshka), then L2-normalise if asked."""
    vec = pooled.float()
    if params.dimensions is not None:
        vec = vec[:params.dimensions]
    normalize = default_normalize if params.normalize is None else params.normalize
    if normalize:
        vec = torch.nn.functional.normalize(vec, p=2, dim=-1)
    return vec.tolist()
