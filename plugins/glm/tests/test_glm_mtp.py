"""GLM-4.x MTP layers: a checkpoint carrying them (with the duplicate embedding and head copies
real checkpoints may have) loads strictly into the main model, which skips them, and into
``build_mtp()``, which shares the main model's embedding and head; the MTP forward through its
own paged cache layer (prefill, a decode step, a chained draft step) matches the plain-torch
reference of ``mtp_reference.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from glm_common import (
    VOCAB,
    glm_config,
    new_caches,
    redraw_weights,
    run_step,
    save_hf_glm,
    step_metadata,
    torch_context,
)
from mtp_reference import MTPReference
from safetensors.torch import load_file, save_file
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeDecoderLayer

from mrv2.attention import set_forward_context
from mrv2.contract.kv_cache import PagedKVSpec
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.model_loader.build import process_weights_after_loading
from mrv2_glm.model import Glm4MoeForCausalLM
from mrv2_glm.mtp import Glm4MoeMTP


def mtp_tensors(config: Any, tensors: dict[str, torch.Tensor], layer: int,
                seed: int) -> dict[str, torch.Tensor]:
    """Random weights of MTP layer ``layer``, named as GLM-4.5's checkpoints name them (one
    tensor per expert), plus its copies of the main embedding and LM head."""
    block = Glm4MoeDecoderLayer(config, layer)
    redraw_weights(block, seed)
    inter = config.moe_intermediate_size
    prefix = f"model.layers.{layer}."
    out: dict[str, torch.Tensor] = {}
    for name, tensor in block.state_dict().items():
        if name == "mlp.experts.gate_up_proj":
            for e in range(tensor.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = tensor[e, :inter].clone()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = tensor[e, inter:].clone()
        elif name == "mlp.experts.down_proj":
            for e in range(tensor.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = tensor[e].clone()
        else:
            out[prefix + name] = tensor.clone()
    gen = torch.Generator().manual_seed(seed + 100)
    hidden = config.hidden_size
    out[prefix + "enorm.weight"] = torch.rand(hidden, generator=gen) + 0.5
    out[prefix + "hnorm.weight"] = torch.rand(hidden, generator=gen) + 0.5
    out[prefix + "shared_head.norm.weight"] = torch.rand(hidden, generator=gen) + 0.5
    out[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
    out[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    out[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    return out


def checkpoint_with_mtp(
    path: Path, **overrides: Any
) -> tuple[transformers.Glm4MoeForCausalLM, dict[str, torch.Tensor]]:
    """HF's checkpoint with the MTP layers' tensors added to ``model.safetensors``."""
    hf = save_hf_glm(path, **overrides)
    config = transformers.AutoConfig.from_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    for i in range(config.num_nextn_predict_layers):
        tensors.update(mtp_tensors(config, tensors, config.num_hidden_layers + i, seed=7 + i))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return hf, tensors


def load_both(path: Path) -> tuple[Glm4MoeForCausalLM, Glm4MoeMTP]:
    config = transformers.AutoConfig.from_pretrained(path)
    model = Glm4MoeForCausalLM(config)
    loaded = load_model_weights(model, iter_safetensors(path))
    assert not any(f"layers.{config.num_hidden_layers}." in name for name in loaded)
    mtp = model.build_mtp()
    load_model_weights(mtp, iter_safetensors(path))
    process_weights_after_loading(model)  # as build_model does; then the drafter's
    process_weights_after_loading(mtp)
    return model, mtp


def test_mtp_matches_reference(tmp_path: Path) -> None:
    hf, tensors = checkpoint_with_mtp(tmp_path)
    model, mtp = load_both(tmp_path)
    config = model.config
    n_main = config.num_hidden_layers
    assert mtp.kv_cache_specs() == {n_main: PagedKVSpec(config.num_key_value_heads, 24)}
    ref = MTPReference(config, tensors, tensors["model.embed_tokens.weight"],
                       tensors["lm_head.weight"])

    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (6, 9)]
    sampled = torch.randint(0, VOCAB, (2, 3), generator=gen).tolist()  # 3 tokens per request
    perm = torch.randperm(24, generator=gen).tolist()
    tables = [perm[:4], perm[4:8]]
    caches = new_caches(config, n_main + 1)  # the main layers', then the MTP layer's

    def mtp_step(contexts: list[int], tokens: list[list[int]], previous: torch.Tensor,
                 step: int = 0, num_pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        ids = sum(tokens, []) + [0] * num_pad
        positions = sum((list(range(c, c + len(t))) for c, t in zip(contexts, tokens,
                                                                     strict=True)), [])
        metadata = step_metadata(contexts, [len(t) for t in tokens], tables, num_pad)
        with torch.inference_mode(), set_forward_context(torch_context(caches, metadata)):
            out = mtp(torch.tensor(ids, dtype=torch.int32),
                      torch.tensor(positions + [0] * num_pad), previous, step=step)
            return out, mtp.compute_logits(out, step=step)

    # Prefill: the main model over the prompts, then MTP step 0 over the same positions with
    # the tokens shifted left by one (the last: the token the main model "sampled").
    _, hidden = run_step(model, caches, tables, [0, 0], prompts, num_pad=2)
    shifted = [p[1:] + [s[0]] for p, s in zip(prompts, sampled, strict=True)]
    _, prefill_logits = mtp_step([0, 0], shifted, hidden, num_pad=2)
    # Decode: the main model at the sampled token, MTP step 0 with the next sampled token.
    lens = [len(p) for p in prompts]
    _, hidden = run_step(model, caches, tables, lens, [[s[0]] for s in sampled])
    out, decode_logits = mtp_step(lens, [[s[1]] for s in sampled], hidden)
    # A chained draft: MTP step 1 (the same layer), fed step 0's output and a draft token.
    _, draft_logits = mtp_step([n + 1 for n in lens], [[s[2]] for s in sampled], out, step=1)

    rows = 0
    for i, (prompt, toks) in enumerate(zip(prompts, sampled, strict=True)):
        full = torch.tensor(prompt + [toks[0]])
        with torch.no_grad():
            main_hidden = hf.model(full[None]).last_hidden_state[0]
        nexts = torch.tensor(prompt[1:] + toks[:2])
        out_ref = ref.hidden(nexts, main_hidden, torch.arange(len(full)))
        chained = ref.hidden(torch.cat([nexts, torch.tensor(toks[2:])]),
                             torch.cat([main_hidden, out_ref[-1:]]), torch.arange(len(full) + 1))
        expected = ref.logits(chained)
        n = len(prompt)
        torch.testing.assert_close(prefill_logits[rows:rows + n], expected[:n],
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(decode_logits[i], expected[n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(draft_logits[i], expected[n + 1], atol=1e-4, rtol=1e-4)
        rows += n
    assert caches[n_main][0, tables[0][0], 0].abs().max() < 1e3  # the MTP layer wrote its own


def test_build_mtp_shares_embedding_and_head(tmp_path: Path) -> None:
    checkpoint_with_mtp(tmp_path)
    model, mtp = load_both(tmp_path)
    assert mtp.embed_tokens is model.model.embed_tokens and mtp.lm_head is model.lm_head
    assert mtp.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert mtp.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    names = [name for name, _ in mtp.named_parameters()]
    assert not any("embed_tokens" in n or "head.weight" in n for n in names), names
    assert {n.split(".")[2] for n in names} == {"enorm", "hnorm", "eh_proj", "mtp_block",
                                                "shared_head"}
    assert "layers.0.mtp_block.mlp.experts.w13_weight" in names
    assert "layers.0.mtp_block.mlp.shared_experts.gate_up_proj.weight" in names


def test_main_model_loads_strictly_beside_mtp_tensors(tmp_path: Path) -> None:
    """The main model's logits are untouched by the MTP tensors (HF's, which ignores them)."""
    hf, _ = checkpoint_with_mtp(tmp_path)
    model, _ = load_both(tmp_path)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    logits, _ = run_step(model, new_caches(model.config, 3), [[0, 1]], [0], [tokens])
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)


def test_mtp_load_is_strict(tmp_path: Path) -> None:
    _, tensors = checkpoint_with_mtp(tmp_path)
    del tensors["model.layers.3.hnorm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = Glm4MoeForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path))
    load_model_weights(model, iter_safetensors(tmp_path))
    with pytest.raises(ValueError, match=r"layers\.0\.hnorm\.weight"):
        load_model_weights(model.build_mtp(), iter_safetensors(tmp_path))


def test_several_mtp_layers_and_cache_numbering() -> None:
    config = glm_config(num_nextn_predict_layers=2)
    model = Glm4MoeForCausalLM(config)
    mtp = model.build_mtp(first_layer_idx=5)
    spec = PagedKVSpec(config.num_key_value_heads, 24)
    assert mtp.kv_cache_specs() == {5: spec, 6: spec}
    assert model.build_mtp().kv_cache_specs() == {3: spec, 4: spec}
    assert mtp.rename("model.layers.4.mlp.experts.1.up_proj.weight") == (
        "layers.1.mtp_block.mlp.experts.1.up_proj.weight")
    assert mtp.rename("model.layers.4.eh_proj.weight") == "layers.1.eh_proj.weight"
    assert mtp.rename("model.layers.3.shared_head.norm.weight") == (
        "layers.0.shared_head.norm.weight")
    for skipped in ("model.layers.3.embed_tokens.weight", "model.layers.4.shared_head.head.weight",
                    "model.layers.2.mlp.gate.weight", "model.embed_tokens.weight",
                    "lm_head.weight", "model.norm.weight"):
        assert mtp.rename(skipped) is None, skipped
    assert model.rename("model.layers.3.enorm.weight") is None
    assert model.rename("model.layers.2.mlp.gate.weight") == "model.layers.2.mlp.gate.weight"
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        Glm4MoeForCausalLM(glm_config(num_nextn_predict_layers=0)).build_mtp()


def test_build_mtp_follows_the_model_dtype() -> None:
    model = Glm4MoeForCausalLM(glm_config()).to(torch.bfloat16)
    mtp = model.build_mtp()
    assert mtp.layers[0].eh_proj.weight.dtype == torch.bfloat16
    bias = mtp.layers[0].mtp_block.mlp.gate.e_score_correction_bias
    assert bias is not None and bias.dtype == torch.float32
    assert torch.get_default_dtype() == torch.float32
