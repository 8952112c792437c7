"""Checkpoint writers for tests: a tiny checkpoint saved as an FP8 one is published, with MTP
layers appended (HF models none), a random PEFT LoRA adapter and its merged reference, and a
checkpoint of a base's files with other weights. (The quantized integer / MXFP4 writers are in
:mod:`mrv2.testing_quant`.)"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mrv2.testing import redraw_weights


def fp8_checkpoint(src: str | Path, dst: str | Path, reference: str | Path,
                   block: tuple[int, int] = (128, 128), also: Sequence[str] = (),
                   stacked: Sequence[str] = (), keep: Sequence[str] = ()) -> None:
    """Save ``src`` (a tiny checkpoint) as an FP8 checkpoint is published in ``dst``: every
    projection weight (``*_proj.weight``; a sparse-attention indexer's ``wq_b`` and ``wk``, not
    its ``weights_proj``, as DeepSeek-V3.2 publishes them) as e4m3 with a
    ``weight_scale_inv`` per ``block``, the
    routed experts (transformers 5's stacked ``experts.gate_up_proj`` / ``experts.down_proj``)
    split per expert as DeepSeek-V3 and GLM-4.5-FP8 publish them
    (``experts.{j}.{gate,up,down}_proj.weight`` and their ``weight_scale_inv``), and
    ``quantization_config`` in its config; and in ``reference`` the same model with those
    weights dequantized (what HF should run to match). ``also``: name endings of further 2-D
    weights quantized so (Qwen3.5-FP8's ``.in_proj_qkv.weight``, ``.in_proj_z.weight``).
    ``stacked``: name endings of 3-D expert stacks ``[E, N, K]`` quantized expert by expert
    and kept stacked, their ``weight_scale_inv`` ``[E, ceil(N/bn), ceil(K/bk)]`` stacked too
    (Step-3.5/3.7-FP8's ``.moe.gate_proj.weight``, ``.moe.up_proj.weight``,
    ``.moe.down_proj.weight``). ``keep``: name prefixes left as they are (a vision tower)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from mrv2_kernels.fp8_gemm import dequantize_weight_block_fp8, quantize_weight_block_fp8

    src, dst, reference = Path(src), Path(dst), Path(reference)
    for out in (dst, reference):
        shutil.copytree(src, out, dirs_exist_ok=True)
    tensors = load_file(src / "model.safetensors")
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    def quantize(name: str, t: torch.Tensor) -> torch.Tensor:
        w8, scale = quantize_weight_block_fp8(t, block)
        quantized[name] = w8.contiguous()
        quantized[name + "_scale_inv"] = scale.contiguous()
        return dequantize_weight_block_fp8(w8, scale, block, t.dtype).contiguous()

    for name, t in tensors.items():
        if keep and name.startswith(tuple(keep)):
            quantized[name] = dequantized[name] = t
        elif stacked and name.endswith(tuple(stacked)) and t.dim() == 3:
            pairs = [quantize_weight_block_fp8(t[e], block) for e in range(t.shape[0])]
            quantized[name] = torch.stack([w8 for w8, _ in pairs]).contiguous()
            quantized[name + "_scale_inv"] = torch.stack([s for _, s in pairs]).contiguous()
            dequantized[name] = torch.stack([dequantize_weight_block_fp8(w8, s, block, t.dtype)
                                             for w8, s in pairs]).contiguous()
        elif name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and t.dim() == 3:
            prefix, kind = name.rsplit(".", 1)
            inter = t.shape[1] // 2
            parts = []
            for e in range(t.shape[0]):
                if kind == "down_proj":
                    parts.append(quantize(f"{prefix}.{e}.down_proj.weight", t[e]))
                else:
                    gate = quantize(f"{prefix}.{e}.gate_proj.weight", t[e, :inter])
                    up = quantize(f"{prefix}.{e}.up_proj.weight", t[e, inter:])
                    parts.append(torch.cat([gate, up]))
            dequantized[name] = torch.stack(parts).contiguous()
        elif name.endswith(".indexer.weights_proj.weight"):
            quantized[name] = dequantized[name] = t  # (DeepSeek-V3.2-FP8 keeps it in bf16)
        elif name.endswith(("_proj.weight", ".indexer.wq_b.weight", ".indexer.wk.weight",
                            *also)) and t.dim() == 2:
            dequantized[name] = quantize(name, t)
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, dst / "model.safetensors")
    save_file(dequantized, reference / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def append_mtp_layer(path: str | Path, block: torch.nn.Module, std: float = 0.05,
                     seed: int = 5) -> None:
    """Add an MTP layer to the checkpoint in ``path`` as DeepSeek-V3 and GLM-4.5 name it
    (HF does not model MTP layers): ``block`` (an HF decoder layer built for index
    ``num_hidden_layers``, its weights redrawn with ``std``) plus ``enorm``, ``hnorm``,
    ``eh_proj`` and ``shared_head.norm``, all under ``model.layers.{num_hidden_layers}``."""
    import json

    from safetensors.torch import load_file, save_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    hidden = int(config["hidden_size"])
    prefix = f"model.layers.{config['num_hidden_layers']}."
    redraw_weights(block, seed=seed, std=std)
    tensors = load_file(path / "model.safetensors")
    tensors.update({prefix + name: t.clone() for name, t in block.state_dict().items()})
    gen = torch.Generator().manual_seed(seed + 1)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{prefix}{norm}.weight"] = torch.rand(hidden, generator=gen) + 0.5
    tensors[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * std
    save_file(tensors, path / "model.safetensors")


def make_mtp_checkpoint(path: str | Path, architecture: str, decoder_layer: Any,
                        mtp_std: float = 0.08, **config: Any) -> Path:
    """Save a tiny random ``architecture`` built from exactly ``config`` (no :data:`TINY`
    defaults), every weight redrawn (:func:`redraw_weights`), plus one MTP layer
    (:func:`append_mtp_layer`) whose block is ``decoder_layer(hf_config,
    num_hidden_layers)`` (e.g. transformers' ``DeepseekV3DecoderLayer``). Returns ``path``."""
    import transformers

    hf_config = getattr(transformers, architecture.replace("ForCausalLM", "Config"))(**config)
    hf_config.architectures = [architecture]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(hf_config).eval()
    redraw_weights(model)
    path = Path(path)
    model.save_pretrained(path)
    append_mtp_layer(path, decoder_layer(hf_config, hf_config.num_hidden_layers), std=mtp_std)
    return path


_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapter(base: str | Path, path: str | Path, rank: int = 8, alpha: float = 16,
                      seed: int = 0, targets: Sequence[str] = _LORA_TARGETS,
                      use_rslora: bool = False, std: float = 0.3,
                      exclude: str | None = None) -> Path:
    """Save a random PEFT LoRA adapter of checkpoint ``base`` at ``path``: ``lora_A`` / ``lora_B``
    for every ``targets`` projection of every layer (``B`` non-zero, unlike a fresh PEFT
    init, so the adapter changes the outputs), as ``peft``'s ``save_pretrained`` writes them;
    modules whose name contains ``exclude`` are left out. Returns ``path``."""
    from safetensors import safe_open

    from mrv2.lora.adapter import save_adapter

    gen = torch.Generator().manual_seed(seed)
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with safe_open(str(Path(base) / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
            module = name.removesuffix(".weight")
            if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in targets or (
                    exclude is not None and exclude in module):
                continue
            out_size, in_size = f.get_slice(name).get_shape()
            modules[module] = (
                torch.randn(rank, in_size, generator=gen) * (std / in_size ** 0.5 * 4),
                torch.randn(out_size, rank, generator=gen) * (std / rank ** 0.5))
    return save_adapter(path, modules, alpha, use_rslora)


def merge_lora_checkpoint(base: str | Path, adapter: str | Path, path: str | Path) -> Path:
    """The reference for a LoRA adapter: checkpoint ``base`` with every adapted weight replaced
    by ``W + scaling * B @ A`` (read straight from the PEFT files), saved at ``path`` with the
    base's config, for HF to run. Returns ``path``."""
    import json
    import math

    from safetensors.torch import load_file

    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    rank = config["r"]
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    weights = load_file(str(Path(base) / "model.safetensors"))
    lora = load_file(str(Path(adapter) / "adapter_model.safetensors"))
    for name, a in lora.items():
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0].removeprefix("base_model.model.")
        b = lora[name.replace(".lora_A.", ".lora_B.")]
        w = weights[f"{module}.weight"]
        weights[f"{module}.weight"] = (w.double() + scaling * b.double() @ a.double()).to(w.dtype)
    return save_checkpoint_like(base, path, weights)


def save_checkpoint_like(base: str | Path, path: str | Path,
                         tensors: dict[str, torch.Tensor]) -> Path:
    """A checkpoint in ``path`` with ``base``'s files but its weights (config, tokenizer...)
    and ``tensors`` as its ``model.safetensors``; returns ``path``."""
    import shutil

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for file in Path(base).iterdir():
        if file.is_file() and file.suffix != ".safetensors":
            shutil.copy(file, path / file.name)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
