"""DeepSeek Sparse Attention (the core's :mod:`mrv2.layers.sparse_mla`) against HF transformers,
over both families that use it: DeepSeek-V3.2 (``DeepseekV32ForCausalLM``, the deepseek plugin;
half-split indexer RoPE) and GLM-5 (``GlmMoeDsaForCausalLM``, the glm plugin; interleaved
indexer RoPE, a ``"shared"`` layer reusing the previous layer's top-k).

``index_topk`` is 4 and the prompts are longer, so the selection changes the result: the test
first checks that HF's logits with the selection turned off (a top-k past every context)
differ from the sparse ones, then compares every logit of a prefill step (with padding) and a
decode step through the latent and indexer caches (poisoned where unwritten), with the
full-width top-k of wide rows and through the Triton kernels (the indexer's scores, written
only up to each token, and its bounded top-k), and greedy tokens through ``LLM`` with
chunked prefill (8 tokens a step: later chunks and decode steps read the indexer keys of
earlier steps from the cache) and with prefix caching (a second prompt sharing whole blocks
with the first); an FP8 checkpoint against HF on its dequantized weights, and dummy
weights. The MTP layer (``build_mtp``:
sparse MLA with an indexer of its own and indexer cache layer, the MoE, enorm / hnorm /
eh_proj) against a plain-torch MTP step over HF's decoder layer, and greedy tokens with
``mtp`` speculation equal to those without."""

from __future__ import annotations

import copy
import importlib
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.attention import ForwardContext, set_forward_context
from mrv2.attention.mla_backend import MLABackend
from mrv2.contract.kv_cache import LatentKVSpec, layer_specs
from mrv2.layers import sparse_mla
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.model_loader.build import process_weights_after_loading
from mrv2.testing import (
    TEST_BLOCK_SIZE,
    TEST_NUM_BLOCKS,
    hf_greedy,
    redraw_weights,
    step_inputs,
    step_metadata,
)
from mrv2.testing_checkpoints import append_mtp_layer, fp8_checkpoint

VOCAB = 128
TOPK = 4
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 24, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
    "max_position_embeddings": 128, "index_topk": TOPK, "index_n_heads": 8,
    "index_head_dim": 16, "rms_norm_eps": 1e-5, "pad_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False,
}
#: ``{case: (architecture, config fields, indexer KV cache layers)}``.
CASES: dict[str, tuple[str, dict[str, Any], int]] = {
    "deepseek-v32": ("DeepseekV32ForCausalLM", {**COMMON}, 3),
    # layer 1 shares layer 0's selection (no indexer, no indexer cache)
    "glm-moe-dsa": ("GlmMoeDsaForCausalLM",
                    {**COMMON, "indexer_types": ["full", "shared", "full"]}, 2),
}
MODULES = {"DeepseekV32ForCausalLM": "mrv2_deepseek.v32", "GlmMoeDsaForCausalLM": "mrv2_glm.dsa"}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 120, 11], [3 + i for i in range(13)], [64, 9]]


def save_hf(path: Path, case: str, **overrides: Any) -> torch.nn.Module:
    arch, fields, _ = CASES[case]
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**fields, **overrides)
    config.architectures = [arch]
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(path)
    return hf


def hf_logits(hf: torch.nn.Module, ids: list[int], topk: int = TOPK) -> torch.Tensor:
    """HF's logits of ``ids`` with every indexer keeping ``topk`` tokens."""
    indexers: list[Any] = [m for m in hf.modules() if hasattr(m, "index_topk")]
    for m in indexers:
        m.index_topk = topk
    try:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0]
    finally:
        for m in indexers:
            m.index_topk = TOPK


