"""``DecoderModel.keep_aux_hidden_states``: each forward copies the residual stream at the input
of the chosen layers (HF's ``hidden_states[i]``) into one persistent buffer, for every family
built on ``DecoderModel``; ids outside the model are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from mrv2 import EngineConfig, Runner
from mrv2.testing import make_tiny_checkpoint, poisoned_caches, run_step


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "LlamaForCausalLM"])
def test_kept_layers_equal_hf_hidden_states(arch: str, tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path, arch, num_hidden_layers=3)
    runner = Runner.from_config(EngineConfig.from_kwargs(model=str(path), device="cpu",
                                                         dtype="float32"))
    model = runner.model
    assert model.aux_hidden_states is None
    buffer = model.keep_aux_hidden_states([2, 0], 16)
    assert buffer.shape == (16, 2 * 64) and model.aux_hidden_states is buffer
    prompt = [5, 17, 42, 9, 100, 3, 77]
    caches = poisoned_caches(2, model.config.head_dim or 16, 3)
    run_step(model, caches, [list(range(4))], [0], [prompt], num_pad=1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([states[2][0], states[0][0]], -1)
    torch.testing.assert_close(buffer[: len(prompt)], want, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match=r"\[0, 3\] must be in 0\.\.2"):
        model.keep_aux_hidden_states([0, 3], 16)
