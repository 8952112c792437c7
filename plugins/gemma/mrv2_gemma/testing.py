"""Test helpers of the Gemma plugin: a tiny ``Gemma3ForConditionalGeneration`` checkpoint and a
tiny ``Gemma4ForConditionalGeneration`` with audio (:class:`TinyGemma4Audio`), for the plugin's
CPU tests and the GPU tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["AUDIO_MEL", "AUDIO_RATE", "AUDIO_SPECIAL", "AUDIO_TEMPLATE", "GEMMA4_AUDIO",
           "GEMMA4_TEXT", "GEMMA4_VISION", "IMAGE_TOKENS", "TEMPLATE", "TEXT", "VISION", "VOCAB",
           "TinyGemma4Audio", "audio_noise", "check_audio_against_hf", "save_tiny_gemma3_vl"]

VOCAB = 320
TEXT: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 128, "sliding_window": 4, "query_pre_attn_scalar": 24,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                        "full_attention": {"rope_type": "linear", "factor": 4.0,
                                           "rope_theta": 1e6}}}
VISION: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "image_size": 32, "patch_size": 8}
#: A Gemma-like chat template that renders image parts as ``<start_of_image>`` (saved as
#: chat_template.json only, as the VL checkpoints ship it).
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<start_of_image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
#: The image tokens, special in the tiny tokenizer.
IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


def save_tiny_gemma3_vl(path: Path, tied: bool = True, tokenizer: bool = False,
                        image_processor: bool = False) -> torch.nn.Module:
    """A tiny Gemma3ForConditionalGeneration (a local and a global layer, a one-block SigLIP
    tower over 32 x 32 images, 4 soft tokens an image), its weights redrawn, saved as
    transformers writes it; returns HF's model. Its ``<start_of_image>`` /
    ``<end_of_image>`` / soft token ids are 317 / 318 / 319, or with ``tokenizer`` those of a
    tiny tokenizer's special tokens (:data:`IMAGE_TOKENS`), whose chat template
    (:data:`TEMPLATE`) is in ``chat_template.json`` alone, as the VL checkpoints ship it;
    ``image_processor``: with the checkpoint's ``preprocessor_config.json`` (Gemma 3's, at
    32 x 32)."""
    import transformers

    from mrv2.testing import make_tiny_tokenizer, redraw_weights

    ids = [317, 318, 319]
    if tokenizer:
        make_tiny_tokenizer(path, vocab_size=300, special_tokens=IMAGE_TOKENS)
        tok: Any = transformers.AutoTokenizer.from_pretrained(str(path))
        ids = [int(tok.convert_tokens_to_ids(token)) for token in IMAGE_TOKENS]
        assert max(ids) < VOCAB and len(set(ids)) == 3, ids
        (path / "chat_template.jinja").unlink(missing_ok=True)
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
        tok_config.pop("chat_template", None)
        (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
        (path / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    config = transformers.Gemma3Config(
        text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, boi_token_index=ids[0],
        eoi_token_index=ids[1], image_token_index=ids[2], tie_word_embeddings=tied)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    redraw_weights(hf)  # (norm offsets far from 0 too)
    hf.save_pretrained(path)
    if image_processor:
        side = int(VISION["image_size"])
        transformers.Gemma3ImageProcessorPil(size={"height": side, "width": side}
                                             ).save_pretrained(path)
    return hf


_S, _F = "sliding_attention", "full_attention"
#: :class:`TinyGemma4Audio`'s text model: five layers (two full), two sharing earlier KV,
#: per-layer inputs, an image's tokens two-way on the sliding layers.
GEMMA4_TEXT: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 48, "num_hidden_layers": 5,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
    "max_position_embeddings": 512, "sliding_window": 8, "layer_types": [_S, _F, _S, _S, _F],
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 320,
    "num_kv_shared_layers": 2, "use_bidirectional_attention": "vision", "eos_token_id": 1,
    "bos_token_id": 2, "pad_token_id": 0}
#: Its vision tower: patches of 4, pooled 2 x 2.
GEMMA4_VISION: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 16, "patch_size": 4, "pooling_kernel_size": 2,
    "position_embedding_size": 64}
#: Its audio tower: two conformer layers; 32 mel bins (the subsampler's first 32 channels take
#: 32 / 4 after two halvings); blocks of 4 tokens seeing 4 before and 1 after; eps off HF's
#: 1e-6 default.
GEMMA4_AUDIO: dict[str, Any] = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "subsampling_conv_channels": [32, 8], "conv_kernel_size": 3, "attention_chunk_size": 4,
    "attention_context_left": 5, "attention_context_right": 2, "output_proj_dims": 24,
    "rms_norm_eps": 1e-3}
#: The feature extractor's mel bins and sampling rate.
AUDIO_MEL, AUDIO_RATE = 32, 16000
#: The tiny tokenizer's special tokens: image, its start and end, video, audio, its start and
#: end.
AUDIO_SPECIAL = ("<|image|>", "<boi>", "<eoi>", "<|video|>", "<|audio|>", "<boa>", "<eoa>")
#: A chat template that renders image parts as ``<|image|>`` and audio parts as ``<|audio|>``.
AUDIO_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|image|>{% elif p['type'] == 'audio' %}<|audio|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% endif %}")


def _redraw_clipped(model: Any) -> None:
    """Weights far from init; clip bounds finite in [-2, -1) / [1, 2) (they bite)."""
    from mrv2.testing import redraw_weights

    redraw_weights(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith(("_min", "_max")):
                sign = -1.0 if name.endswith("_min") else 1.0
                buf.fill_(sign * (1.0 + torch.rand((), generator=gen).item()))


class TinyGemma4Audio:
    """A tiny ``Gemma4ForConditionalGeneration`` with images and audio saved to ``path`` (HF's
    fp32 model, its weights and clip bounds redrawn; a tiny tokenizer of
    :data:`AUDIO_SPECIAL` with :data:`AUDIO_TEMPLATE`; Gemma 4's image processor and, in
    ``processor_config.json``, HF's audio feature extractor at :data:`AUDIO_MEL` bins): its
    path, HF's model, the extractor and the token ids. ``text`` / ``audio`` override fields of
    :data:`GEMMA4_TEXT` / :data:`GEMMA4_AUDIO`; ``tied``: the LM head is the embedding."""

    def __init__(self, path: Path, text: dict[str, Any] | None = None,
                 audio: dict[str, Any] | None = None, tied: bool = True) -> None:
        import transformers

        from mrv2.testing import make_tiny_tokenizer

        text_config = {**GEMMA4_TEXT, **(text or {})}
        make_tiny_tokenizer(path, vocab_size=300, special_tokens=AUDIO_SPECIAL,
                            chat_template=AUDIO_TEMPLATE)
        tok: Any = transformers.AutoTokenizer.from_pretrained(str(path))
        ids = [int(tok.convert_tokens_to_ids(token)) for token in AUDIO_SPECIAL]
        assert max(ids) < text_config["vocab_size"] and len(set(ids)) == len(ids), ids
        self.image, boi, eoi, video, self.audio, self.boa, self.eoa = ids
        config = transformers.Gemma4Config(
            text_config=text_config, vision_config=GEMMA4_VISION,
            audio_config={**GEMMA4_AUDIO, **(audio or {})}, image_token_id=self.image,
            boi_token_id=boi, eoi_token_id=eoi, video_token_id=video, audio_token_id=self.audio,
            boa_token_id=self.boa, eoa_token_index=self.eoa, tie_word_embeddings=tied)
        config.architectures = ["Gemma4ForConditionalGeneration"]
        torch.manual_seed(0)
        self.hf: Any = transformers.Gemma4ForConditionalGeneration(config).eval()
        _redraw_clipped(self.hf)
        self.hf.save_pretrained(path)
        transformers.Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70,
                                             pooling_kernel_size=2).save_pretrained(path)
        self.extractor = transformers.Gemma4AudioFeatureExtractor(feature_size=AUDIO_MEL)
        (path / "processor_config.json").write_text(json.dumps(  # (transformers 5's layout)
            {"processor_class": "Gemma4Processor",
             "feature_extractor": json.loads(self.extractor.to_json_string())}))
        self.path = path

    def hf_inputs(self, ids: list[int], items: list[Any], clips: list[np.ndarray]
                  ) -> dict[str, Any]:
        """HF's inputs of a prompt: its images' processed pixels (the engine's items'), its
        clips (at 16 kHz) through HF's feature extractor in one padded batch, the token
        types (image 1, audio 3)."""
        out: dict[str, Any] = {}
        images = [i for i in items if i.kind == "image"]
        if images:
            out["pixel_values"] = torch.stack([i.data["pixel_values"] for i in images])
            out["image_position_ids"] = torch.stack([i.data["position_ids"] for i in images])
        if clips:
            batch = self.extractor(clips, return_tensors="pt")
            out["input_features"] = batch["input_features"]
            out["input_features_mask"] = batch["input_features_mask"]
        row = torch.tensor([ids])
        out["mm_token_type_ids"] = (row == self.image).long() + 3 * (row == self.audio).long()
        return out


def audio_noise(seconds: float, seed: int, rate: int = AUDIO_RATE) -> np.ndarray:
    """Seeded noise plus a sine: ``seconds`` of float32 samples at ``rate``."""
    n = int(seconds * rate)
    t = np.arange(n) / rate
    rng = np.random.default_rng(seed)
    return (0.3 * np.sin(2 * np.pi * (300 + 100 * seed) * t)
            + 0.1 * rng.standard_normal(n)).astype(np.float32)


def check_audio_against_hf(llm: Any, tiny: TinyGemma4Audio,
                           prompts: list[tuple[list[int], dict[str, Any], list[np.ndarray]]],
                           encoder_runs: int, logprobs_of: int, max_tokens: int = 6,
                           atol: float = 1e-3) -> list[tuple[list[int], Any]]:
    """As :func:`mrv2.testing_engine.check_images_against_hf`, for ``(prompt ids,
    multi_modal_data, the clips at 16 kHz for HF)``: greedy tokens (``max_tokens``,
    ``ignore_eos``) equal HF's ``generate``, the first round runs ``encoder_runs`` encoder
    runs and a second round none, the prompt ``logprobs_of``'s log-probabilities are within
    ``atol`` of HF's forward. Returns each prompt's expanded ids and items."""
    from mrv2 import SamplingParams
    from mrv2.testing_engine import check_prompt_logprobs

    processor = llm.engine.input_processor
    assert processor is not None
    tiny.hf.generation_config.eos_token_id = None
    expanded, want = [], []
    for prompt, data, clips in prompts:
        ids, items = processor.process(prompt, data)
        expanded.append((ids, items))
        with torch.no_grad():
            out = tiny.hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                   dtype=torch.long), max_new_tokens=max_tokens,
                                   do_sample=False, **tiny.hf_inputs(ids, items, clips))
        want.append([int(t) for t in out[0, len(ids):]])
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = [{"prompt_token_ids": p, "multi_modal_data": d} for p, d, _ in prompts]
    state = llm.engine.runner.model_state
    before = state.encoder_runs
    got = llm.generate(requests, greedy, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == want
    assert state.encoder_runs - before == encoder_runs
    again = llm.generate(requests, greedy, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in again] == want
    assert state.encoder_runs - before == encoder_runs  # (the encoder cache)
    ids, items = expanded[logprobs_of]
    with torch.no_grad():
        logits = tiny.hf(torch.tensor([ids]), **tiny.hf_inputs(ids, items,
                                                                prompts[logprobs_of][2])).logits
    check_prompt_logprobs(llm, requests[logprobs_of], ids, logits[0], atol=atol)
    return expanded
