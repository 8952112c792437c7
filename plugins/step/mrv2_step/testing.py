"""Tiny random Step-3.7 checkpoints for the plugin's CPU tests and the GPU tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch

from mrv2.testing import save_tiny_model

#: A 4-layer Step-3.7 text decoder: sliding layers 0 and 2 (window 8, eight query heads, RoPE
#: over whole heads), full layers 1 and 3 (four query heads, RoPE over half of each head,
#: another base); a dense MLP on layer 0, the MoE (four experts, two a token, a shared
#: expert, scaled routing) on the others, layer 3's routed and shared experts clamped;
#: scores scaled by ``query_pre_attn_scalar`` 24, not ``head_dim``.
TINY_STEP3P7_TEXT: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_sliding_attention_heads": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "share_expert_dim": 48, "sliding_window": 8, "moe_router_scaling_factor": 2.0,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                    "full_attention"],
    "moe_layers_enum": "1,2,3", "rope_theta": [10000.0, 500000.0, 10000.0, 500000.0],
    "partial_rotary_factors": [1.0, 0.5, 1.0, 0.5],
    "swiglu_limits": [0, 0, 0, 0.5], "swiglu_limits_shared": [0, 0, 0, 0.5],
    "query_pre_attn_scalar": 24, "max_position_embeddings": 256, "pad_token_id": 0,
    "eos_token_id": 1, "bos_token_id": 0,
}
#: A 2-layer vision tower whose position table is 168 pixels a side (12 x 12 patches of 14):
#: :data:`TINY_STEP3P7_IMAGES`' global view uses it as is, the 112-pixel crops resized.
TINY_STEP3P7_VISION: dict[str, Any] = {
    "width": 32, "layers": 2, "heads": 2, "image_size": 168, "patch_size": 14,
    "mlp_ratio": 2.0, "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
}
#: The image processor's settings of the tiny checkpoints: a 168-pixel global view (9 image
#: tokens), 112-pixel crops (4 tokens each), images over 400 pixels scaled down.
TINY_STEP3P7_IMAGES: dict[str, Any] = {
    "image_processor_type": "Step3p7ImageProcessor", "size": {"height": 168, "width": 168},
    "patch_size": 112, "max_image_size": 400,
}


def save_tiny_step3p7(path: str | Path, **text_overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF Step-3.7 of :data:`TINY_STEP3P7_TEXT` (``text_overrides`` change
    its fields) and :data:`TINY_STEP3P7_VISION` to ``path`` (transformers writes the published
    layout: stacked ``moe.*`` experts, ``share_expert``, ``vision_model``); returns HF's
    model."""
    import transformers

    config = transformers.Step3p7Config(
        text_config={**TINY_STEP3P7_TEXT, **text_overrides},
        vision_config=dict(TINY_STEP3P7_VISION), image_token_id=127)
    return save_tiny_model(path, "Step3p7ForConditionalGeneration", config)


def save_tiny_step3p7_vl(path: str | Path, **text_overrides: Any
                         ) -> tuple[torch.nn.Module, int]:
    """:func:`save_tiny_step3p7` (``text_overrides`` change the text config) with a tokenizer
    holding Step's image tokens (:data:`mrv2_step.vision_inputs.TOKENS`), ``image_token_id``
    its ``<im_patch>`` and the image processor's settings (:data:`TINY_STEP3P7_IMAGES`);
    returns HF's model and the ``<im_patch>`` id."""
    import json

    import transformers

    from mrv2.testing import make_tiny_tokenizer
    from mrv2_step.vision_inputs import TOKENS

    path = Path(path)
    make_tiny_tokenizer(path, vocab_size=300, special_tokens=tuple(TOKENS.values()))
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(path))
    patch = int(tokenizer.convert_tokens_to_ids(TOKENS["image"]))
    config = transformers.Step3p7Config(
        text_config={**TINY_STEP3P7_TEXT, **text_overrides, "vocab_size": len(tokenizer) + 8},
        vision_config=dict(TINY_STEP3P7_VISION), image_token_id=patch)
    hf = save_tiny_model(path, "Step3p7ForConditionalGeneration", config)
    (path / "preprocessor_config.json").write_text(json.dumps(TINY_STEP3P7_IMAGES))
    return hf, patch


