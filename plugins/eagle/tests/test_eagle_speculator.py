"""EAGLE and EAGLE-3 speculation through ``LLM`` on CPU, on tiny Qwen3 and Llama targets with
random-weight heads (so acceptance is whatever it is: nothing is asserted about it): greedy and
seeded outputs equal the plain path's, with prefix caching, preemption and the CUDA-graph path
(emulated on the CPU); drafts are really made; bad heads are refused with the field named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

import mrv2.testing
from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_checkpoint
from mrv2_eagle.testing import write_eagle3_head, write_eagle_head

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250], [1 + i % 200 for i in range(37)], [64],
           [7, 8, 9, 7, 8, 9, 7, 8, 9, 7, 8]]
NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
_PLAIN: dict[tuple[str, str], list[list[int]]] = {}


def _run(target: Path, spec: dict[str, Any] | None, params: Any = GREEDY,
         prompts: list[list[int]] = PROMPTS, graphs: bool = False, **kwargs: Any
         ) -> tuple[list[list[int]], LLM]:
    if spec is not None:
        kwargs["speculative_config"] = spec
    llm = LLM(str(target), device="cpu", dtype="float32", block_size=4, **kwargs)
    if graphs:
        getattr(mrv2.testing, "emulate_cuda_graphs")(llm.engine.runner)  # noqa: B009
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def _plain(target: Path, name: str) -> list[list[int]]:
    if (name, "greedy") not in _PLAIN:
        _PLAIN[(name, "greedy")] = _run(target, None)[0]
    return _PLAIN[(name, "greedy")]


def _spec(head: Path, method: str, k: int = 3, **extra: Any) -> dict[str, Any]:
    return {"method": method, "model": str(head), "num_speculative_tokens": k, **extra}


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("target", ["qwen3", "llama"])
def test_greedy_equals_plain(target: str, method: str, target_dirs: dict[str, Path],
                             head_dirs: dict[tuple[str, str], Path]) -> None:
    got, llm = _run(target_dirs[target], _spec(head_dirs[(target, method)], method))
    assert got == _plain(target_dirs[target], target)
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    assert llm.engine.block_manager.usage == 0.0


def test_heads_draft_for_a_target_with_recurrent_state(tmp_path: Path) -> None:
    """EAGLE and EAGLE-3 heads over Qwen3-Next (Gated DeltaNet layers: the target keeps
    per-request state, ``1 + k`` rows a request under speculation; EAGLE-3's aux layers read
    from linear-attention and full-attention layers alike): greedy tokens equal HF's."""
    from mrv2.testing import hf_greedy
    from mrv2_qwen.testing import save_tiny_qwen3_next

    target = tmp_path / "target"
    save_tiny_qwen3_next(target)
    prompts = [[5, 9, 13, 17, 21] * 3, [40, 3, 40, 3, 7]]
    want = [hf_greedy(target, p, NEW) for p in prompts]
    for method, head in (("eagle", write_eagle_head(tmp_path / "e", target, seed=5)),
                         ("eagle3", write_eagle3_head(tmp_path / "e3", target, seed=6,
                                                      aux_ids=[0, 1, 3]))):
        got, llm = _run(target, _spec(head, method), prompts=prompts)
        assert got == want, method
        assert llm.engine.stats()["spec_num_draft_tokens"] > 0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_prefix_caching_and_preemption(method: str, target_dirs: dict[str, Path],
                                       head_dirs: dict[tuple[str, str], Path]) -> None:
    """Prompts sharing a prefix, in two rounds (the second hits the first's blocks), through a
    cache small enough to preempt; chunked prefill on too."""
    target, shared = target_dirs["qwen3"], [3 + (5 * i) % 190 for i in range(16)]
    prompts = [shared + p for p in PROMPTS[:4]]

    def rounds(spec: dict[str, Any] | None) -> tuple[list[list[int]], LLM]:
        first, llm = _run(target, spec, prompts=prompts[:1], num_gpu_blocks_override=24,
                          max_num_batched_tokens=16)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                            use_tqdm=False)
        return first + [o.outputs[0].token_ids for o in outs], llm

    expected = rounds(None)[0]
    got, llm = rounds(_spec(head_dirs[("qwen3", method)], method))
    assert got == expected
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_preemptions"] > 0
    assert llm.engine.block_manager.usage == 0.0


