"""A request's LoRA adapter, as vLLM names it."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """Serve a request through a LoRA adapter (a PEFT checkpoint directory).

    ``lora_int_id`` identifies the adapter's weights: requests with the same id share one
    loaded copy (and their prefix-cache blocks), so one id must always name the same
    directory's weights. ``lora_name`` is what ``mrv2 serve`` lists and requests name in
    their ``model`` field.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):  # (True would be adapter 1's id)
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got "
                             f"{self.lora_int_id!r}")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got "
                             f"{self.lora_name!r}")
        if not isinstance(self.lora_path, str | os.PathLike) or not str(self.lora_path):
            raise ValueError(f"LoRARequest.lora_path must name the adapter's directory, got "
                             f"{self.lora_path!r}")
