"""Gemma 3n's text decoder against HF transformers through the engine: a tiny config with AltUp
(four copies), Laurel, per-layer embeddings, KV sharing (a local and a global layer reading
earlier layers' caches), activation sparsity on the first two layers, per-layer MLP widths and
soft-capped logits; greedy tokens with chunked prefill (8 tokens a step) and decode steps past
the local window, and prompt log-probabilities. The multimodal checkpoint serves text (its
towers' tensors skipped, its media control ids embedded by their embedders) and refuses
``multi_modal_data`` naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.testing import redraw_weights
from mrv2.testing_engine import check_prompt_logprobs, tokens_at_tp
from mrv2_gemma.gemma3n import Gemma3nMLP
from mrv2_gemma.gemma4 import Gemma4SharedAttention

S, F = "sliding_attention", "full_attention"
#: Layers 4 and 5 share layer 3's (local) and layer 2's (global) keys and values.
TEXT: dict[str, Any] = {
    "vocab_size": 128, "vocab_size_per_layer_input": 128, "hidden_size": 64,
    "intermediate_size": [48, 32, 48, 32, 48, 32], "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 64, "sliding_window": 4, "layer_types": [S, S, F, S, S, F],
    "hidden_size_per_layer_input": 8, "laurel_rank": 8, "altup_num_inputs": 4,
    "num_kv_shared_layers": 2, "activation_sparsity_pattern": [0.95, 0.6, 0.0, 0.0, 0.0, 0.0],
    "final_logit_softcapping": 10.0, "eos_token_id": 1, "bos_token_id": 2, "pad_token_id": 0,
    "rope_parameters": {S: {"rope_type": "default", "rope_theta": 1e4},
                        F: {"rope_type": "default", "rope_theta": 1e6}}}
#: Past the window (4) and past a prefill chunk (8).
PROMPTS = [[5, 17, 42, 9, 100, 3, 77, 8, 8, 120, 33], [3 + i for i in range(9)], [64]]


class _StandInTower(torch.nn.Module):
    """Stands in for HF's MobileNetV5 tower (timm's, not installed here): a text prompt never
    runs it; its tensors are saved for the loader to skip."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(3, 4)


def _save(path: Path, multimodal: bool, monkeypatch: pytest.MonkeyPatch
          ) -> tuple[torch.nn.Module, list[list[int]]]:
    """HF's model (weights redrawn far from init), saved; and the prompts to run (for the
    multimodal checkpoint with media control ids: 129 and 130 in ``embed_vision``'s rows,
    133 in ``embed_audio``'s)."""
    torch.manual_seed(0)
    if multimodal:
        from transformers.models.gemma3n import modeling_gemma3n

        build = modeling_gemma3n.AutoModel.from_config

        def from_config(config: Any, **kwargs: Any) -> Any:
            if isinstance(config, transformers.Gemma3nVisionConfig):
                return _StandInTower()
            return build(config, **kwargs)

        monkeypatch.setattr(modeling_gemma3n.AutoModel, "from_config", from_config)
        text = {**TEXT, "vocab_size": 136, "altup_active_idx": 1}
        vision = {"hidden_size": 16, "vocab_offset": 128, "vocab_size": 4}
        audio = {"hidden_size": 8, "vocab_offset": 132, "vocab_size": 4,
                 "conf_num_hidden_layers": 1, "conf_num_attention_heads": 2,
                 "sscp_conv_channel_size": [4, 4]}
        config: Any = transformers.Gemma3nConfig(
            text_config=text, vision_config=vision, audio_config=audio,
            tie_word_embeddings=False, image_token_id=129, audio_token_id=133,
            boi_token_id=3, eoi_token_id=130, boa_token_id=4, eoa_token_id=132)
        config.architectures = ["Gemma3nForConditionalGeneration"]
        hf: Any = transformers.Gemma3nForConditionalGeneration(config)
        prompts = [*PROMPTS, [5, 129, 8, 130, 133, 40, 7, 2, 9, 11]]
    else:
        config = transformers.Gemma3nTextConfig(**TEXT)
        config.architectures = ["Gemma3nForCausalLM"]
        hf = transformers.Gemma3nForCausalLM(config)
        prompts = PROMPTS
    hf.eval()
    redraw_weights(hf)  # (correct_output_scale too: zeros at init)
    hf.save_pretrained(path)
    return hf, prompts


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None  # (as ignore_eos)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


@pytest.mark.parametrize(("multimodal", "tp"), [(False, 1), (True, 1), (False, 2)],
                         ids=["causal-lm", "multimodal", "causal-lm-tp2"])
def test_greedy_and_prompt_logprobs_match_hf(tmp_path: Path, multimodal: bool, tp: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens (chunked prefill, decode past the local window) and prompt
    log-probabilities equal HF's; the shared layers read their sources' caches; the sparse
    layers are the first two; media in a multimodal request is refused naming the field.
    ``tp`` 2: two ranks (processes), each holding half of every MLP's gate, the sparsity
    cutoff's moments summed across them; tokens only."""
    hf, prompts = _save(tmp_path, multimodal, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = [_hf_greedy(hf, p, 10) for p in prompts]
    if tp > 1:
        assert tokens_at_tp(tmp_path, prompts, params, (tp,), max_num_batched_tokens=8) == {
            tp: want}
        return
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=8)
    model: Any = llm.engine.runner.model
    layers = model.model.layers
    assert [a.source for a in (layer.self_attn for layer in layers)
            if isinstance(a, Gemma4SharedAttention)] == [3, 2]
    mlps = [layer.mlp for layer in layers]
    assert all(isinstance(m, Gemma3nMLP) for m in mlps)
    assert [m.std_multiplier is not None for m in mlps] == [True, True] + [False] * 4
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    ids = prompts[-1] if multimodal else prompts[0]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits, atol=2e-4)
    if multimodal:
        with pytest.raises(ValueError, match=r"multi_modal_data \(image\): "
                                             "Gemma3nForConditionalGeneration serves text"):
            llm.generate([{"prompt_token_ids": [7, 129, 8], "multi_modal_data": {
                "image": [torch.zeros(3, 16, 16)]}}], params, use_tqdm=False)
