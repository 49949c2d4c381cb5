"""Multi-LoRA serving: many PEFT adapters over one base model, mixed in one batch.

request.py: LoRARequest, what a user passes with a prompt. models.py: reading a PEFT checkpoint
(LoRAModel) and the device slots of one model replica (LoRAModelManager). layers.py: LoRA-aware
versions of the parallel linear layers. worker_manager.py: a worker's cache of loaded adapters.
"""
from pagedlm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
