"""LoRA adapters on Qwen2.5-VL and Qwen3-VL (CPU, fp32): an adapter on the language model's
projections gives HF's tokens of the adapter merged into the weights, with an image in the
prompt and without; the vision tower's modules in an adapter are ignored, as vLLM does."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mrv2 import LLM, LoRARequest, SamplingParams
from mrv2.testing_checkpoints import make_lora_adapter, merge_lora_checkpoint
from mrv2_qwen_vl.testing import (
    END,
    IMAGE,
    START,
    make_tiny_qwen3_vl,
    make_tiny_qwen_vl,
    random_image,
)

FAMILIES: dict[str, tuple[Callable[[Path], Path], Any]] = {
    "qwen2_5_vl": (make_tiny_qwen_vl, transformers.Qwen2_5_VLForConditionalGeneration),
    "qwen3_vl": (make_tiny_qwen3_vl, transformers.Qwen3VLForConditionalGeneration),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _hf_tokens(model_cls: Any, path: Path, llm: LLM, prompt: dict[str, Any]) -> list[int]:
    """HF ``generate`` on the prompt as the engine expands it (the image's rows and inputs
    from the engine's processor, as the family's parity test does)."""
    model = model_cls.from_pretrained(str(path)).eval()
    ids, kwargs = prompt["prompt_token_ids"], {}
    images = prompt.get("multi_modal_data", {}).get("image", [])
    if images:
        ids, items = llm.engine.process_multimodal(ids, {"image": images})
        data = [item.data for item in items]
        kwargs = {"pixel_values": torch.cat([d["pixel_values"] for d in data]),
                  "image_grid_thw": torch.tensor([list(d["grid_thw"]) for d in data])}
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=6, do_sample=False,
                             mm_token_type_ids=(input_ids == IMAGE).int(), **kwargs)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_language_model_adapter_matches_merged_hf(family: str, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    make, model_cls = FAMILIES[family]
    base = make(tmp_path / "base")
    text = make_lora_adapter(base, tmp_path / "text", rank=8, seed=7, exclude="visual")
    merged = merge_lora_checkpoint(base, text, tmp_path / "merged")
    # the same adapter plus a vision-tower module (PEFT's "all-linear" adapters hold some)
    both = tmp_path / "both"
    shutil.copytree(text, both)
    tensors = load_file(str(both / "adapter_model.safetensors"))
    tower = make_lora_adapter(base, tmp_path / "tower", rank=8, seed=8, targets=("qkv",))
    tensors.update(load_file(str(tower / "adapter_model.safetensors")))
    save_file(tensors, str(both / "adapter_model.safetensors"))

    llm = LLM(str(base), device="cpu", dtype="float32", block_size=4, enable_lora=True)
    prompts: list[dict[str, Any]] = [
        {"prompt_token_ids": [5, 17, 42, 9, 100, 3, 77]},
        {"prompt_token_ids": [5, 17, START, IMAGE, END, 42, 9],
         "multi_modal_data": {"image": [random_image(56, 84, 0)]}}]
    for prompt in prompts:
        want = _hf_tokens(model_cls, merged, llm, prompt)
        assert want != _hf_tokens(model_cls, base, llm, prompt)
        for i, path in enumerate((text, both)):
            lora = LoRARequest(path.name, i + 1, str(path))
            got = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0]
            assert got.outputs[0].token_ids == want, (prompt, path.name)
    assert "modules of the vision tower" in caplog.text
