"""A request's LoRA adapter, as vLLM names it."""

from __future__ import annotations

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
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got "
                             f"{self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must not be empty")
        if not self.lora_path:
            raise ValueError("LoRARequest.lora_path must name the adapter's directory")
