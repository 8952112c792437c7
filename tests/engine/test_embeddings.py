"""Embedding requests (``LLM.embed``, ``pooling_params``) against HF's final hidden state of
each prompt's last token (``AutoModel``'s ``last_hidden_state``), normalized: Qwen3 and Llama,
beside generation requests in the same steps (whose tokens do not change), through chunked
prefill, a prefix-cache hit and the emulated CUDA-graph path; ``dimensions`` and
``normalize``; a checkpoint saved without its ``model.`` prefix (Qwen3-Embedding's); a LoRA
adapter's embeddings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

from mrv2 import LLM, LoRARequest, PoolingParams, SamplingParams
from mrv2.testing import emulate_cuda_graphs, hf_greedy, make_tiny_checkpoint
from mrv2.testing_checkpoints import make_lora_adapter, merge_lora_checkpoint, save_checkpoint_like

PROMPTS = [[5, 17, 99, 3, 42], [1 + i % 200 for i in range(23)], [64]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def hf_states(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """HF's final hidden state of each prompt's last token (raw, not normalized)."""
    model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts]


def _close(got: list[float], want: torch.Tensor) -> None:
    torch.testing.assert_close(torch.tensor(got), want, rtol=1e-4, atol=1e-5)


def _llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=64,
               **kwargs)


@pytest.mark.parametrize("architecture", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_embeddings_match_hf_beside_generation(architecture: str, tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, architecture, head_dim=16)
    want = [torch.nn.functional.normalize(s, dim=-1) for s in hf_states(path, PROMPTS)]
    llm = _llm(path)
    for got, w in zip(llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False),
                      want, strict=True):
        assert got.outputs.hidden_size == w.shape[0]
        _close(got.outputs.embedding, w)
    # embedding and generation requests in the same steps
    engine = llm.engine
    gen = [engine.add_request(p, GREEDY) for p in PROMPTS]
    emb = [engine.add_request(p, GREEDY, pooling_params=PoolingParams()) for p in PROMPTS]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for req_id, prompt in zip(gen, PROMPTS, strict=True):
        assert done[req_id].outputs[0].token_ids == hf_greedy(path, prompt, 6)
        assert done[req_id].embedding is None
    for req_id, w in zip(emb, want, strict=True):
        _close(done[req_id].embedding or [], w)
        assert done[req_id].outputs[0].token_ids == []  # (its sampled token is nobody's)
    # only the generation requests' tokens count as generated
    assert engine.num_generation_tokens == 6 * len(PROMPTS)


def test_chunks_cache_graphs_and_pooling_options(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", head_dim=16)
    raw = hf_states(path, PROMPTS)
    # chunked prefill (8 tokens a step), the prefix cache, the emulated graphs
    llm = _llm(path, max_num_batched_tokens=8, enable_prefix_caching=True,
               hf_overrides={"is_matryoshka": True})
    emulate_cuda_graphs(llm.engine.runner)
    for _ in range(2):  # the second time the prompts' blocks are cached
        outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
        for got, state in zip(outs, raw, strict=True):
            _close(got.outputs.embedding, torch.nn.functional.normalize(state, dim=-1))
    assert outs[1].num_cached_tokens > 0
    short = llm.embed({"prompt_token_ids": PROMPTS[1]}, PoolingParams(normalize=False,
                                                                      dimensions=10),
                      use_tqdm=False)[0]
    _close(short.outputs.embedding, raw[1][:10])
    with pytest.raises(ValueError, match="dimensions=65 is invalid"):
        llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(dimensions=65),
                  use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)


def test_dimensions_need_a_matryoshka_model(tmp_path: Path) -> None:
    """As vLLM: ``dimensions`` is refused by name for a model whose config.json says nothing
    of Matryoshka embeddings (cutting them short would give poor vectors), and must be one of
    ``matryoshka_dimensions`` when it lists them."""
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", head_dim=16)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with pytest.raises(ValueError, match="dimensions=8: this model does not support Matr"):
        _llm(path).embed(prompt, PoolingParams(dimensions=8), use_tqdm=False)
    llm = _llm(path, hf_overrides={"matryoshka_dimensions": [8, 32]})
    with pytest.raises(ValueError, match=r"matryoshka_dimensions are \[8, 32\]"):
        llm.embed(prompt, PoolingParams(dimensions=10), use_tqdm=False)
    with pytest.raises(ValueError, match="Matryoshka"):
        _llm(path).engine.add_request(PROMPTS[0], GREEDY,
                                      pooling_params=PoolingParams(dimensions=8))
    got = llm.embed(prompt, PoolingParams(dimensions=8), use_tqdm=False)[0]
    _close(got.outputs.embedding,
           torch.nn.functional.normalize(hf_states(path, PROMPTS[:1])[0][:8], dim=-1))


def _sentence_transformers(path: Path, mode: str, *extra: str) -> None:
    """Give ``path`` sentence-transformers' configuration: Transformer, Pooling by ``mode``,
    then the ``extra`` module types."""
    import json

    types = ["Transformer", "Pooling", *extra]
    modules = [{"idx": i, "name": str(i), "path": "" if i == 0 else f"{i}_{t}",
                "type": f"sentence_transformers.models.{t}"} for i, t in enumerate(types)]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    modes = ["cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens",
             "weightedmean_tokens", "lasttoken"]
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "include_prompt": True,
         **{f"pooling_mode_{m}": m == mode for m in modes}}))


@pytest.mark.parametrize(("mode", "extra", "named"), [
    ("mean_tokens", ["Normalize"], r"pooling_mode_mean_tokens \(1_Pooling/config.json\)"),
    ("cls_token", [], "pooling_mode_cls_token"),
    ("lasttoken", ["Dense", "Normalize"], "sentence_transformers.models.Dense module"),
])
def test_a_checkpoint_pooled_otherwise_is_refused(mode: str, extra: list[str], named: str,
                                                   tmp_path: Path) -> None:
    """A sentence-transformers checkpoint whose embeddings are not its last token's state
    (mean or CLS pooling, a Dense projection: modules.json) is refused embeddings by name,
    rather than given the last token's; its per-token states and generation still run."""
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", head_dim=16)
    _sentence_transformers(path, mode, *extra)
    llm = _llm(path)
    with pytest.raises(ValueError, match=named):
        llm.embed({"prompt_token_ids": PROMPTS[0]}, use_tqdm=False)
    with pytest.raises(ValueError, match="task='embed' is refused"):
        llm.engine.add_request(PROMPTS[0], GREEDY, pooling_params=PoolingParams())
    rows = llm.encode({"prompt_token_ids": PROMPTS[0]}, pooling_task="token_embed",
                      use_tqdm=False)[0].outputs.data
    assert rows.shape == (len(PROMPTS[0]), 64)
    assert llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0]


