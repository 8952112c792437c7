"""Serving LoRA adapters, against HF running each adapter merged into the base weights
(``W + scaling * B @ A``, read straight from the PEFT files by :func:`merge_lora_checkpoint`).

One batch mixes the base model and two adapters (of different ranks and targets), eager and
through the emulated CUDA-graph path; the prefix cache keeps each adapter's KV apart; with
``max_loras=1`` adapters take turns while base requests pass them; bad adapters are refused by
name before any work and the engine goes on serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from mrv2 import LLM, LoRARequest, SamplingParams
from mrv2.testing import TINY_FAMILIES, emulate_cuda_graphs, hf_greedy, make_tiny_checkpoint
from mrv2.testing_checkpoints import make_lora_adapter, merge_lora_checkpoint

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200], [1 + i % 200 for i in range(23)], [64, 9]]
NEW = 6


class Case:
    """A tiny Qwen3, two adapters and HF's greedy tokens for base and each merged model."""

    def __init__(self, root: Path) -> None:
        self.base = make_tiny_checkpoint(root / "base", "Qwen3ForCausalLM", seed=1, head_dim=16)
        self.paths = {
            "all": make_lora_adapter(self.base, root / "all", rank=8, seed=1),
            "some": make_lora_adapter(self.base, root / "some", rank=4, alpha=8, seed=2,
                                      targets=("q_proj", "v_proj", "down_proj"),
                                      use_rslora=True),
        }
        self.loras = {name: LoRARequest(name, i + 1, str(path))
                      for i, (name, path) in enumerate(self.paths.items())}
        merged = {name: merge_lora_checkpoint(self.base, path, root / f"merged-{name}")
                  for name, path in self.paths.items()}
        self.want: dict[str | None, list[list[int]]] = {
            None: [hf_greedy(self.base, p, NEW) for p in PROMPTS]}
        for name, path in merged.items():
            self.want[name] = [hf_greedy(path, p, NEW) for p in PROMPTS]
        for name in self.paths:  # the adapters matter: each changes every answer
            assert all(a != b for a, b in zip(self.want[name], self.want[None], strict=True))

    def llm(self, **kwargs: Any) -> LLM:
        return LLM(str(self.base), device="cpu", dtype="float32", block_size=4,
                   max_num_seqs=8, max_model_len=64, enable_lora=True,
                   **{"max_loras": 2, **kwargs})


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case(tmp_path_factory.mktemp("lora"))


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def _mixed(case: Case, llm: LLM) -> None:
    """Every prompt under the base model and each adapter, all in one batch."""
    names: list[str | None] = [None, "all", "some"]
    prompts = [{"prompt_token_ids": p} for _ in names for p in PROMPTS]
    loras = [case.loras[n] if n else None for n in names for _ in PROMPTS]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [t for n in names for t in case.want[n]]


@pytest.mark.parametrize("graphs", [False, True])
def test_mixed_batch_matches_merged_references(case: Case, graphs: bool) -> None:
    llm = case.llm()
    if graphs:  # padded decode batches and mixed steps over the persistent buffers
        emulate_cuda_graphs(llm.engine.runner)
    _mixed(case, llm)


