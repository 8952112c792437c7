"""The GLM plugin as a distribution: its entry point and ``mrv2 plugins`` listing, running GLM
checkpoints (GLM-4.7-Flash's multi-head latent attention included: the core's) with only this
plugin allowed, and no import of another family's plugin (but the vision-language GLM-4.1V /
4.5V modules' of Qwen-VL's M-RoPE, model state and tower pieces, a declared dependency)."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import mrv2_glm
from mrv2.testing import hf_greedy, make_tiny_checkpoint

PLUGIN_DIR = Path(__file__).resolve().parents[1]
PACKAGE_DIR = PLUGIN_DIR / "mrv2_glm"
OTHER_FAMILIES = ("mrv2_qwen", "mrv2_qwen_vl", "mrv2_llama", "mrv2_deepseek")
#: The GLM-V modules, which build on ``mrv2_qwen_vl`` (``mrv2-plugin-qwen-vl``, a dependency).
VISION_MODULES = ("glm4v.py", "glm4v_inputs.py", "vision_glm4v.py", "testing_glm4v.py")
DEPENDENCIES = ["mrv2>=0.1", "mrv2-plugin-qwen-vl>=0.1", "pillow"]


def test_distribution_and_entry_point() -> None:
    dist = metadata.distribution("mrv2-plugin-glm")
    assert dist.version == "0.1.0"
    # nothing of another family's plugin but Qwen-VL's for GLM-V (an install made before
    # GLM-4.7-Flash's MLA moved into the core may still list the old "mla" extra in its
    # metadata)
    assert [r for r in dist.requires or [] if "extra ==" not in r] == DEPENDENCIES
    assert [(ep.group, ep.name, ep.value) for ep in dist.entry_points] == [
        ("mrv2", "glm", "mrv2_glm.plugin")]
    text = (PLUGIN_DIR / "pyproject.toml").read_text()
    assert 'name = "mrv2-plugin-glm"' in text
    assert f"dependencies = {json.dumps(DEPENDENCIES)}" in text
    assert "optional-dependencies" not in text and "mrv2-plugin-deepseek" not in text
    assert set(mrv2_glm.__all__) == {"Glm4MoeForCausalLM", "Glm4MoeMTP", "GlmForCausalLM",
                                     "Glm4ForCausalLM", "Glm4MoeLiteForCausalLM",
                                     "GlmMoeDsaForCausalLM", "Glm4vForConditionalGeneration",
                                     "Glm4vMoeForConditionalGeneration", "SolarOpenForCausalLM"}
    assert mrv2_glm.Glm4ForCausalLM.__name__ == "Glm4ForCausalLM"
    assert mrv2_glm.Glm4MoeMTP.__name__ == "Glm4MoeMTP"
    with pytest.raises(AttributeError):
        _ = mrv2_glm.Nope


def test_cli_lists_the_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    from mrv2.entrypoints.cli import main

    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^glm 0\.1\.0  \[mrv2-plugin-glm \(entry point mrv2_glm\.plugin\)\]$",
                     out, re.M), out
    assert re.search(r"^    Glm4MoeForCausalLM  \(glm: mrv2_glm\.model:Glm4MoeForCausalLM\)$",
                     out, re.M), out
    for arch, module in (("GlmForCausalLM", "dense"), ("Glm4ForCausalLM", "dense"),
                         ("Glm4MoeLiteForCausalLM", "lite"), ("GlmMoeDsaForCausalLM", "dsa"),
                         ("Glm4vForConditionalGeneration", "glm4v"),
                         ("Glm4vMoeForConditionalGeneration", "glm4v"),
                         ("SolarOpenForCausalLM", "solar_open")):
        assert f"    {arch}  (glm: mrv2_glm.{module}:{arch})\n" in out, out


def test_no_module_imports_another_family() -> None:
    modules = sorted(PACKAGE_DIR.rglob("*.py"))
    assert {m.name for m in modules} >= {"__init__.py", "plugin.py", "model.py", "mtp.py",
                                         "dense.py", "lite.py"}
    for module in modules:
        for node in ast.walk(ast.parse(module.read_text(), str(module))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                package = name.split(".")[0]
                if package == "mrv2_qwen_vl" and module.name in VISION_MODULES:
                    continue
                assert package not in OTHER_FAMILIES, f"{module.name} imports {name}"


SCRIPT = """
import json, sys
from mrv2 import LLM, SamplingParams
from mrv2.entrypoints.cli import main

main(["plugins"])
llm = LLM(sys.argv[1], device="cpu", dtype="float32", block_size=4)
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
out = llm.generate([{"prompt_token_ids": [5, 17, 42, 9]}], params, use_tqdm=False)
others = [m for m in ("mrv2_qwen", "mrv2_llama", "mrv2_deepseek") if m in sys.modules]
print("RESULT " + json.dumps({"tokens": out[0].outputs[0].token_ids, "others": others}))
"""


#: ``{architecture: make_tiny_checkpoint overrides}`` run with only this plugin allowed.
ALONE: dict[str, dict[str, Any]] = {
    "Glm4MoeForCausalLM": {"n_routed_experts": 4, "num_experts_per_tok": 2,
                           "moe_intermediate_size": 32, "first_k_dense_replace": 1},
    # GLM-4.7-Flash: the core's MLA layer and its "mla" backend for the latent cache, no
    # mrv2-plugin-deepseek (not allowed here, not imported)
    "Glm4MoeLiteForCausalLM": {
        "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 12, "num_key_value_heads": 4, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
        "mlp_layer_types": ["dense", "sparse"], "tie_word_embeddings": False, "std": 0.15},
}


@pytest.mark.parametrize("arch", list(ALONE))
def test_runs_with_only_the_glm_plugin(tmp_path: Path, arch: str) -> None:
    path = make_tiny_checkpoint(tmp_path, arch, **ALONE[arch])
    env = {**os.environ, "MRV2_PLUGINS": "glm", "MRV2_PLUGIN_AUTOLOAD": "1",
           "OMP_NUM_THREADS": "1"}
    env.pop("MRV2_PLUGINS_BLOCK", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    listed = re.findall(r"^(\S+) \S+  \[", out, re.M)
    assert listed == ["mrv2.defaults", "glm"], out
    assert f"{arch}  (glm:" in out and "Qwen3ForCausalLM" not in out
    assert "DeepseekV3ForCausalLM" not in out and "attention backends: triton, torch, mla\n" in out
    result = json.loads(out.split("RESULT ", 1)[1])
    assert result["others"] == []
    assert result["tokens"] == hf_greedy(path, [5, 17, 42, 9], 6)
