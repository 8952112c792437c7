"""MixtralForCausalLM against HF transformers: greedy tokens through the engine, from the
checkpoint as transformers 5 saves it and with the published names (``block_sparse_moe``,
experts' ``w1`` / ``w3`` / ``w2``), a sliding window shorter than the prompts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mrv2 import LLM, SamplingParams
from mrv2.testing import hf_greedy, make_tiny_checkpoint

PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 250, 11], [3 + i for i in range(13)], [64]]


def _published(src: Path, dst: Path) -> None:
    """``src`` with the names Mixtral checkpoints are published with."""
    shutil.copytree(src, dst)
    out: dict[str, torch.Tensor] = {}
    for name, t in load_file(src / "model.safetensors").items():
        name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith(".experts.gate_up_proj"):  # stacked [E, 2I, H]
            prefix, inter = name.rsplit(".", 1)[0], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.w1.weight"] = t[e, :inter].contiguous()
                out[f"{prefix}.{e}.w3.weight"] = t[e, inter:].contiguous()
        elif name.endswith(".experts.down_proj"):
            prefix = name.rsplit(".", 1)[0]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.w2.weight"] = t[e].contiguous()
        else:
            for hf, pub in ((".gate_proj.", ".w1."), (".up_proj.", ".w3."),
                            (".down_proj.", ".w2.")):
                if ".experts." in name:
                    name = name.replace(hf, pub)
            out[name] = t
    save_file(out, dst / "model.safetensors")


@pytest.mark.parametrize("published", [False, True])
def test_greedy_tokens_match_hf(tmp_path: Path, published: bool) -> None:
    path = make_tiny_checkpoint(tmp_path / "m", "MixtralForCausalLM", num_local_experts=4,
                                num_experts_per_tok=2, sliding_window=6)
    file = path / "model.safetensors"  # experts loud enough that the tokens depend on them
    save_file({n: t * 12 if ".experts." in n else t for n, t in load_file(file).items()}, file)
    expected = [hf_greedy(path, p, 8) for p in PROMPTS]
    if published:
        _published(path, tmp_path / "pub")
        path = tmp_path / "pub"
        names = load_file(path / "model.safetensors")
        assert any(".block_sparse_moe.experts.3.w2." in n for n in names)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
