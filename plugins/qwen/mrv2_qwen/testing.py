"""Tiny random Qwen3-Next checkpoints for the plugin's CPU tests and the GPU tests, with an MTP
head (random, or one that drafts the last token repeated); tiny Qwen3.5 ones (dense, MoE,
vision-language)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from mrv2.testing import DELTA_NET_DECAYS, redraw_weights, save_tiny_model

#: A 4-layer Qwen3-Next: three Gated DeltaNet layers and one gated full-attention layer,
#: twice as many value heads as key heads, the MoE with a gated shared expert (dense layer 1).
TINY_QWEN3_NEXT: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
    "decoder_sparse_step": 1, "mlp_only_layers": [1], "max_position_embeddings": 256,
    "layer_types": ["linear_attention", "linear_attention", "full_attention",
                    "linear_attention"],
    "tie_word_embeddings": False, "eos_token_id": 1, "bos_token_id": 0,
}


def save_tiny_qwen3_next(path: str | Path, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF Qwen3-Next of :data:`TINY_QWEN3_NEXT` (``overrides`` change
    fields) to ``path``, weights redrawn far from their init and the decays in a real range
    (``A`` in [1, 16], ``dt_bias`` near 0); returns HF's model."""
    import transformers

    config = transformers.Qwen3NextConfig(**{**TINY_QWEN3_NEXT, **overrides})
    return _save(path, config, "Qwen3NextForCausalLM")


#: The MoE fields of :data:`TINY_QWEN3_NEXT` (Qwen3.5's dense config has none of them).
_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
               "shared_expert_intermediate_size")
#: A tiny Qwen3.5 text config: :data:`TINY_QWEN3_NEXT`'s sizes and layer types, its M-RoPE over
#: half of each head (four frequencies in sections 2, 1, 1; interleaved as the published ones).
TINY_QWEN3_5: dict[str, Any] = {
    **{k: v for k, v in TINY_QWEN3_NEXT.items()
       if k not in (*_MOE_FIELDS, "decoder_sparse_step", "mlp_only_layers")},
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
                        "mrope_interleaved": True},
}
def _text_fields(moe: bool, overrides: dict[str, Any]) -> dict[str, Any]:
    text = {**TINY_QWEN3_5, **({k: TINY_QWEN3_NEXT[k] for k in _MOE_FIELDS} if moe else {}),
            **overrides}
    if moe:
        text.pop("intermediate_size")
    return text


def _save(path: str | Path, config: Any, arch: str) -> torch.nn.Module:
    return save_tiny_model(path, arch, config, uniform=DELTA_NET_DECAYS)


def save_tiny_qwen3_5(path: str | Path, moe: bool = False, conditional: bool = False,
                      **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF Qwen3.5 of :data:`TINY_QWEN3_5` to ``path`` (``moe``: Qwen3.5-MoE,
    the experts of :data:`TINY_QWEN3_NEXT` on every layer; ``conditional``: the
    ``*ForConditionalGeneration`` checkpoint, :func:`save_tiny_qwen3_5_vl`'s; ``overrides``
    change text-config fields), weights redrawn and decays set as
    :func:`save_tiny_qwen3_next` does; returns HF's model."""
    import transformers

    if conditional:
        return save_tiny_qwen3_5_vl(path, moe, **overrides)
    name = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{name}TextConfig")(**_text_fields(moe, overrides))
    return _save(path, config, f"{name}ForCausalLM")


def save_tiny_qwen3_5_vl(path: str | Path, moe: bool = False, **overrides: Any
                         ) -> torch.nn.Module:
    """Save a random fp32 HF Qwen3.5 (``moe``: Qwen3.5-MoE) vision-language checkpoint that
    takes images: :data:`TINY_QWEN3_5`'s text model (``overrides`` change its fields) over
    Qwen-VL's tiny vocabulary, with Qwen3-VL's tiny three-block tower (no deepstack: Qwen3.5
    has none), its image / video processors and tokenizer (``mrv2_qwen_vl.testing``: the
    special tokens' ids there); returns HF's model."""
    import transformers

    from mrv2_qwen_vl.testing import (
        END,
        IMAGE,
        QWEN3_VISION,
        START,
        VIDEO,
        save_qwen3_vl_processors,
    )

    vision = {k: v for k, v in QWEN3_VISION.items() if k != "deepstack_visual_indexes"}
    name = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{name}Config")(
        text_config=_text_fields(moe, {"vocab_size": 320, **overrides}), vision_config=vision,
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
        vision_end_token_id=END, tie_word_embeddings=False)
    hf = _save(path, config, f"{name}ForConditionalGeneration")
    save_qwen3_vl_processors(path)
    return hf