def test_graphs_without_adapters_replay_while_none_is_live(case: Case) -> None:
    """Serving adapters captures the graphs twice: steps replay the set without the adapters'
    kernels while no live request names one, the other set once one does (here the base
    model's requests alone, then joined by adapter requests, then alone again), every token
    as the references'."""
    llm = case.llm()
    runner = llm.engine.runner
    emulate_cuda_graphs(runner)
    plain, with_lora = runner._lora_graphs

    def replays(graphs: Any) -> int:
        return sum(g.replays for g in graphs.graphs.values())

    layouts = []
    layout = runner.builder._layout
    runner.builder._layout = lambda *a: layouts.append(1) or layout(*a)
    base = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = llm.generate(base, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == case.want[None]
    assert replays(plain) > 0 and replays(with_lora) == 0
    # a run of decode steps keeps its layout (picking the set each step does not drop it)
    assert len(layouts) <= 3
    before = replays(plain)
    _mixed(case, llm)
    assert replays(with_lora) > 0 and replays(plain) == before
    outs = llm.generate(base, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == case.want[None]
    assert replays(plain) > before


def test_the_triton_kernels_in_the_engine(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers through the Triton shrink/expand (Triton's interpreter here, the GPU's
    path) in a mixed batch: the merged references' tokens (their first three)."""
    import mrv2.lora.layers
    from mrv2_kernels.lora import lora_apply_triton

    calls = []

    def triton_apply(*args: Any) -> Any:
        calls.append(1)
        return lora_apply_triton(*args)

    monkeypatch.setattr(mrv2.lora.layers, "lora_apply", triton_apply)
    llm = case.llm()  # (eager: the graph path's captures would each run the interpreter)
    names: list[str | None] = [None, "all", "some"]
    picked = [0, 2]  # (two prompts, three tokens: each interpreted program costs ~25 ms)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for _ in names for i in picked],
                        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                        use_tqdm=False,
                        lora_request=[case.loras[n] if n else None for n in names
                                      for _ in picked])
    assert [o.outputs[0].token_ids for o in outs] == [case.want[n][i][:3] for n in names
                                                     for i in picked]
    assert calls


@pytest.mark.parametrize("kind", ["ngram", "preemption"])
def test_speculation_and_preemption_keep_each_adapter(case: Case, kind: str) -> None:
    """n-gram drafts verified by the adapted model (strict: the tokens without drafts); a KV
    cache too small for the batch, so requests are preempted and resumed on their adapter."""
    if kind == "ngram":
        llm = case.llm(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                           "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    else:
        llm = case.llm(num_gpu_blocks_override=24)
    _mixed(case, llm)
    if kind == "ngram":
        assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    else:
        assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_keeps_adapters_apart(case: Case) -> None:
    llm = case.llm(enable_prefix_caching=True)
    prompt = {"prompt_token_ids": PROMPTS[1]}
    runs = [None, "all", "all", "some", None]
    for i, name in enumerate(runs):
        out = llm.generate(prompt, GREEDY, use_tqdm=False,
                           lora_request=case.loras[name] if name else None)[0]
        assert out.outputs[0].token_ids == case.want[name][1]
        # a prompt's blocks are reused under the same adapter only
        first = name not in runs[:i]
        cached = out.num_cached_tokens or 0
        assert (cached == 0) == first, (name, cached)


def test_one_slot_adapters_take_turns(case: Case) -> None:
    """``max_loras=1``: the two adapters never share a step; base requests pass the waiting
    adapter; everything still matches."""
    llm = case.llm(max_loras=1)
    runner = llm.engine.runner
    seen: list[set[int]] = []
    execute = runner.execute

    def spy(scheduled: Any) -> Any:
        out = execute(scheduled)
        assert runner.lora is not None
        seen.append({i for i, users in zip(runner.lora.slot_ids, runner.lora._slot_users,
                                          strict=True) if users and i is not None})
        return out

    runner.execute = spy  # type: ignore[method-assign]
    _mixed(case, llm)
    assert all(len(live) <= 1 for live in seen)
    assert {1} in seen and {2} in seen


def test_bad_adapters_are_refused_by_name(case: Case, tmp_path: Path) -> None:
    llm = case.llm()
    prompt = {"prompt_token_ids": PROMPTS[0]}

    def refused(lora: LoRARequest, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)

    refused(LoRARequest("missing", 7, str(tmp_path / "nowhere")), "no adapter_config.json")
    big = make_lora_adapter(case.base, tmp_path / "big", rank=32)
    refused(LoRARequest("big", 8, str(big)), r"field 'r' is 32; allowed: an int in 1\.\.16")
    dora = make_lora_adapter(case.base, tmp_path / "dora", rank=4)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    refused(LoRARequest("dora", 9, str(dora)), "'use_dora'")
    head = make_lora_adapter(case.base, tmp_path / "head", rank=4, targets=("lm_head",))
    refused(LoRARequest("head", 10, str(head)), "'lm_head' is not an adaptable layer")
    # nothing was queued, and the engine serves the next requests
    assert not llm.engine.has_unfinished()
    out = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=case.loras["all"])[0]
    assert out.outputs[0].token_ids == case.want["all"][0]


def test_adapters_need_enable_lora(case: Case) -> None:
    llm = LLM(str(case.base), device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64)
    assert llm.engine.runner.lora is None
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                     lora_request=case.loras["all"])


def test_tensor_parallel_splits_the_adapters(case: Case) -> None:
    """TP=2 on the CPU (gloo): each rank keeps its part of every adapter (column-parallel
    layers their rows of ``B``, row-parallel ones their columns of ``A``, the partial updates
    summed with the outputs) and the batch gives the merged references' tokens."""
    with case.llm(tensor_parallel_size=2) as llm:
        _mixed(case, llm)


def test_moe_model_takes_attention_adapters(tmp_path: Path) -> None:
    """Qwen3-MoE: an adapter on the attention projections matches HF's merged model; one on
    a routed expert is refused by name (experts take no adapters)."""
    base = make_tiny_checkpoint(tmp_path / "base", "Qwen3MoeForCausalLM", seed=3, head_dim=16,
                                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    adapter = make_lora_adapter(base, tmp_path / "attn", rank=8, seed=5,
                                targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    want = hf_greedy(merge_lora_checkpoint(base, adapter, tmp_path / "merged"), PROMPTS[0], NEW)
    assert want != hf_greedy(base, PROMPTS[0], NEW)
    llm = LLM(str(base), device="cpu", dtype="float32", max_model_len=64, enable_lora=True)
    lora = LoRARequest("attn", 1, str(adapter))
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                       lora_request=lora)[0]
    assert out.outputs[0].token_ids == want
    expert = tmp_path / "expert"
    expert.mkdir()
    (expert / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    name = "base_model.model.model.layers.0.mlp.experts.1.up_proj"
    save_file({f"{name}.lora_A.weight": torch.randn(8, 64),
               f"{name}.lora_B.weight": torch.randn(32, 8)},
              str(expert / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.1\.up_proj' is not"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("expert", 2, str(expert)))


def test_stats_name_the_running_and_waiting_adapters(case: Case) -> None:
    """``max_loras=1``: the first adapter's request runs, the other's waits; the stats (and
    ``/metrics``' ``mrv2_lora_requests_info``) say which."""
    llm = case.llm(max_loras=1)
    engine = llm.engine
    for name in ("all", "some"):
        engine.add_request(PROMPTS[0], GREEDY, lora_request=case.loras[name])
    engine.step()
    stats = engine.stats()
    assert (stats["max_lora"], stats["lora_running"], stats["lora_waiting"]) == (
        1, ["all"], ["some"])
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["lora_running"] == engine.stats()["lora_waiting"] == []


def test_a_new_adapter_never_evicts_one_the_same_step_needs(case: Case) -> None:
    """Two slots holding adapters 2 and 1, both idle; a step asking for adapters 3 and 2
    loads 3 over adapter 1, and 2 stays where it is (not evicted, then read again)."""
    from mrv2.contract.requests import NewRequest
    from mrv2.contract.staged_edits import StagedEdits

    runner = case.llm().engine.runner
    lora = runner.lora
    assert lora is not None
    third = LoRARequest("third", 3, str(case.paths["all"]))

    def new(req_id: str, adapter: LoRARequest) -> NewRequest:
        return NewRequest(req_id, [5, 6], GREEDY, 0, [], lora_request=adapter)

    lora.add_requests([new("a", case.loras["some"]), new("b", case.loras["all"])], [0, 1],
                      StagedEdits())
    assert lora.slot_ids == [2, 1]
    lora.remove_request(0)
    lora.remove_request(1)
    requests = [new("c", third), new("d", case.loras["some"])]
    lora.check_requests(requests)
    lora.add_requests(requests, [2, 3], StagedEdits())
    assert lora.slot_ids == [2, 3]


def test_deepseek_mla_takes_q_and_o_adapters(tmp_path: Path) -> None:
    """DeepSeek-V2's MLA reorders its q projection's RoPE rows after loading: an adapter's
    ``B`` rows are reordered alike (``LinearBase.row_order``), so q_proj / o_proj adapters
    give HF's merged tokens; its latent projections take none (refused by name)."""
    architecture, mla = TINY_FAMILIES["deepseek-v2-lite"]
    base = make_tiny_checkpoint(tmp_path / "base", architecture, seed=1, **mla)
    llm = LLM(str(base), device="cpu", dtype="float32", block_size=4, max_model_len=64,
              enable_lora=True)
    for i, targets in enumerate((("q_proj",), ("o_proj",))):
        adapter = make_lora_adapter(base, tmp_path / targets[0], rank=4, seed=3, std=1.5,
                                    targets=targets)
        want = hf_greedy(merge_lora_checkpoint(base, adapter, tmp_path / f"m{i}"), PROMPTS[0],
                         NEW)
        assert want != hf_greedy(base, PROMPTS[0], NEW)
        out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                           lora_request=LoRARequest(targets[0], i + 1, str(adapter)))[0]
        assert out.outputs[0].token_ids == want, targets
    latent = make_lora_adapter(base, tmp_path / "latent", rank=4, targets=("kv_b_proj",))
    with pytest.raises(ValueError, match="kv_b_proj' is not an adaptable layer"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("latent", 9, str(latent)))


@pytest.mark.parametrize(("edit", "match"), [
    ({"r": True}, r"field 'r' is True; allowed: an int"),
    ({"lora_alpha": float("nan")}, r"field 'lora_alpha' is nan; allowed: a finite number"),
    ({"use_rslora": "false"}, r"field 'use_rslora' is 'false'; allowed: true or false"),
    ({"r": 8}, r"lora_A \(4, 64\).*adapter_config.json's r = 8"),
    (None, "holds a JSON list; allowed: an object"),
])
def test_malformed_adapter_configs_are_refused_by_field(tmp_path: Path,
                                                        edit: dict[str, Any] | None,
                                                        match: str) -> None:
    """Fields PEFT would not load (or that would scale the update wrongly) are refused by
    name, as is a config that is no JSON object; nothing reads a bool ``r`` as rank 1, a
    string ``use_rslora`` as true or a config ``r`` other than the tensors' rank."""
    from mrv2.lora.adapter import read_adapter, save_adapter

    path = save_adapter(tmp_path / "a", {"model.layers.0.self_attn.q_proj": (
        torch.randn(4, 64), torch.randn(64, 4))}, alpha=8)
    config = json.loads((path / "adapter_config.json").read_text())
    text = json.dumps([config]) if edit is None else json.dumps({**config, **edit})
    (path / "adapter_config.json").write_text(text)
    with pytest.raises(ValueError, match=match):
        read_adapter(path, 16)


def test_a_config_without_lora_alpha_scales_as_peft_loads_it(tmp_path: Path) -> None:
    """PEFT's ``LoraConfig`` default ``lora_alpha`` is 8 (not ``r``): a rank-4 adapter whose
    config omits it scales its update by 8 / 4."""
    from mrv2.lora.adapter import read_adapter_config, save_adapter

    path = save_adapter(tmp_path / "a", {"model.layers.0.self_attn.q_proj": (
        torch.randn(4, 64), torch.randn(64, 4))}, alpha=8)
    config = json.loads((path / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (path / "adapter_config.json").write_text(json.dumps(config))
    assert read_adapter_config(path, 16).scaling == 2.0


def test_adapters_of_modules_the_checkpoint_fuses(tmp_path: Path) -> None:
    """Phi-3's checkpoint (and so its PEFT adapters) holds ``qkv_proj`` and ``gate_up_proj``
    whole: one ``A`` shared by the shards, one ``B`` over all their rows. HF's merged model's
    tokens; a fused ``B`` of the wrong size is refused by name."""
    base = make_tiny_checkpoint(tmp_path / "base", "Phi3ForCausalLM", std=0.15, seed=1,
                                pad_token_id=0)
    adapter = make_lora_adapter(base, tmp_path / "fused", rank=4, seed=2,
                                targets=("qkv_proj", "gate_up_proj"))
    want = hf_greedy(merge_lora_checkpoint(base, adapter, tmp_path / "merged"), PROMPTS[0], NEW)
    assert want != hf_greedy(base, PROMPTS[0], NEW)
    llm = LLM(str(base), device="cpu", dtype="float32", block_size=4, max_model_len=64,
              enable_lora=True)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                       lora_request=LoRARequest("fused", 1, str(adapter)))[0]
    assert out.outputs[0].token_ids == want
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    name = "base_model.model.model.layers.0.self_attn.qkv_proj"
    save_file({f"{name}.lora_A.weight": torch.randn(4, 64),
               f"{name}.lora_B.weight": torch.randn(7, 4)}, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.qkv_proj' has lora_B "
                                         r"\(7, 4\); the model's fused layer has"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("bad", 2, str(bad)))


def test_an_adapter_gone_from_disk_fails_a_step_not_the_engine(case: Case,
                                                               tmp_path: Path) -> None:
    """``max_loras=1`` keeps one adapter read in host memory, so a waiting request's adapter
    is read again as it starts; its directory removed meanwhile fails that step (naming
    it), before the step's new requests get rows. Aborting them then frees what they held,
    and the engine serves every adapter on."""
    gone = shutil.copytree(case.paths["all"], tmp_path / "gone")
    llm = case.llm(max_loras=1)
    engine = llm.engine
    ids = [engine.add_request(PROMPTS[0], GREEDY, lora_request=LoRARequest("gone", 7, str(gone))),
           engine.add_request(PROMPTS[0], GREEDY, lora_request=case.loras["some"])]
    shutil.rmtree(gone)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        while engine.has_unfinished():
            engine.step()
    for req_id in ids:
        engine.abort(req_id)
    assert not engine.has_unfinished()
    _mixed(case, llm)


@pytest.mark.parametrize(("args", "match"), [
    (("a", True, "/p"), "lora_int_id must be an int >= 1, got True"),
    ((5, 1, "/p"), "lora_name must be a non-empty string, got 5"),
    (("a", 1, 7), "lora_path must name the adapter's directory, got 7"),
])
def test_lora_requests_are_checked_by_field(args: tuple[Any, ...], match: str) -> None:
    """A bool id (``True`` would share adapter 1's slot and prefix-cache blocks), a name or
    path of the wrong type: refused by field when the request is made."""
    with pytest.raises(ValueError, match=match):
        LoRARequest(*args)
    assert LoRARequest("a", 1, Path("/p")).lora_path == Path("/p")


def test_beam_search_through_adapters(case: Case, tmp_path: Path) -> None:
    """``LLM.beam_search(..., lora_request=...)`` (vLLM's): each prompt's beams through its
    adapter, as the same search on the merged model; the base model's prompt beside them."""
    from mrv2.engine.beam_search import BeamSearchParams

    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    llm = case.llm()

    def tokens(outputs: Any) -> list[list[list[int]]]:
        return [[s.tokens for s in o.sequences] for o in outputs]

    merged = LLM(str(merge_lora_checkpoint(case.base, case.paths["all"], tmp_path / "m")),
                 device="cpu", dtype="float32", block_size=4, max_model_len=64)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    want = tokens(merged.beam_search(prompts[:1], params))
    base = tokens(llm.beam_search(prompts[1:], params))
    got = tokens(llm.beam_search(prompts, params, lora_request=[case.loras["all"], None]))
    assert got == want + base and want != tokens(llm.beam_search(prompts[:1], params))
