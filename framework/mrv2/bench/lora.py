"""Random LoRA adapters for the benches (``mrv2 bench latency --variants lora_*``): PEFT
directories of a given rank on every attention and MLP projection of a checkpoint's layers,
shaped from its ``config.json`` (so ``--load-format dummy`` models need no weights)."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from mrv2.contract.lora import LoRARequest
from mrv2.lora.adapter import save_adapter


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def adapter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of each adapted projection of one layer, by its HF module name."""
    text = _text_config(config)
    hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
    kv = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    inter = int(text["intermediate_size"])
    return {"self_attn.q_proj": (heads * head_dim, hidden),
            "self_attn.k_proj": (kv * head_dim, hidden),
            "self_attn.v_proj": (kv * head_dim, hidden),
            "self_attn.o_proj": (hidden, heads * head_dim),
            "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
            "mlp.down_proj": (hidden, inter)}


def random_adapters(model_dir: str, count: int, rank: int, seed: int = 0
                    ) -> list[LoRARequest]:
    """``count`` random adapters of ``rank`` for the dense decoder in ``model_dir`` (bf16,
    small ``B`` so the outputs stay the model's kind), in a temporary directory removed at
    exit; ids 1..count."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = adapter_shapes(config)
    layers = int(_text_config(config)["num_hidden_layers"])
    root = Path(tempfile.mkdtemp(prefix="mrv2-lora-bench-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    loras = []
    for i in range(count):
        gen = torch.Generator().manual_seed(seed + i)
        modules = {
            f"model.layers.{layer}.{module}": (
                (torch.randn(rank, in_size, generator=gen) / in_size ** 0.5).to(torch.bfloat16),
                (torch.randn(out_size, rank, generator=gen) * 0.01).to(torch.bfloat16))
            for layer in range(layers) for module, (out_size, in_size) in shapes.items()}
        path = save_adapter(root / f"adapter-{i}", modules, alpha=2 * rank)
        loras.append(LoRARequest(f"bench-{i}", i + 1, str(path)))
    return loras
