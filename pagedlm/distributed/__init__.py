"""Distributed execution state: process groups (parallel_state) and pipeline helpers (utils)."""
from pagedlm.distributed.parallel_state import (GroupCoordinator, default_backend,
                                                destroy_distributed_environment,
                                                destroy_model_parallel,
                                                ensure_model_parallel_initialized,
                                                get_pp_group, get_tp_group, get_world_group,
                                                init_distributed_environment,
                                                model_parallel_is_initialized)
from pagedlm.distributed.utils import IntermediateTensors, get_pp_indices

__all__ = [
    "GroupCoordinator", "IntermediateTensors", "default_backend",
    "destroy_distributed_environment", "destroy_model_parallel",
    "ensure_model_parallel_initialized", "get_pp_group", "get_pp_indices", "get_tp_group",
    "get_world_group", "init_distributed_environment", "model_parallel_is_initialized",
]
