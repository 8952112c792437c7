"""Step-3.7's MTP layers (``mrv2_step.mtp``) on the CPU: a checkpoint laid out as the published
ones (a sliding dense MTP layer, then a full one with the experts) loads strictly into the main
model, which skips them, and into ``build_mtp()``; each layer's forward through its own paged
cache layer matches transformers' ``MtpLayer`` over HF's Step decoder block; greedy tokens with
``mtp`` speculation (one and two drafts a step, prompts split across steps) are those without;
configs it cannot run are refused naming the field."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.attention import set_forward_context
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.model_loader.build import process_weights_after_loading
from mrv2.plugins import get_plugin_manager
from mrv2.testing import poisoned_caches, run_step, step_metadata, torch_context
from mrv2_step.model import Step3p7ForConditionalGeneration
from mrv2_step.testing import hf_mtp_reference, make_mtp_layers_agree, save_tiny_step3p7_mtp

#: Sliding + dense (the published MTP layers' kind), then full + the experts.
MTP_LAYERS = [("sliding_attention", "dense"), ("full_attention", "sparse")]
#: The third is longer than the sliding window (8) and than a chunk of 8 tokens.
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [2 + (7 * i) % 120 for i in range(23)]]


@pytest.fixture(autouse=True)
def _registered() -> None:
    """The plugin's registration where it is not installed (its entry point then loads it)."""
    manager = get_plugin_manager()
    if not manager.pm.has_plugin("step"):
        import mrv2_step.plugin

        manager.register(mrv2_step.plugin, name="step")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("step_mtp")
    return path, save_tiny_step3p7_mtp(path, MTP_LAYERS)


def test_mtp_layers_match_hf(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    path, big = checkpoint
    config = transformers.AutoConfig.from_pretrained(path)
    model = Step3p7ForConditionalGeneration(config).eval()
    loaded = load_model_weights(model, iter_safetensors(path))
    assert not any(".layers.4." in name or ".layers.5." in name for name in loaded)
    mtp = model.build_mtp()
    names = load_model_weights(mtp, iter_safetensors(path))
    assert names == {name for name, _ in mtp.named_parameters()}
    process_weights_after_loading(model)
    process_weights_after_loading(mtp)
    text = model.config
    main = int(text.num_hidden_layers)
    specs = mtp.kv_cache_specs()
    assert sorted(specs) == [main, main + 1]
    assert getattr(specs[main], "sliding_window", None) == 8  # the sliding MTP layer's window
    assert getattr(specs[main + 1], "sliding_window", None) is None

    prompt = PROMPTS[2][:13]  # past the window
    tables = [[5, 0, 3, 9]]
    caches = poisoned_caches(int(text.num_key_value_heads), int(text.head_dim), main + 2)
    _, hidden = run_step(model, caches, tables, [0], [prompt])
    following = torch.tensor(prompt[1:] + [31])
    metadata = step_metadata([0], [len(prompt)], tables)
    for index in range(len(MTP_LAYERS)):
        with torch.inference_mode(), set_forward_context(torch_context(caches, metadata)):
            out = mtp(following.to(torch.int32), torch.arange(len(prompt)), hidden, step=index)
            logits = mtp.compute_logits(out, step=index)
        expected = hf_mtp_reference(path, big, index, following, hidden)
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def agreeing(checkpoint: tuple[Path, torch.nn.Module],
             tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint with MTP layers that draft what the model samples about half the time
    (:func:`make_mtp_layers_agree`): drafts accepted and rejected."""
    path = tmp_path_factory.mktemp("step_mtp_agreeing")
    shutil.copytree(checkpoint[0], path, dirs_exist_ok=True)
    make_mtp_layers_agree(path, scale=300.0)
    return path


@pytest.fixture(scope="module")
def plain_tokens(agreeing: Path) -> list[list[int]]:
    return _generate(agreeing, None)[0]


def _generate(path: Path, spec: dict[str, Any] | None, **kwargs: Any
              ) -> tuple[list[list[int]], LLM]:
    if spec is not None:
        kwargs["speculative_config"] = spec
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_seqs=4, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize(("k", "chunk"), [(1, None), (2, None), (2, 8)],
                         ids=["k1", "k2", "k2-chunked"])
def test_mtp_greedy_equals_plain(agreeing: Path, plain_tokens: list[list[int]], k: int,
                                 chunk: int | None) -> None:
    kwargs: dict[str, Any] = {} if chunk is None else {"max_num_batched_tokens": chunk}
    got, llm = _generate(agreeing, {"method": "mtp", "num_speculative_tokens": k}, **kwargs)
    assert got == plain_tokens
    stats = llm.engine.stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    if k == 2:  # the second draft (MTP layer 1, fed layer 0's output) accepted too
        assert stats["spec_num_accepted_per_pos"][1] > 0


@pytest.mark.parametrize(("field", "value", "match"), [
    ("num_nextn_predict_layers", 0, r"text_config\.num_nextn_predict_layers = 0: .*no MTP"),
    ("mtp_layer_types", ["sliding_attention"],
     r"text_config\.mtp_layer_types = \['sliding_attention'\]: must list, for each of the 2"),
    ("mtp_layer_types", ["chunked_attention", "full_attention"], r"mtp_layer_types"),
    ("mtp_mlp_layer_types", None, r"text_config\.mtp_mlp_layer_types = None: must list"),
])
def test_bad_mtp_config_refused(checkpoint: tuple[Path, torch.nn.Module], field: str,
                                value: Any, match: str) -> None:
    config = transformers.AutoConfig.from_pretrained(checkpoint[0])
    model = Step3p7ForConditionalGeneration(config)
    setattr(model.config, field, value)
    with pytest.raises(ValueError, match=match):
        model.build_mtp()