def test_seeded_sampling_equals_plain(target_dirs: dict[str, Path],
                                      head_dirs: dict[tuple[str, str], Path]) -> None:
    """Drafts drawn with the target's noise (EAGLE-3: over the draft vocabulary scattered to
    the target's ids) keep seeded outputs identical."""
    target = target_dirs["llama"]
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=NEW, ignore_eos=True)
              for s in range(len(PROMPTS))]
    expected, _ = _run(target, None, params)
    got, llm = _run(target, _spec(head_dirs[("llama", "eagle3")], "eagle3", k=2), params)
    assert got == expected
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_graph_path_equals_plain(method: str, target_dirs: dict[str, Path],
                                 head_dirs: dict[tuple[str, str], Path]) -> None:
    """Decode steps padded to the captured sizes, drafting replayed from its "graph" (the
    CPU stand-in): padding requests draft and write nothing, outputs equal the plain path's."""
    if not hasattr(mrv2.testing, "emulate_cuda_graphs"):
        pytest.skip("mrv2.testing.emulate_cuda_graphs is not available")
    target = target_dirs["qwen3"]
    kwargs: dict[str, Any] = {"max_num_seqs": 8, "max_model_len": 64}
    got, llm = _run(target, _spec(head_dirs[("qwen3", method)], method, k=2), graphs=True,
                    **kwargs)
    assert got == _plain(target, "qwen3")
    graphs = llm.engine.runner.graphs
    assert graphs is not None and (3, 8) in graphs.draft_graphs
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0


def _refused(target: Path, spec: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(target), device="cpu", dtype="float32", speculative_config=spec)


def test_bad_heads_are_refused(target_dirs: dict[str, Path], tmp_path: Path) -> None:
    target = target_dirs["qwen3"]
    for method in ("eagle", "eagle3"):
        _refused(target, {"method": method, "num_speculative_tokens": 2},
                 "speculative_config.model")
    # the head's vocabulary is not the target's
    wrong_vocab = make_tiny_checkpoint(tmp_path / "v", "Qwen3ForCausalLM", vocab_size=128)
    _refused(target, _spec(write_eagle_head(tmp_path / "e-v", wrong_vocab), "eagle"),
             r"vocab_size \(128\) must equal the target's \(256\)")
    # EAGLE-3: t2d must cover the target's vocabulary
    head = write_eagle3_head(tmp_path / "e3-t2d", target)
    tensors = load_file(head / "model.safetensors")
    tensors["t2d"] = tensors["t2d"][:200]
    save_file(tensors, head / "model.safetensors")
    _refused(target, _spec(head, "eagle3"), r"t2d has 200 entries.*vocab_size 256")
    # hidden sizes
    wide = make_tiny_checkpoint(tmp_path / "w", "Qwen3ForCausalLM", hidden_size=96)
    _refused(target, _spec(write_eagle_head(tmp_path / "e-w", wide), "eagle"),
             r"hidden_size \(96\) must equal the target's \(64\)")
    _refused(target, _spec(write_eagle3_head(tmp_path / "e3-w", wide), "eagle3"),
             r"hidden_size \(96\) must equal the target's hidden_size \(64\)")
    # aux layers outside the target's 0..2
    bad_ids = write_eagle3_head(tmp_path / "e3-ids", target, aux_ids=[0, 1, 3])
    _refused(target, _spec(bad_ids, "eagle3"),
             r"eagle_aux_hidden_state_layer_ids .* \[0, 1, 3\].* in 0\.\.2")
    # the default ids (2, L // 2, L - 3) do not fit a 2-layer target
    short = make_tiny_checkpoint(tmp_path / "s", "Qwen3ForCausalLM")
    _refused(short, _spec(write_eagle3_head(tmp_path / "e3-s", short), "eagle3"),
             r"default aux layer ids .* \[2, 1, -1\]")
    # a reduced draft vocabulary without d2t
    no_map = write_eagle3_head(tmp_path / "e3-map", target)
    tensors = load_file(no_map / "model.safetensors")
    del tensors["d2t"], tensors["t2d"]
    save_file(tensors, no_map / "model.safetensors")
    _refused(target, _spec(no_map, "eagle3"), r"draft_vocab_size \(96\) .* no d2t")


