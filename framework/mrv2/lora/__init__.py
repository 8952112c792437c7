"""Serving LoRA adapters: PEFT checkpoints read and checked (:mod:`.adapter`), adapter slots on
the model's linear layers (:mod:`.layers`), and the runner's slot bookkeeping
(:mod:`.manager`). Requests name their adapter with :class:`~mrv2.contract.lora.LoRARequest`.
"""

from mrv2.contract.lora import LoRARequest
from mrv2.lora.adapter import AdapterConfig, read_adapter, read_adapter_config
from mrv2.lora.manager import LoRAManager, make_lora_manager

__all__ = ["AdapterConfig", "LoRAManager", "LoRARequest", "make_lora_manager", "read_adapter",
           "read_adapter_config"]