def check_steps(model: Any, hf: torch.nn.Module, num_indexers: int) -> None:
    """A prefill step of three prompts (two longer than ``index_topk``) and two padding rows,
    then a decode step, every logit against HF's full forward."""
    specs = layer_specs(model)
    assert [specs[i] for i in range(3)] == [LatentKVSpec(32 + 8)] * 3
    assert [specs[i] for i in range(3, len(specs))] == [LatentKVSpec(16)] * num_indexers
    widths = [cast(LatentKVSpec, specs[i]).latent_dim for i in range(len(specs))]
    caches = [torch.full((TEST_NUM_BLOCKS, TEST_BLOCK_SIZE, w), 1e4) for w in widths]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 3, 12)]
    perm = torch.randperm(TEST_NUM_BLOCKS, generator=gen).tolist()
    tables = [perm[4 * i:4 * i + 4] for i in range(len(prompts))]

    def step(contexts: list[int], tokens: list[list[int]], pad: int) -> list[torch.Tensor]:
        ids, positions = step_inputs(contexts, tokens, pad)
        metadata = step_metadata(contexts, [len(t) for t in tokens], tables, pad)
        context = ForwardContext(metadata, caches, [MLABackend()] * len(caches))
        with torch.inference_mode(), set_forward_context(context):
            logits = model.compute_logits(model(ids, positions))
        return list(logits[:len(ids) - pad].split([len(t) for t in tokens]))

    nxt = torch.randint(0, VOCAB, (len(prompts),), generator=gen).tolist()
    prefill = step([0] * len(prompts), prompts, 2)
    decode = step([len(p) for p in prompts], [[t] for t in nxt], 0)
    for prompt, token, first, second in zip(prompts, nxt, prefill, decode, strict=True):
        expected = hf_logits(hf, prompt + [token])
        torch.testing.assert_close(first, expected[:-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(second, expected[-1:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_sparse_attention_matches_hf(tmp_path: Path, case: str,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    arch, _, num_indexers = CASES[case]
    hf = save_hf(tmp_path, case)
    # the selection matters: dense attention (top-k past every context) gives other logits
    sparse, dense = hf_logits(hf, PROMPTS[1]), hf_logits(hf, PROMPTS[1], topk=1000)
    assert torch.allclose(sparse[:TOPK], dense[:TOPK])  # (no more than TOPK keys yet)
    assert (sparse[TOPK:] - dense[TOPK:]).abs().amax(dim=-1).min() > 1e-2

    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = getattr(importlib.import_module(MODULES[arch]), arch)(config)
    load_model_weights(model, iter_safetensors(tmp_path))
    process_weights_after_loading(model)
    with monkeypatch.context() as patch:  # torch.topk over the full width (wide rows)
        patch.setattr(sparse_mla, "BOUNDED_TOPK_MAX_SPAN", 0)
        check_steps(model.eval(), hf, num_indexers)
    with monkeypatch.context() as patch:  # the Triton kernels (interpreted) as on a GPU
        patch.setenv("MRV2_KERNELS", "triton")
        check_steps(model, hf, num_indexers)

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [hf_greedy(tmp_path, p, 8) for p in PROMPTS]
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # prefix caching: the second prompt's first 8 tokens are the first's (two whole blocks)
    shared = PROMPTS[0][:8] + [99, 98, 97]
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              enable_prefix_caching=True)
    first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": shared}], params, use_tqdm=False)
    assert first[0].outputs[0].token_ids == expected[0]
    assert second[0].outputs[0].token_ids == hf_greedy(tmp_path, shared, 8)
    assert llm.engine.stats()["prefix_cache_hits"] > 0
    # FP8 (the indexer's wq_b / wk too, as DeepSeek-V3.2-FP8 publishes them): HF's tokens on the
    # dequantized weights; and random weights load (--load-format dummy)
    fp8_checkpoint(tmp_path, tmp_path / "fp8", tmp_path / "ref", block=(16, 16))
    llm = LLM(str(tmp_path / "fp8"), device="cpu", dtype="float32", block_size=4)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == hf_greedy(tmp_path / "ref", PROMPTS[0], 8)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, load_format="dummy")
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 8


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def mtp_reference(hf: Any, path: Path) -> Any:
    """Append an MTP layer (HF's decoder layer for index ``num_hidden_layers``: the MoE and a
    ``"full"`` indexer) to the checkpoint in ``path``; return ``ref(next_tokens, previous,
    topk) -> (outputs, logits)``: the plain-torch MTP step over one whole sequence
    (DeepSeek-V3 section 2.2: ``eh_proj([enorm(embed(t)); hnorm(h)])``, the block with a causal
    mask; the logits through ``shared_head.norm`` and the shared LM head)."""
    from safetensors.torch import load_file

    config = hf.config
    n = config.num_hidden_layers
    block_config = copy.deepcopy(config)
    block_config.mlp_layer_types = [*config.mlp_layer_types, "sparse"]
    if getattr(config, "indexer_types", None) is not None:
        block_config.indexer_types = [*config.indexer_types, "full"]
    block_config._attn_implementation = "eager"
    layer = type(hf.model.layers[0])(block_config, n).eval()
    append_mtp_layer(path, layer, std=0.08)
    own = {k.split(".", 3)[3]: v for k, v in load_file(path / "model.safetensors").items()
           if k.startswith(f"model.layers.{n}.")}
    eps = float(config.rms_norm_eps)
    embed, head = hf.model.embed_tokens.weight, hf.lm_head.weight

    @torch.no_grad()
    def ref(next_tokens: list[int], previous: torch.Tensor,
            topk: int = TOPK) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([rms(embed[next_tokens], own["enorm.weight"], eps),
                       rms(previous, own["hnorm.weight"], eps)], dim=-1) @ own["eh_proj.weight"].T
        seq = x.shape[0]
        mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
        pos = torch.arange(seq)[None]
        for m in layer.modules():
            if hasattr(m, "index_topk"):
                m.index_topk = topk
        out = layer(x[None], attention_mask=mask, position_ids=pos,
                    position_embeddings=hf.model.rotary_emb(x[None], pos))
        out = (out[0] if isinstance(out, tuple) else out)[0]
        return out, rms(out, own["shared_head.norm.weight"], eps) @ head.T

    return ref


@pytest.mark.parametrize("case", list(CASES))
def test_mtp_layer_matches_reference_and_drafts(tmp_path: Path, case: str) -> None:
    arch, _, num_indexers = CASES[case]
    hf: Any = save_hf(tmp_path, case, num_nextn_predict_layers=1)
    ref = mtp_reference(hf, tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = getattr(importlib.import_module(MODULES[arch]), arch)(config)
    load_model_weights(model, iter_safetensors(tmp_path))
    first = len(layer_specs(model))  # as the runner numbers a drafter's cache layers
    mtp = model.build_mtp(first_layer_idx=first)
    load_model_weights(mtp, iter_safetensors(tmp_path))
    process_weights_after_loading(model)
    process_weights_after_loading(mtp)
    # its latents, then its own indexer keys, after the main model's layers
    assert first == 3 + num_indexers
    assert mtp.kv_cache_specs() == {first: LatentKVSpec(32 + 8), first + 1: LatentKVSpec(16)}

    widths = [40] * 3 + [16] * num_indexers + [40, 16]
    caches = [torch.full((TEST_NUM_BLOCKS, TEST_BLOCK_SIZE, w), 1e4) for w in widths]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (9, 12)]
    sampled = torch.randint(0, VOCAB, (2, 3), generator=gen).tolist()
    perm = torch.randperm(TEST_NUM_BLOCKS, generator=gen).tolist()
    tables = [perm[:4], perm[4:8]]

    def step(module: Any, contexts: list[int], tokens: list[list[int]], pad: int,
             previous: torch.Tensor | None = None, mtp_step: int = 0) -> torch.Tensor:
        ids, positions = step_inputs(contexts, tokens, pad)
        metadata = step_metadata(contexts, [len(t) for t in tokens], tables, pad)
        context = ForwardContext(metadata, caches, [MLABackend()] * len(caches))
        with torch.inference_mode(), set_forward_context(context):
            if previous is None:
                return cast(torch.Tensor, module(ids, positions))
            return cast(torch.Tensor, module(ids, positions, previous, step=mtp_step))

    lens = [len(p) for p in prompts]
    hidden = step(model, [0, 0], prompts, 2)  # the target's prefill, then MTP's catch-up
    out = step(mtp, [0, 0], [p[1:] + [s[0]] for p, s in zip(prompts, sampled, strict=True)], 2,
               hidden)
    prefill = mtp.compute_logits(out)
    hidden = step(model, lens, [[s[0]] for s in sampled], 0)  # a decode step and its MTP row
    out = step(mtp, lens, [[s[1]] for s in sampled], 0, hidden)
    decode = mtp.compute_logits(out)
    out = step(mtp, [n + 1 for n in lens], [[s[2]] for s in sampled], 0, out, mtp_step=1)
    draft = mtp.compute_logits(out)  # a chained draft step: the previous MTP output
    rows = 0
    for i, (prompt, toks) in enumerate(zip(prompts, sampled, strict=True)):
        with torch.no_grad():
            main = hf.model(torch.tensor([prompt + toks[:1]])).last_hidden_state[0]
        nexts = prompt[1:] + toks[:2]
        chained = torch.cat([main, ref(nexts, main)[0][-1:]])
        expected = ref(nexts + toks[2:], chained)[1]
        # the MTP layer's own selection matters (dense attention gives other logits)
        assert (expected - ref(nexts + toks[2:], chained, 1000)[1]).abs().max() > 1e-3
        n = len(prompt)
        torch.testing.assert_close(prefill[rows:rows + n], expected[:n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(decode[i], expected[n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(draft[i], expected[n + 1], atol=1e-4, rtol=1e-4)
        rows += n

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = []
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 2}):
        kwargs: dict[str, Any] = {} if spec is None else {"speculative_config": spec}
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[1] == runs[0]
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