def test_a_last_token_sentence_transformers_checkpoint(tmp_path: Path) -> None:
    """Qwen3-Embedding's modules.json (last-token pooling, normalized) embeds as HF does."""
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", head_dim=16)
    _sentence_transformers(path, "lasttoken", "Normalize")
    got = _llm(path).embed({"prompt_token_ids": PROMPTS[0]}, use_tqdm=False)[0]
    _close(got.outputs.embedding,
           torch.nn.functional.normalize(hf_states(path, PROMPTS[:1])[0], dim=-1))


def test_normalized_as_the_sentence_transformers_modules_say(tmp_path: Path) -> None:
    """Without a Normalize module in modules.json a request that does not say gets the raw
    state (vLLM's default from the sentence-transformers configuration); ``normalize=True``
    still normalizes it, and ``LLM.score`` is still the cosine similarity."""
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", head_dim=16)
    _sentence_transformers(path, "lasttoken")
    raw = hf_states(path, PROMPTS[:1])[0]
    llm = _llm(path)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    _close(llm.embed(prompt, use_tqdm=False)[0].outputs.embedding, raw)
    _close(llm.embed(prompt, PoolingParams(normalize=True), use_tqdm=False)[0]
           .outputs.embedding, torch.nn.functional.normalize(raw, dim=-1))
    # vLLM's LLM.score of an embedding model: the cosine similarity, unit vectors or not
    score = llm.score(prompt, {"prompt_token_ids": PROMPTS[1]}, use_tqdm=False)[0]
    other = hf_states(path, PROMPTS[1:2])[0]
    assert abs(score.outputs.score
               - float(torch.nn.functional.cosine_similarity(raw, other, dim=0))) < 1e-5
    engine = llm.engine
    req = engine.add_request(PROMPTS[0], GREEDY, pooling_params=PoolingParams())
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    _close(done[req].embedding or [], raw)


def test_a_checkpoint_without_the_model_prefix(tmp_path: Path) -> None:
    """Qwen3-Embedding's checkpoints name the decoder's tensors ``layers.*``,
    ``embed_tokens.*``, ``norm.*`` and tie the LM head."""
    path = make_tiny_checkpoint(tmp_path / "base", "Qwen3ForCausalLM", head_dim=16,
                                tie_word_embeddings=True)
    tensors = {k.removeprefix("model."): v for k, v in
               load_file(str(path / "model.safetensors")).items() if k != "lm_head.weight"}
    flat = save_checkpoint_like(path, tmp_path / "flat", tensors)
    assert "layers.0.self_attn.q_proj.weight" in tensors
    got = _llm(flat).embed({"prompt_token_ids": PROMPTS[0]}, use_tqdm=False)[0]
    _close(got.outputs.embedding,
           torch.nn.functional.normalize(hf_states(path, PROMPTS[:1])[0], dim=-1))


