"""Per-request settings of an embedding (pooling) request: vLLM's PoolingParams."""
from __future__ import annotations

import copy
from dataclasses import dataclass

from pagedlm.sampling_params import RequestOutputKind

POOLING_TYPES = ("LAST", "MEAN")


@dataclass
class PoolerConfig:
    """How a pooling engine turns a prompt's final hidden states into one vector.

    LAST (vLLM's default for decoder LMs): the last prompt token's state, the only one that has
    seen the whole prompt under causal attention. MEAN: the average over all prompt tokens.
    """
    pooling_type: str = "LAST"
    normalize: bool = True  # the default of requests that do not say

    def __post_init__(self) -> None:
        if isinstance(self.pooling_type, str):
            self.pooling_type = self.pooling_type.upper()
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {list(POOLING_TYPES)}, got "
                             f"{self.pooling_type!r}.")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}.")


@dataclass
class PoolingParams:
    """normalize: L2-normalise the vector (None: the engine's pooler_config default).
    dimensions: keep only the first `dimensions` features (before normalising); only models
    trained for it (matryoshka representations) accept it."""

    normalize: bool | None = None
    dimensions: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool or None, got {self.normalize!r}.")
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be a positive integer or None, got {d!r}.")
        if self.output_kind is not RequestOutputKind.FINAL_ONLY:
            raise ValueError("output_kind of a pooling request must be FINAL_ONLY: an "
                             "embedding is only known once the whole prompt has run.")

    def clone(self) -> "PoolingParams":
        return copy.copy(self)

    def verify(self, hidden_size: int, matryoshka_dimensions: list[int] | None,
               is_matryoshka: bool) -> None:
        """ValueError unless the model can give `dimensions`."""
        d = self.dimensions
        if d is None:
            return
        if not is_matryoshka:
            raise ValueError(f"dimensions ({d}) is not supported by this model: it was not "
                             f"trained for matryoshka representations, so a truncated "
                             f"embedding would be meaningless. Leave dimensions unset "
                             f"({hidden_size} features).")
        if matryoshka_dimensions and d not in matryoshka_dimensions:
            raise ValueError(f"dimensions ({d}) must be one of the model's matryoshka "
                             f"dimensions {sorted(matryoshka_dimensions)}.")
        if d > hidden_size:
            raise ValueError(f"dimensions ({d}) is larger than the model's hidden size "
                             f"({hidden_size}).")