def hf_greedy_step3p7(model_dir: str | Path, prompts: list[list[int]], max_new_tokens: int,
                      device: str = "cpu") -> list[list[int]]:
    """HF's greedy continuation of each prompt by the fp32 ``Step3p7ForConditionalGeneration``
    saved at ``model_dir`` (a full forward per token, no EOS stop; ``AutoModelForCausalLM``
    does not map the composite config)."""
    import transformers

    cls: Any = transformers.Step3p7ForConditionalGeneration
    model = cls.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([ids], device=device)).logits[0, -1]
                ids.append(int(logits.argmax()))
            out.append(ids[len(prompt):])
    return out


def save_tiny_step3p7_mtp(path: str | Path, mtp_layers: list[tuple[str, str]],
                          **text_overrides: Any) -> torch.nn.Module:
    """:func:`save_tiny_step3p7` plus MTP layers of ``(attention type, MLP type)``
    ``mtp_layers``, laid out as the published checkpoints are (transformers does not model
    them): the config lists them as the hub configs do (``num_nextn_predict_layers``, the
    per-layer lists padded with their entries; transformers splits those into
    ``mtp_layer_types`` / ``mtp_mlp_layer_types``), the tensors of layer ``N + i`` are a Step
    decoder block (HF's, saved in the published layout) plus ``enorm``, ``hnorm``,
    ``eh_proj``, ``transformer.shared_head.norm`` and ``transformer.shared_head.output`` (the
    LM head's copy). Returns HF's model of ``N + len(mtp_layers)`` main layers whose last ones
    are the MTP layers' blocks (the reference: :func:`hf_mtp_reference`)."""
    import transformers
    from safetensors.torch import load_file, save_file

    path = Path(path)
    text = {**TINY_STEP3P7_TEXT, **text_overrides}
    main, count = int(text["num_hidden_layers"]), len(mtp_layers)
    kinds = list(text["layer_types"]) + [k for k, _ in mtp_layers]

    def by_kind(field: str) -> list[Any]:  # the MTP layers' RoPE: their type's main layers'
        values = list(text[field])
        return values + [values[list(text["layer_types"]).index(k)] for k, _ in mtp_layers]

    moe = [int(i) for i in str(text["moe_layers_enum"]).split(",")]
    moe += [main + i for i, (_, mlp) in enumerate(mtp_layers) if mlp == "sparse"]
    padded = {"layer_types": kinds, "rope_theta": by_kind("rope_theta"),
              "partial_rotary_factors": by_kind("partial_rotary_factors"),
              "moe_layers_enum": ",".join(map(str, moe)),
              "swiglu_limits": list(text["swiglu_limits"]) + [0] * count,
              "swiglu_limits_shared": list(text["swiglu_limits_shared"]) + [0] * count}
    big = transformers.Step3p7Config(
        text_config={**text, **padded, "num_hidden_layers": main + count},
        vision_config=dict(TINY_STEP3P7_VISION), image_token_id=127)
    hf = save_tiny_model(path, "Step3p7ForConditionalGeneration", big)
    config = transformers.Step3p7Config(
        text_config={**text, **padded, "num_nextn_predict_layers": count},
        vision_config=dict(TINY_STEP3P7_VISION), image_token_id=127)
    config.architectures = ["Step3p7ForConditionalGeneration"]
    config.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    head = next(t for name, t in tensors.items() if name.endswith("lm_head.weight"))
    hidden = int(text["hidden_size"])
    gen = torch.Generator().manual_seed(11)
    for i in range(count):
        prefix = f"model.layers.{main + i}."
        assert any(name.startswith(prefix) for name in tensors), sorted(tensors)[:5]
        for norm in ("enorm", "hnorm", "transformer.shared_head.norm"):
            tensors[f"{prefix}{norm}.weight"] = torch.randn(hidden, generator=gen) * 0.3
        tensors[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
        tensors[prefix + "transformer.shared_head.output.weight"] = head.clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return hf


def hf_mtp_reference(model_dir: str | Path, big: Any, index: int,
                     input_ids: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """Logits ``[T, vocab]`` of MTP layer ``index`` of the checkpoint
    :func:`save_tiny_step3p7_mtp` saved at ``model_dir`` over one sequence, as transformers'
    ``MtpLayer`` computes them (its block: ``big``'s layer ``N + index``, eager attention
    with a causal mask, within the window on a sliding layer; then ``shared_head.norm`` and
    the LM head): ``input_ids`` ``[T]`` the tokens at positions ``1 .. T``,
    ``hidden_states`` ``[T, H]`` the main model's final hidden states at ``0 .. T - 1``."""
    import json

    from safetensors.torch import load_file
    from transformers.modeling_layers import MtpLayer
    from transformers.models.step3p7 import modeling_step3p7 as hf_step

    text = big.config.text_config
    main = json.loads((Path(model_dir) / "config.json").read_text())["text_config"]
    layer_idx = int(main["num_hidden_layers"]) + index
    lm = big.model.language_model
    block = lm.layers[layer_idx]
    layer = MtpLayer(text, hf_step.Step3p7DecoderLayer, hf_step.Step3p7RMSNorm, layer_idx)
    layer.mtp_block = block
    tensors = load_file(Path(model_dir) / "model.safetensors")
    prefix = f"model.layers.{layer_idx}."
    with torch.no_grad():
        for mine, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
                             ("post_norm", "transformer.shared_head.norm")):
            getattr(layer, mine).weight.copy_(tensors[f"{prefix}{theirs}.weight"])
        text._attn_implementation = "eager"
        block.self_attn.config._attn_implementation = "eager"
        n = input_ids.shape[0]
        pos = torch.arange(n)
        allowed = pos[None, :] <= pos[:, None]
        if text.layer_types[layer_idx] == "sliding_attention":
            allowed &= pos[:, None] - pos[None, :] < int(text.sliding_window)
        mask = torch.zeros(n, n).masked_fill(~allowed, float("-inf"))[None, None]
        embeds = big.get_input_embeddings()(input_ids[None])
        rope = lm.rotary_emb(embeds, pos[None], text.layer_types[layer_idx])
        out = layer(embeds, hidden_states[None], position_embeddings=rope,
                    attention_mask=mask, position_ids=pos[None], past_key_values=None)
        return cast(torch.Tensor, big.lm_head(out)[0])


def make_mtp_layers_agree(path: str | Path, scale: float = 20.0) -> None:
    """Rewrite the checkpoint :func:`save_tiny_step3p7_mtp` saved at ``path`` so its MTP
    layers often draft what the main model then samples (the speculator's accepting path):
    the token embedding ``scale`` times larger (the main layers then change the residual
    little: the model is near a bigram model), each MTP layer's ``eh_proj`` passing its
    normed token embedding through at the main residual's size, its ``enorm`` plain and its
    ``shared_head.norm`` the final norm's (the MTP layer then predicts, from the token it is
    given, near what the main model predicts from that token)."""
    import json

    from safetensors.torch import load_file, save_file

    path = Path(path)
    text = json.loads((path / "config.json").read_text())["text_config"]
    main, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
    tensors = load_file(path / "model.safetensors")
    embed = next(n for n in tensors if n.endswith("embed_tokens.weight"))
    tensors[embed] = tensors[embed] * scale
    size = float(tensors[embed].pow(2).mean().sqrt())
    final = next(n for n in tensors if n.endswith("norm.weight") and ".layers." not in n
                 and "vision" not in n)
    for i in range(int(text["num_nextn_predict_layers"])):
        prefix = f"model.layers.{main + i}."
        proj = torch.zeros(hidden, 2 * hidden)
        proj[:, :hidden] = torch.eye(hidden) * size
        tensors[prefix + "eh_proj.weight"] = proj
        tensors[prefix + "enorm.weight"] = torch.zeros(hidden)
        tensors[prefix + "transformer.shared_head.norm.weight"] = tensors[final].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
