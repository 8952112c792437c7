"""Llama 4's text model (``Llama4ForCausalLM`` and the text path of
``Llama4ForConditionalGeneration``) against HF transformers, on a tiny model where every
option bites (:data:`mrv2_llama4.testing.TINY_LLAMA4`: RoPE layers with llama3 scaling, the
q/k norm and chunked attention; NoPE layers with the query temperature past
``floor_scale``; MoE layers, top-1 sigmoid-scored input plus a shared expert, between dense
ones): prefill and decode logits through the paged cache, what goes wrong without each part,
greedy tokens of several requests through the engine with prompts split over steps, every
prompt position's log-probability, TP=2 through two CPU processes, images refused by a
checkpoint without a tokenizer (images: ``test_llama4_images.py``); and, with chunks of 32
positions, steps and generations across several chunk boundaries (``max_model_len`` past
``attention_chunk_size``: the RoPE table sized to it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers

import mrv2.testing
import mrv2_llama4.model as llama4
from mrv2 import LLM, SamplingParams
from mrv2.contract.kv_cache import AttentionChunk
from mrv2.layers import GatedMLP
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import check_steps_against_hf, poisoned_caches, run_step
from mrv2.testing_engine import check_prompt_logprobs, tokens_at_tp
from mrv2_llama4.model import (
    Llama4Attention,
    Llama4ForCausalLM,
    Llama4ForConditionalGeneration,
    Llama4MoE,
    attention_temperature,
    chunked_layers,
    moe_layers,
    rope_layers,
)
from mrv2_llama4.state import context_length
from mrv2_llama4.testing import TINY_LLAMA4, save_tiny_llama4, save_tiny_llama4_vl

CLASSES: dict[str, type[Llama4ForCausalLM]] = {
    "causal": Llama4ForCausalLM, "conditional": Llama4ForConditionalGeneration}
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 120, 11, 19, 64, 2], [3 + i for i in range(23)],
           [64], [90, 91]]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
PROMPT = [5, 17, 42, 9, 100, 3, 77, 8, 8, 120, 11, 19]


def _save(path: Path, case: str, **overrides: Any) -> torch.nn.Module:
    save = save_tiny_llama4_vl if case == "conditional" else save_tiny_llama4
    return save(path, **overrides)


@pytest.fixture(scope="module", params=list(CLASSES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[str, Path, torch.nn.Module]]:
    """``(case, path, HF's model)`` of each architecture, saved once."""
    case = str(request.param)
    path = tmp_path_factory.mktemp(case)
    yield case, path, _save(path, case)


def _load(path: Path, case: str) -> Llama4ForCausalLM:
    model = CLASSES[case](transformers.AutoConfig.from_pretrained(path))
    load_model_weights(model, iter_safetensors(path))
    return model


def _caches() -> list[torch.Tensor]:
    return poisoned_caches(2, 16, 4)


def _hf_logits(hf: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0]


def _engine_logits(model: Llama4ForCausalLM, prompt: list[int]) -> torch.Tensor:
    (logits,), _ = run_step(model, _caches(), [[0, 1, 2, 3]], [0], [prompt])
    return logits


def test_layers_are_where_the_config_says(
        checkpoint: tuple[str, Path, torch.nn.Module]) -> None:
    case, path, _ = checkpoint
    model = _load(path, case)
    layers = model.model.layers
    assert [type(layer.mlp) for layer in layers] == [GatedMLP, Llama4MoE, GatedMLP, Llama4MoE]
    attns = [layer.self_attn for layer in layers]
    assert all(isinstance(a, Llama4Attention) for a in attns)
    assert [a.rotary_emb is not None for a in attns] == [True, True, False, False]
    assert [a.l2_norm_eps is not None for a in attns] == [True, True, False, False]
    assert [a.temperature for a in attns] == [None, None, (2.0, 0.5), (2.0, 0.5)]
    assert attns[0].rotary_emb is not None and attns[0].rotary_emb.max_position == 64
    assert layers[0].mlp.gate_up_proj.output_size == 2 * 48  # intermediate_size_mlp
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_logits_match_hf(checkpoint: tuple[str, Path, torch.nn.Module]) -> None:
    """A prefill step (two padding rows) then a decode step, every logit within 1e-4 of HF's
    full forward."""
    case, path, hf = checkpoint
    check_steps_against_hf(_load(path, case), hf, _caches(), (9, 3, 13), vocab=125,
                           max_len=16)


def test_top2_logits_match_hf(tmp_path: Path) -> None:
    """Top-2 routing (a row per (token, pick), each scaled by its own score) is HF's too."""
    hf = save_tiny_llama4(tmp_path, num_experts_per_tok=2)
    check_steps_against_hf(_load(tmp_path, "causal"), hf, _caches(), (9, 3, 13), vocab=125,
                           max_len=16)


def test_logits_match_hf_on_the_triton_kernels(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The same steps on the GPU's kernels, interpreted (``MRV2_KERNELS=triton``; the Triton
    attention backend, which rotates q and k inside attention with the unit-weight q/k norm
    fused, and the fused MoE)."""
    from mrv2.attention import ForwardContext
    from mrv2.attention.triton_backend import TritonAttentionBackend

    hf = save_tiny_llama4(tmp_path)
    backend = TritonAttentionBackend()
    assert backend.rope_in_attention
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    monkeypatch.setattr(mrv2.testing, "torch_context", lambda caches, metadata: ForwardContext(
        metadata, caches, [backend] * len(caches)))
    check_steps_against_hf(_load(tmp_path, "causal"), hf, _caches(), (9, 3, 13), vocab=125,
                           max_len=16)


def _no_reorder(monkeypatch: pytest.MonkeyPatch, model: Any) -> None:
    del model
    monkeypatch.setattr(llama4, "_halves", lambda rows, head_dim: rows)


def _no_qk_norm(monkeypatch: pytest.MonkeyPatch, model: Any) -> None:
    for layer in model.model.layers:
        monkeypatch.setattr(layer.self_attn, "l2_norm_eps", None)


def _no_temperature(monkeypatch: pytest.MonkeyPatch, model: Any) -> None:
    for layer in model.model.layers:
        monkeypatch.setattr(layer.self_attn, "temperature", None)


def _scores_on_output(monkeypatch: pytest.MonkeyPatch, model: Any) -> None:
    def forward(self: Llama4MoE, x: torch.Tensor) -> torch.Tensor:
        scores, ids = self.gate(x)
        shared = self.shared_experts
        assert shared is not None
        return self.experts(x, scores.float(), ids) + shared(x)

    monkeypatch.setattr(Llama4MoE, "forward", forward)


#: ``(what is taken away, how, the prompt positions whose logits still match HF's)``: the
#: first token sees only itself at position 0 (no rotation; temperature 1 below floor_scale).
BREAKS = {"rope-row-reorder": (_no_reorder, 1), "qk-norm": (_no_qk_norm, 1),
          "temperature": (_no_temperature, 1), "scores-on-expert-output": (_scores_on_output, 0)}


@pytest.mark.parametrize("part", list(BREAKS))
def test_each_part_matters(tmp_path: Path, part: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without each part, HF's logits are lost (at every position past those the part cannot
    touch): the test model exercises all of them."""
    hf = save_tiny_llama4(tmp_path / "m")
    want = _hf_logits(hf, PROMPT)
    model = _load(tmp_path / "m", "causal")
    torch.testing.assert_close(_engine_logits(model, PROMPT), want, atol=1e-4, rtol=1e-4)
    breaks, same = BREAKS[part]
    breaks(monkeypatch, model)
    if part == "rope-row-reorder":
        model = _load(tmp_path / "m", "causal")
    got = _engine_logits(model, PROMPT)
    torch.testing.assert_close(got[:same], want[:same], atol=1e-4, rtol=1e-4)
    assert all((got[i] - want[i]).abs().amax() > 1e-3 for i in range(same, len(PROMPT)))


def test_temperature_and_layout_helpers() -> None:
    """The query temperature is HF's (1 below ``floor_scale``, then growing by log steps);
    the layer layouts follow HF's defaults: a NoPE layer every ``no_rope_layer_interval``
    layers, MoE every ``interleave_moe_layer_step`` (Maverick: 2), chunked attention on the
    RoPE layers unless ``attention_chunk_size`` is unset."""
    scale = attention_temperature(torch.arange(10), floor_scale=4, attn_scale=0.1)
    want = [1.0] * 3 + [1 + 0.1 * float(torch.log1p(torch.tensor(float((p + 1) // 4))))
                        for p in range(3, 10)]
    torch.testing.assert_close(scale, torch.tensor(want))
    config = transformers.Llama4TextConfig(num_hidden_layers=8, interleave_moe_layer_step=2,
                                           use_qk_norm=False)
    assert rope_layers(config) == [True, True, True, False] * 2
    assert moe_layers(config) == {1, 3, 5, 7}
    assert chunked_layers(config) == rope_layers(config)
    plain = SimpleNamespace(num_hidden_layers=6, nope_layer_interval=3,
                            interleave_moe_layer_step=3)  # (a config transformers lacks)
    assert rope_layers(plain) == [True, True, False] * 2 and moe_layers(plain) == {2, 5}
    assert chunked_layers(plain) == [False] * 6  # (no attention_chunk_size)
    with pytest.raises(ValueError, match="no_rope_layers lists 2 layers"):
        rope_layers(SimpleNamespace(num_hidden_layers=3, no_rope_layers=[1, 0]))


#: Chunks of 32 positions and room for 256 (the engine's max_model_len below: 200).
CHUNKED = {"attention_chunk_size": 32, "max_position_embeddings": 256}


def _chunked_steps(model: Llama4ForCausalLM, hf: torch.nn.Module) -> list[int]:
    """Two requests through three steps (prompt parts of 45 + 30 and 20 + 44 tokens, across
    chunk boundaries of 32, then one decode token each: at position 75, and at 64, the first
    of a chunk), every logit against HF's full forward of the same tokens; returns the first
    request's tokens."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 125, (76,), generator=gen).tolist(),
               torch.randint(2, 125, (65,), generator=gen).tolist()]
    with torch.no_grad():
        want = [hf(torch.tensor([p])).logits[0] for p in prompts]
    caches = poisoned_caches(2, 16, 4, num_blocks=48)
    tables = [list(range(0, 48, 2)), list(range(1, 48, 2))]  # (19 and 17 blocks used)
    done = [0, 0]
    for sizes in ((45, 20), (30, 44), (1, 1)):
        new = [p[c:c + n] for p, c, n in zip(prompts, done, sizes, strict=True)]
        logits, _ = run_step(model, caches, tables, list(done), new, num_pad=2)
        for got, w, c, n in zip(logits, want, done, sizes, strict=True):
            torch.testing.assert_close(got, w[c:c + n], atol=1e-4, rtol=1e-4)
        done = [c + n for c, n in zip(done, sizes, strict=True)]
    return prompts[0]


def test_chunked_attention_matches_hf_past_the_chunk(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 32 positions (layers 0 and 1): prefill chunks and decode steps past several
    chunk boundaries give HF's logits (HF's sdpa attention applies its chunked mask: its
    logits past the first chunk differ from the same weights' with chunks of 256); without
    the chunks, the logits past the first chunk are lost."""
    hf: Any = save_tiny_llama4(tmp_path / "m", **CHUNKED)
    assert hf.config._attn_implementation == "sdpa"
    model = _load(tmp_path / "m", "causal")
    assert [layer.self_attn.attn.attention_chunk for layer in model.model.layers] == [
        32, 32, None, None]
    prompt = _chunked_steps(model, hf)
    wide = save_tiny_llama4(tmp_path / "wide", **{**CHUNKED, "attention_chunk_size": 256})
    with torch.no_grad():
        ids = torch.tensor([prompt])
        chunked, causal = hf(ids).logits[0], wide(ids).logits[0]
    torch.testing.assert_close(chunked[:32], causal[:32], atol=1e-5, rtol=1e-5)
    assert ((chunked[32:] - causal[32:]).abs().amax(-1) > 1e-3).all()
    for layer in model.model.layers:
        monkeypatch.setattr(layer.self_attn.attn, "attention_chunk", None)
    (got,), _ = run_step(model, poisoned_caches(2, 16, 4), [list(range(10))], [0], [prompt[:40]])
    torch.testing.assert_close(got[:32], chunked[:32], atol=1e-4, rtol=1e-4)
    assert ((got[32:40] - chunked[32:40]).abs().amax(-1) > 1e-3).all()


def test_chunked_attention_on_the_triton_kernels(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 8 on the Triton attention backend, interpreted: a prefill step (prompts of 9,
    3 and 13 tokens, two across a chunk boundary) then a decode step give HF's logits."""
    from mrv2.attention import ForwardContext
    from mrv2.attention.triton_backend import TritonAttentionBackend

    hf = save_tiny_llama4(tmp_path, attention_chunk_size=8)
    backend = TritonAttentionBackend()
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    monkeypatch.setattr(mrv2.testing, "torch_context", lambda caches, metadata: ForwardContext(
        metadata, caches, [backend] * len(caches)))
    check_steps_against_hf(_load(tmp_path, "causal"), hf, _caches(), (9, 3, 13), vocab=125,
                           max_len=16)


def test_context_length_and_rope_table() -> None:
    """The engine's context length (``max_model_len``, else ``max_position_embeddings``) sizes
    the RoPE table, past ``attention_chunk_size`` too; a table of no position is refused."""
    config = transformers.Llama4TextConfig(attention_chunk_size=8192,
                                           max_position_embeddings=10485760)
    assert context_length(config, None) == 10485760
    assert context_length(config, 131072) == 131072
    model = Llama4ForCausalLM(transformers.Llama4TextConfig(**{**TINY_LLAMA4, **CHUNKED}))
    rope = model.model.layers[0].self_attn.rotary_emb
    assert rope is not None and rope.max_position == 256
    model.size_rope_table(100)
    ropes = [layer.self_attn.rotary_emb for layer in model.model.layers]
    assert ropes[0] is ropes[1] and ropes[0] is not None and ropes[0].max_position == 100
    assert ropes[2:] == [None, None]
    with pytest.raises(ValueError, match="max_position must be >= 1, got 0"):
        model.size_rope_table(0)


def _hf_tokens(hf: Any, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    hf.generation_config.eos_token_id = None  # (as ignore_eos)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                          dtype=torch.long), max_new_tokens=new_tokens, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


def test_engine_matches_hf(checkpoint: tuple[str, Path, torch.nn.Module]) -> None:
    """Greedy tokens of several requests at once (prompts split over steps of 8 tokens) are
    HF ``generate``'s, every prompt position's log-probability within 1e-4 of HF's forward;
    the multimodal checkpoint, saved without a tokenizer, refuses images naming why and
    serves text."""
    case, path, hf = checkpoint
    want = [_hf_tokens(hf, p) for p in PROMPTS]
    with LLM(str(path), device="cpu", dtype="float32", block_size=4,
             max_num_batched_tokens=8) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                            use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        prompt = PROMPTS[1]
        check_prompt_logprobs(llm, {"prompt_token_ids": prompt}, prompt,
                              _hf_logits(hf, prompt))
        if case == "conditional":
            image = {"prompt_token_ids": [5, 125, 6], "multi_modal_data": {"image": object()}}
            with pytest.raises(ValueError, match=r"multi_modal_data\.image: .* needs the "
                               r"checkpoint's tokenizer"):  # (this checkpoint has none)
                llm.generate([image], GREEDY, use_tqdm=False)
            again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
            assert list(again[0].outputs[0].token_ids) == want[0]


def test_engine_matches_hf_past_the_chunk(tmp_path: Path) -> None:
    """``max_model_len`` 200 with chunks of 32 (once refused): the RoPE table has 200 rows;
    the chunked layers get a block table of their own, sharing the full layers' tensors,
    whose blocks of a request's earlier chunks go back to the pool as it runs, in a pool too
    small to keep them (the two requests, 110 and 70 tokens, would hold 46 blocks in each of
    the 2 tables of 80 blocks); greedy tokens of two requests whose prompts (split over steps
    of 16 tokens) and generations cross several chunk boundaries are HF ``generate``'s, and
    again in a second round through the prefix cache (hits through both tables); every
    prompt position's log-probability within 1e-4 of HF's forward."""
    hf = save_tiny_llama4(tmp_path, **CHUNKED)
    prompts = [[(7 * i) % 120 + 3 for i in range(70)], [(11 * i) % 120 + 3 for i in range(30)]]
    want = [_hf_tokens(hf, p, 40) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, max_model_len=200,
             max_num_batched_tokens=16, num_gpu_blocks_override=80,
             enable_prefix_caching=True) as llm:
        runner, engine = llm.engine.runner, llm.engine
        rope = runner.model.model.layers[0].self_attn.rotary_emb
        assert rope.max_position == 200
        assert runner.kv_table_windows == (None, AttentionChunk(32))
        assert runner.kv.tensors[0] is runner.kv.tensors[2]  # (chunked layers 0-1, full 2-3)
        for round_ in range(2):
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == want, round_
            assert engine.block_manager.num_free_blocks == 80  # nothing leaked
        # 110 and 70 tokens: chunks 0-2 and 0-1 left behind, 8 blocks each (the first round)
        assert engine.scheduler.tables.num_freed >= (3 + 2) * 8
        assert engine.block_manager.num_hit_tokens > 0
        check_prompt_logprobs(llm, {"prompt_token_ids": prompts[0]}, prompts[0],
                              _hf_logits(hf, prompts[0]))


def test_auto_max_model_len_sizes_the_rope_table_for_the_models_length(
        tmp_path: Path) -> None:
    """``max_model_len="auto"``: the RoPE table is built (before the KV cache is sized) for
    the model's 256 positions, the bound of the length auto then takes: with a full and a
    chunked table over 40 blocks of 4 and steps of 16 tokens, 104 (26 full blocks and at
    most 14 chunked ones), which the scheduler's count allows; greedy tokens are HF's."""
    hf = save_tiny_llama4(tmp_path, **CHUNKED)
    prompt = [(7 * i) % 120 + 3 for i in range(40)]
    with LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, max_model_len="auto",
             max_num_batched_tokens=16, num_gpu_blocks_override=40) as llm:
        runner, engine = llm.engine.runner, llm.engine
        assert runner.model.model.layers[0].self_attn.rotary_emb.max_position == 256
        assert engine.max_model_len == 104
        engine.scheduler.check_capacity(104, "num_gpu_blocks_override")  # (passes)
        out = llm.generate([{"prompt_token_ids": prompt}],
                           SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == _hf_tokens(hf, prompt, 8)


def test_chunked_tables_with_drafts(tmp_path: Path) -> None:
    """n-gram drafts over the chunked layers' table (chunks of 8, blocks of 2, a small pool):
    the freeing keeps ``num_speculative_tokens`` positions more (a step's result may take
    rejected drafts back across a chunk boundary; ``test_kv_tables.py`` checks the freeing
    points). Greedy tokens stay HF's; drafts were both kept and rejected; blocks were
    freed and none leaked."""
    hf = save_tiny_llama4(tmp_path, attention_chunk_size=8, max_position_embeddings=128)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9, 9, 9], [3 + i for i in range(9)]]
    want = [_hf_tokens(hf, p, 20) for p in prompts]
    with LLM(str(tmp_path), device="cpu", dtype="float32", block_size=2, max_model_len=128,
             max_num_batched_tokens=8, num_gpu_blocks_override=40, speculative_config={
                 "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                 "prompt_lookup_max": 2}) as llm:
        assert llm.engine.runner.kv_table_windows == (None, AttentionChunk(8))
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        proposed = sum(n * steps for n, steps in enumerate(llm.engine._drafted_hist))
        kept = sum(n * steps for n, steps in enumerate(llm.engine._accepted_hist))
        assert 0 < kept < proposed, (kept, proposed)
        assert llm.engine.scheduler.tables.num_freed > 0
        assert llm.engine.block_manager.num_free_blocks == 40


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "tp2-ep"])
def test_tensor_parallel_matches_hf(tmp_path: Path, expert_parallel: bool) -> None:
    """TP=2 (two CPU processes: heads, the experts' columns, the shared expert and the dense
    MLPs split; the router whole on both) gives HF's greedy tokens; so does expert
    parallelism (each rank two whole experts, the other's picks weighted 0)."""
    hf = save_tiny_llama4(tmp_path)
    want = [_hf_tokens(hf, p) for p in PROMPTS]
    got = tokens_at_tp(tmp_path, PROMPTS, GREEDY, tp_sizes=(2,), max_num_batched_tokens=8,
                       enable_expert_parallel=expert_parallel)
    assert got[2] == want