def test_eagle3_needs_a_target_that_keeps_layers(target_dirs: dict[str, Path],
                                                 head_dirs: dict[tuple[str, str], Path],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from mrv2.layers import CausalLM

    monkeypatch.delattr(CausalLM, "keep_aux_hidden_states")
    _refused(target_dirs["qwen3"], _spec(head_dirs[("qwen3", "eagle3")], "eagle3"),
             r"cannot hand over its intermediate hidden states")


def test_dummy_weights_need_only_a_config(target_dirs: dict[str, Path], tmp_path: Path,
                                          head_dirs: dict[tuple[str, str], Path]) -> None:
    """``load_format="dummy"`` (benchmarks) draws the head's weights: a config.json is all the
    head directory needs."""
    for method in ("eagle", "eagle3"):
        head = tmp_path / method
        head.mkdir()
        shutil.copy(head_dirs[("llama", method)] / "config.json", head / "config.json")
        config = json.loads((head / "config.json").read_text())
        assert config["num_hidden_layers"] == 1
        llm = LLM(str(target_dirs["llama"]), device="cpu", dtype="float32", block_size=4,
                  load_format="dummy", speculative_config=_spec(head, method, k=2))
        outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
        assert len(outs[0].outputs[0].token_ids) == NEW
        assert llm.engine.stats()["spec_num_draft_tokens"] > 0


def test_heads_draft_for_a_vision_language_target(tmp_path: Path) -> None:
    """A vision-language target (Qwen2.5-VL: vocabulary and widths in its ``text_config``)
    takes an EAGLE-3 head, checked against (and built from) its text decoder's config, as
    EAGLE's check is; greedy tokens equal the plain path's (weights drawn,
    ``load_format="dummy"``)."""
    from mrv2_qwen_vl.testing import make_tiny_qwen_vl

    target = make_tiny_qwen_vl(tmp_path / "target")
    text = json.loads((target / "config.json").read_text())["text_config"]
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "rms_norm_eps", "max_position_embeddings")
    prompts = PROMPTS[:2]
    want, _ = _run(target, None, prompts=prompts, load_format="dummy")
    head = tmp_path / "eagle3"
    head.mkdir()
    config = {**{k: text[k] for k in keep}, "model_type": "llama", "num_hidden_layers": 1,
              "architectures": ["LlamaForCausalLMEagle3"],
              "eagle_aux_hidden_state_layer_ids": [0, 1], "draft_vocab_size": text["vocab_size"]}
    (head / "config.json").write_text(json.dumps(config))
    got, llm = _run(target, _spec(head, "eagle3", k=2), prompts=prompts, load_format="dummy")
    assert got == want
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0


def test_latency_bench_eagle3_variant(tmp_path: Path) -> None:
    """``mrv2 bench latency --variants eagle3_2``: a head config derived from the target's,
    its weights drawn; drafts are made."""
    from mrv2.bench.latency import bench
    from mrv2.entrypoints.cli import build_parser

    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", vocab_size=10_001,
                                max_position_embeddings=512, num_hidden_layers=3)
    args = build_parser().parse_args([
        "bench", "latency", "--model", str(ckpt), "--dtype", "float32", "--batch-sizes", "2",
        "--prompt-len", "8", "--new-tokens", "8", "--max-model-len", "64",
        "--variants", "eagle3_2",
    ])
    spec = bench(args)["eagle3_2"][-1]
    assert spec["spec_num_draft_tokens"] > 0
    assert len(spec["spec_acceptance_rate_per_pos"]) == 2


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_heads_draft_past_max_position_embeddings_of_a_rope_scaled_target(
        tmp_path: Path, method: str) -> None:
    """A YaRN target (original 64 * factor 4: ``max_model_len`` 256, past its
    ``max_position_embeddings`` 64, as vLLM allows) and a head of plain RoPE at 64
    positions: the head's table reaches the target's 256, a 100-token prompt drafts, greedy
    tokens equal the plain path's."""
    from mrv2.layers.rotary import RotaryEmbedding

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
            "rope_theta": 1e4}
    target = make_tiny_checkpoint(tmp_path / "t", "Qwen3ForCausalLM", std=0.15,
                                  max_position_embeddings=64, rope_parameters=yarn,
                                  num_hidden_layers=3)
    write = write_eagle_head if method == "eagle" else write_eagle3_head
    head = write(tmp_path / "head", target,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    prompts = [[(7 * i + 3) % 250 + 2 for i in range(100)]]
    want, _ = _run(target, None, prompts=prompts)
    got, llm = _run(target, _spec(head, method), prompts=prompts)
    assert got == want
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    speculator: Any = llm.engine.runner.speculator
    ropes = [m for m in speculator.head.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes and all(r.positions >= 256 and r.max_position == 64 for r in ropes)