def test_an_adapters_embeddings(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "base", "Qwen3ForCausalLM", head_dim=16)
    adapter = make_lora_adapter(path, tmp_path / "adapter", rank=4, seed=3)
    merged = merge_lora_checkpoint(path, adapter, tmp_path / "merged")
    want = torch.nn.functional.normalize(hf_states(merged, PROMPTS[:1])[0], dim=-1)
    llm = _llm(path, enable_lora=True)
    got = llm.embed({"prompt_token_ids": PROMPTS[0]}, use_tqdm=False,
                    lora_request=LoRARequest("a", 1, str(adapter)))[0]
    _close(got.outputs.embedding, want)


def test_the_pooling_runner(tmp_path: Path) -> None:
    """``runner="pooling"``: an untied checkpoint without its LM head loads (Qwen3-Embedding-8B
    ships none), embeds as HF does, refuses generation by name, and warms up with embedding
    requests only, leaving the engine as it found it; the generating runner refuses that
    checkpoint. The engine holds no LM head, with or without one in the checkpoint."""
    from mrv2.engine.warmup import warm_up

    path = make_tiny_checkpoint(tmp_path / "base", "Qwen3ForCausalLM", head_dim=16,
                                tie_word_embeddings=False)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["lm_head.weight"]
    headless = save_checkpoint_like(path, tmp_path / "headless", tensors)
    with pytest.raises(ValueError, match="lm_head.weight"):
        _llm(headless)
    llm = _llm(headless, runner="pooling")
    stats = llm.engine.stats()
    warm_up(llm.engine)
    assert llm.engine.stats() == stats
    got = llm.embed({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False)[0]
    _close(got.outputs.embedding,
           torch.nn.functional.normalize(hf_states(path, PROMPTS[1:2])[0], dim=-1))
    # a pooling engine holds no LM head (its sampled token is nobody's), and one in the
    # checkpoint is not read
    from mrv2.layers.embedding import PoolingLogits

    assert isinstance(llm.engine.runner.model.lm_head, PoolingLogits)
    assert not any("lm_head" in n for n, _ in llm.engine.runner.model.named_parameters())
    with_head = _llm(path, runner="pooling")
    assert isinstance(with_head.engine.runner.model.lm_head, PoolingLogits)
    runner = with_head.engine.runner
    emulate_cuda_graphs(runner)  # no step decodes: the mixed graphs alone
    assert runner.graphs is not None and runner.graphs.mixed_graphs
    assert not runner.graphs.graphs and not runner.graphs.tail_graphs
    _close(with_head.embed({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False)[0]
           .outputs.embedding, torch.tensor(got.outputs.embedding))
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)


def test_a_prompt_filling_the_context(tmp_path: Path) -> None:
    """As vLLM: a pooling prompt may hold ``max_model_len`` tokens (a generation prompt one
    fewer, its sampled token needs the last position): its embedding is HF's, through chunked
    prefill, a prefix-cache hit and the emulated CUDA graphs, beside a generation request; its
    one sampled token (dropped) writes past neither its 16 blocks of 4 nor its token row."""
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", head_dim=16)
    prompt = [1 + (7 * i) % 200 for i in range(64)]
    want = torch.nn.functional.normalize(hf_states(path, [prompt])[0], dim=-1)
    llm = _llm(path, max_num_batched_tokens=16, enable_prefix_caching=True)
    emulate_cuda_graphs(llm.engine.runner)
    for _ in range(2):  # the second time its blocks are cached
        got = llm.embed({"prompt_token_ids": prompt}, use_tqdm=False)[0]
        _close(got.outputs.embedding, want)
    assert got.num_cached_tokens > 0
    engine = llm.engine
    gen = engine.add_request(PROMPTS[1], GREEDY)
    emb = engine.add_request(prompt, GREEDY, pooling_params=PoolingParams(normalize=False))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[gen].outputs[0].token_ids == hf_greedy(path, PROMPTS[1], 6)
    _close(done[emb].embedding or [], hf_states(path, [prompt])[0])
    with pytest.raises(ValueError, match="at most 63 tokens"):
        llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="at most 64 tokens"):
        llm.embed({"prompt_token_ids": prompt + [5]}, use_tqdm=False)