def block_config(config: Any) -> Any:
    """``config`` whose layer 0 is a full-attention layer (the MTP layer's kind), eager
    attention (the mask passed below applies)."""
    cfg = copy.deepcopy(config)
    cfg.layer_types = ["full_attention"] + list(cfg.layer_types[1:])
    cfg._attn_implementation = "eager"
    return cfg


def mtp_tensors(config: Any, seed: int = 7) -> dict[str, torch.Tensor]:
    """Random MTP-head tensors named as Qwen3-Next's checkpoints name them: ``mtp.fc``, the
    three norms and layer 0 (HF's full-attention decoder layer, one tensor per expert)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

    block = Qwen3NextDecoderLayer(block_config(config), 0)
    hidden = int(config.hidden_size)
    redraw_weights(block, seed)
    inter = config.moe_intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, tensor in block.state_dict().items():
        if name == "mlp.experts.gate_up_proj":
            for e in range(tensor.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = tensor[e, :inter].clone()
                out[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = tensor[e, inter:].clone()
        elif name == "mlp.experts.down_proj":
            for e in range(tensor.shape[0]):
                out[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = tensor[e].clone()
        else:
            out["mtp.layers.0." + name] = tensor.clone()
    gen = torch.Generator().manual_seed(seed + 100)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = torch.rand(hidden, generator=gen) - 0.5  # (1 + w)
    out["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
    return out


def checkpoint_with_mtp(path: str | Path, **overrides: Any) -> dict[str, torch.Tensor]:
    """The tiny HF Qwen3-Next saved (``overrides``: :func:`save_tiny_qwen3_next`'s), its MTP
    head's tensors added to ``model.safetensors``; returns every tensor."""
    import transformers
    from safetensors.torch import load_file, save_file

    path = Path(path)
    save_tiny_qwen3_next(path, **overrides)
    config = transformers.AutoConfig.from_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    tensors.update(mtp_tensors(config))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return tensors


def identity_mtp(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with the MTP head made an identity on the target's hidden state: ``fc`` =
    ``[0 | I]`` (the embedding half ignored), the block's ``o_proj`` and every ``down_proj``
    (the routed experts' and the shared expert's) zero so the block returns its input, the
    three MTP norms plain RMS normalizations (``w = 0``). The row fed the target's normed
    hidden state ``n`` at position ``p`` then gives ``lm_head(n) / rms(n)``: the target's
    logits at ``p`` times a positive scalar, and so does every chained step (the previous
    output, ``mtp.norm`` and ``pre_fc_norm_hidden`` scale it again). Every draft is thus the
    target's greedy token at ``p``. The first draft's row holds the hidden state just before
    the token just sampled, so every draft is that token (greedy) repeated."""
    out = dict(tensors)
    hidden = tensors["mtp.fc.weight"].shape[0]
    out["mtp.fc.weight"] = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], 1)
    for name, tensor in tensors.items():
        if name.startswith("mtp.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = torch.zeros_like(tensor)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = torch.zeros(hidden)
    return out


def lora_against_merged(base: str | Path, root: str | Path, targets: tuple[str, ...],
                        prompts: list[list[int]], max_tokens: int = 8,
                        exclude: str | None = ".experts.", **llm_kwargs: Any
                        ) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """A random rank-4 PEFT adapter of checkpoint ``base`` on every ``targets`` module (but
    those whose names hold ``exclude``: the routed experts, which take no adapters), saved
    under ``root``: ``(the engine's greedy tokens with it, HF's on the adapter merged into the
    base, HF's on the base)`` for each of ``prompts`` (``llm_kwargs``: the engine's, beside
    the CPU, fp32, 4-token blocks and ``enable_lora``)."""
    from mrv2 import LLM, LoRARequest, SamplingParams
    from mrv2.testing import hf_greedy
    from mrv2.testing_checkpoints import make_lora_adapter, merge_lora_checkpoint

    root = Path(root)
    adapter = make_lora_adapter(base, root / "lora", rank=4, seed=3, targets=targets,
                                exclude=exclude)
    merged = merge_lora_checkpoint(base, adapter, root / "merged")
    want = [hf_greedy(merged, p, max_tokens) for p in prompts]
    plain = [hf_greedy(base, p, max_tokens) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    kwargs: dict[str, Any] = {"device": "cpu", "dtype": "float32", "block_size": 4,
                              "max_model_len": 64, "enable_lora": True, **llm_kwargs}
    with LLM(str(base), **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                            lora_request=LoRARequest("lora", 1, str(adapter)))
    return [list(o.outputs[0].token_ids) for o in outs], want, plain
