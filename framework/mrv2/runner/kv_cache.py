"""KV cache sizing and allocation, from the attention layers the model declares."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mrv2.config import CacheConfig

_GIB = 1 << 30


@dataclass(frozen=True)
class KVLayerSpec:
    """Shape of one attention layer's cache."""

    layer_idx: int
    num_kv_heads: int
    head_dim: int


def kv_layer_specs(model: nn.Module) -> list[KVLayerSpec]:
    """One spec per attention layer of ``model``, in layer order."""
    from mrv2.layers.attention import Attention

    specs = [
        KVLayerSpec(m.layer_idx, m.num_kv_heads, m.head_dim)
        for m in model.modules()
        if isinstance(m, Attention)
    ]
    specs.sort(key=lambda spec: spec.layer_idx)
    if [spec.layer_idx for spec in specs] != list(range(len(specs))):
        raise ValueError("attention layers must have layer_idx 0..N-1, each once")
    return specs


def bytes_per_block(specs: list[KVLayerSpec], block_size: int, dtype: torch.dtype) -> int:
    """Device bytes of one KV block across all layers (keys and values)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * s.num_kv_heads * s.head_dim * itemsize for s in specs)


def num_blocks_for(
    cache: CacheConfig, specs: list[KVLayerSpec], dtype: torch.dtype, device: torch.device,
    peak_bytes: int = 0,
) -> int:
    """How many blocks fit: the override, else the CPU budget, else device memory left.

    On CUDA: ``gpu_memory_utilization`` of total memory, less what is in use now (weights,
    other processes) and less the profiling forward's activation peak ``peak_bytes``.
    """
    per_block = bytes_per_block(specs, cache.block_size, dtype)
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    parts = ""
    if device.type == "cpu":
        budget = int(cache.cpu_kv_cache_gb * _GIB)
    else:
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free
        budget = int(total * cache.gpu_memory_utilization) - in_use - peak_bytes
        parts = (f" = {cache.gpu_memory_utilization} x {total / _GIB:.1f} GiB - "
                 f"{in_use / _GIB:.2f} GiB in use - {peak_bytes / _GIB:.2f} GiB activation peak")
    blocks = budget // per_block
    if blocks < 1:
        raise RuntimeError(
            f"no memory left for the KV cache (budget {budget / _GIB:.2f} GiB{parts}; one block "
            f"{per_block} bytes): raise gpu_memory_utilization or lower max_num_batched_tokens"
        )
    return int(blocks)


def allocate_kv_caches(
    specs: list[KVLayerSpec], num_blocks: int, block_size: int, dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer."""
    return [
        torch.zeros(2, num_blocks, block_size, s.num_kv_heads, s.head_dim, dtype=dtype,
                    device=device)
        for s in specs
    ]
