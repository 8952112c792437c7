"""Qwen3ForCausalLM against HF transformers: prefill and decode logits through the paged cache."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mrv2.attention import AttentionMetadata, ForwardContext, set_forward_context
from mrv2.attention.torch_backend import TorchAttentionBackend
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2_qwen.model import Qwen3ForCausalLM

BLOCK_SIZE = 4
NUM_BLOCKS = 32


def tiny_config(tie: bool, attention_bias: bool = False) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,  # not hidden_size // heads: head_dim must come from the config
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        attention_bias=attention_bias,
    )


def save_hf_model(config: transformers.PretrainedConfig, path: Path) -> torch.nn.Module:
    """A random HF model (weights far from their init values) saved to ``path``."""
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.15)
    hf.save_pretrained(path)
    return hf


def step_metadata(
    contexts: list[int], queries: list[int], tables: list[list[int]], num_pad: int
) -> AttentionMetadata:
    """Metadata for requests with ``contexts[i]`` cached tokens and ``queries[i]`` new ones."""
    starts = [0]
    slots: list[int] = []
    for ctx, n, blocks in zip(contexts, queries, tables, strict=True):
        starts.append(starts[-1] + n)
        slots += [
            blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx, ctx + n)
        ]
    return AttentionMetadata(
        num_reqs=len(queries),
        num_tokens=starts[-1] + num_pad,
        max_query_len=max(queries),
        max_seq_len=max(c + n for c, n in zip(contexts, queries, strict=True)),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(
            [c + n for c, n in zip(contexts, queries, strict=True)], dtype=torch.int32
        ),
        block_table=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1] * num_pad, dtype=torch.int64),
        block_size=BLOCK_SIZE,
    )


def run_step(
    model: torch.nn.Module,
    caches: list[torch.Tensor],
    tables: list[list[int]],
    contexts: list[int],
    new_tokens: list[list[int]],
    num_pad: int = 0,
) -> list[torch.Tensor]:
    """One engine step (padding tokens at the end); per-request logits of the new tokens."""
    ids = sum(new_tokens, []) + [0] * num_pad
    positions = sum(
        (list(range(c, c + len(t))) for c, t in zip(contexts, new_tokens, strict=True)), []
    )
    metadata = step_metadata(contexts, [len(t) for t in new_tokens], tables, num_pad)
    context = ForwardContext(metadata, caches, [TorchAttentionBackend()] * len(caches))
    with torch.inference_mode(), set_forward_context(context):
        hidden = model(
            torch.tensor(ids, dtype=torch.int32), torch.tensor(positions + [0] * num_pad)
        )
        logits = model.compute_logits(hidden)
    assert logits.shape == (len(ids), model.config.vocab_size)
    return list(logits[: len(ids) - num_pad].split([len(t) for t in new_tokens]))


def check_against_hf(model_cls: type, hf: torch.nn.Module, path: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(path)
    model = model_cls(config)
    load_model_weights(model, iter_safetensors(path))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (7, 3, 10)]
    max_blocks = math.ceil(12 / BLOCK_SIZE)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = [perm[i * max_blocks : (i + 1) * max_blocks] for i in range(len(prompts))]
    kv_shape = (2, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, model.config.head_dim)
    caches = [torch.full(kv_shape, 1e4) for _ in range(config.num_hidden_layers)]

    prefill = run_step(model, caches, tables, [0] * len(prompts), prompts, num_pad=2)
    with torch.no_grad():
        for prompt, logits in zip(prompts, prefill, strict=True):
            expected = hf(torch.tensor([prompt])).logits[0]
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)

    next_tokens = torch.randint(0, 128, (len(prompts),), generator=gen).tolist()
    decode = run_step(model, caches, tables, [len(p) for p in prompts], [[t] for t in next_tokens])
    with torch.no_grad():
        for prompt, token, logits in zip(prompts, next_tokens, decode, strict=True):
            expected = hf(torch.tensor([prompt + [token]])).logits[0, -1:]
            torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "tie,attention_bias", [(True, False), (False, False), (False, True)], ids=str
)
def test_matches_hf(tmp_path: Path, tie: bool, attention_bias: bool) -> None:
    hf = save_hf_model(tiny_config(tie, attention_bias), tmp_path)
    check_against_hf(Qwen3ForCausalLM, hf, tmp_path)


def test_tied_checkpoint_may_hold_lm_head(tmp_path: Path) -> None:
    save_hf_model(tiny_config(tie=True), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    embed = tensors.pop("model.embed_tokens.weight")
    save_file({**tensors, "lm_head.weight": embed}, tmp_path / "model.safetensors")
    model = Qwen3ForCausalLM(tiny_config(tie=True))
    load_model_weights(model, iter_safetensors(tmp_path))
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_untied_checkpoint_without_lm_head_is_an_error(tmp_path: Path) -> None:
    save_hf_model(tiny_config(tie=False), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model_weights(Qwen3ForCausalLM(tiny_config(tie=False)), iter_safetensors(tmp_path))


def test_wrong_shape_names_the_parameter(tmp_path: Path) -> None:
    save_hf_model(tiny_config(tie=False), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = torch.randn(tensors[name].shape[0] + 1, tensors[name].shape[1])
    save_file(tensors, tmp_path / "model.safetensors")
    model = Qwen3ForCausalLM(tiny_config(tie=False))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight.*\(49, 64\)"):
        load_model_weights(model, iter_safetensors(tmp_path))


def test_missing_weights_dir(tmp_path: Path) -> None:
    tiny_config(tie=False).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        iter_safetensors(tmp_path)
