"""GLM-4.1V (``Glm4vForConditionalGeneration``) and GLM-4.5V (``Glm4vMoeForConditionalGeneration``)
through ``LLM`` against HF transformers on tiny random checkpoints (CPU, fp32): greedy tokens
and log-probabilities with one image, two images of different sizes around text, text only;
chunked prefill over an image's rows; the vision tower alone on several images; the image
preprocessing and placeholder expansion against HF's ``Glm4vImageProcessor``; videos
refused; the encoder's memory profile; the checkpoints' tensor names; TP=2; a LoRA adapter;
the released sizes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from PIL import Image

from mrv2 import LLM, SamplingParams
from mrv2.testing import random_image
from mrv2_glm.testing_glm4v import BEGIN_IMAGE, END_IMAGE, IMAGE, make_tiny_glm4v

#: family -> (build the tiny checkpoint as GLM-4.5V, HF model class)
FAMILIES: dict[str, tuple[bool, Any]] = {
    "glm4v": (False, transformers.Glm4vForConditionalGeneration),
    "glm4v_moe": (True, transformers.Glm4vMoeForConditionalGeneration),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Each family's tiny checkpoint, built on first use."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = make_tiny_glm4v(tmp_path_factory.mktemp(family),
                                            moe=FAMILIES[family][0])
        return built[family]

    return get


def _prompt(*parts: list[int] | Image.Image) -> tuple[list[int], list[Image.Image]]:
    ids: list[int] = []
    images = []
    for part in parts:
        if isinstance(part, Image.Image):
            ids += [BEGIN_IMAGE, IMAGE, END_IMAGE]
            images.append(part)
        else:
            ids += part
    return ids, images


def _llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, **kwargs)


CASES = {
    # 56 x 84 -> 4 x 6 patches (6 tokens); 112 x 56 -> 8 x 4 (8 tokens); 20 x 30 is scaled up
    # to the processor's minimum (4 x 6 patches)
    "one_image": lambda: _prompt([5, 17], random_image(56, 84, 0), [42, 9, 100]),
    "two_images_around_text": lambda: _prompt([3], random_image(112, 56, 1), [8, 8, 120, 7],
                                              random_image(20, 30, 2), [33]),
    "text_only": lambda: _prompt([5, 17, 42, 9, 100, 3, 77]),
}


def _generate(llm: LLM, ids: list[int], images: list[Image.Image]) -> list[int]:
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_greedy_match_hf(checkpoints: Callable[[str], Path], family: str,
                                    case: str) -> None:
    """Greedy tokens equal HF ``generate``'s; every prompt and generated position's top-3
    log-probabilities equal HF's ``log_softmax`` of one forward over the whole sequence (the
    tower's rows, the M-RoPE positions of the image tokens and of the text after them, the
    partial rotation and its ``mrope_section`` all count)."""
    checkpoint = checkpoints(family)
    llm = _llm(checkpoint)
    hf_model = FAMILIES[family][1].from_pretrained(checkpoint).eval()
    hf_model.generation_config.eos_token_id = None  # (ignore_eos, as ours)
    ids, images = CASES[case]()
    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    got = output.outputs[0].token_ids
    processor = llm.engine.input_processor
    assert processor is not None
    expanded, items = processor.process(ids, {"image": images} if images else {})
    kwargs: dict[str, Any] = {}
    if items:
        kwargs["pixel_values"] = torch.cat([i.data["pixel_values"] for i in items])
        kwargs["image_grid_thw"] = torch.tensor([i.data["grid_thw"] for i in items])
    input_ids = torch.tensor([expanded])
    with torch.no_grad():
        want = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=8, do_sample=False,
                                 mm_token_type_ids=(input_ids == IMAGE).int(), **kwargs)
        assert got == want[0, len(expanded):].tolist()
        sequence = torch.tensor([expanded + got])
        logits = hf_model(sequence, mm_token_type_ids=(sequence == IMAGE).int(),
                          **kwargs).logits[0]
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert output.prompt_logprobs is not None and output.outputs[0].logprobs is not None
    positions = [*output.prompt_logprobs[1:], *output.outputs[0].logprobs]
    assert len(positions) == sequence.shape[1] - 1
    for j, logprobs in enumerate(positions, start=1):
        assert logprobs is not None
        assert set(ref[j - 1].topk(3).indices.tolist()) <= set(logprobs), f"position {j}"
        for token, lp in logprobs.items():
            assert lp.logprob == pytest.approx(float(ref[j - 1, token]), abs=2e-4), (
                f"position {j}, token {token}")


def test_chunked_prefill_and_encoder_cache(checkpoints: Callable[[str], Path]) -> None:
    """Steps of 4 tokens split an image's rows (and the text after it, whose positions carry
    the image's shift) across steps next to another request: a fresh engine's tokens, each
    distinct image encoded once."""
    checkpoint = checkpoints("glm4v")
    fresh = _llm(checkpoint, enable_prefix_caching=False)
    one, two = CASES["one_image"](), CASES["two_images_around_text"]()
    want = [_generate(fresh, *one), _generate(fresh, *two)]
    chunked = _llm(checkpoint, enable_prefix_caching=False, max_num_batched_tokens=4,
                   max_num_seqs=2)
    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
               for ids, images in (one, two)]
    outs = chunked.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert chunked.engine.runner.model_state.encoder_runs == 3


def test_vision_tower_matches_hf_on_several_images(checkpoints: Callable[[str], Path]) -> None:
    """The tower on three images at once (grids unlike the 4 x 4 position table: the bicubic
    resampling, the per-image attention and 2-D rope) gives HF's ``pooler_output``."""
    from mrv2_glm.vision_glm4v import Glm4vVisionTower

    hf = transformers.Glm4vForConditionalGeneration.from_pretrained(
        checkpoints("glm4v")).model.visual.eval()
    tower = Glm4vVisionTower(hf.config)
    state = [(f"model.visual.{name}", t) for name, t in hf.state_dict().items()]
    assert tower.load_weights(state) == {name for name, _ in tower.named_parameters()}
    grids = [(1, 4, 6), (1, 10, 2), (1, 6, 6)]
    gen = torch.Generator().manual_seed(3)
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), tower.patch_dim, generator=gen)
    with torch.no_grad():
        want = hf(pixels, grid_thw=torch.tensor(grids)).pooler_output
        got = tower(pixels, grids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_preprocessing_matches_hf_image_processor(checkpoints: Callable[[str], Path]) -> None:
    """Our input processor's items are HF ``Glm4vImageProcessor``'s (built here from the
    checkpoint's settings, independently of the engine): the same pixel rows and grids for
    images scaled up to ``shortest_edge``, down to ``longest_edge`` (both counted for two
    temporal frames) and in between; each ``<|image|>`` expanded as HF's ``Glm4vProcessor``
    expands it, in place, the text around it kept."""
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    checkpoint = checkpoints("glm4v")
    llm = _llm(checkpoint)
    processor = llm.engine.input_processor
    assert processor is not None
    images = [random_image(20, 30, 0), random_image(400, 300, 1), random_image(90, 150, 2)]
    ids, _ = _prompt([7], images[0], [8, 9], images[1], images[2], [10])
    expanded, items = processor.process(ids, {"image": images})
    hf = Glm4vImageProcessorPil.from_pretrained(checkpoint)
    out = hf(images=images, return_tensors="pt")
    grids = out["image_grid_thw"].tolist()
    assert [list(item.data["grid_thw"]) for item in items] == grids
    # 20 x 30 is under the 28-pixel factor and the minimum (8 * 28**2 pixels over the two
    # frames): scaled up to 56 x 84; 400 x 300 is past the maximum (128 * 28**2): scaled down
    assert grids[0] == [1, 4, 6] and grids[1][1] * grids[1][2] // 4 <= 64 < 400 * 300 // 28**2
    torch.testing.assert_close(torch.cat([item.data["pixel_values"] for item in items]),
                               out["pixel_values"], rtol=0, atol=0)
    counts = [len(transformers.Glm4vProcessor.replace_image_token(
        SimpleNamespace(image_processor=hf, image_token="x"), out, n)) for n in range(3)]
    want: list[int] = [7, BEGIN_IMAGE, *[IMAGE] * counts[0], END_IMAGE, 8, 9, BEGIN_IMAGE,
                       *[IMAGE] * counts[1], END_IMAGE, BEGIN_IMAGE, *[IMAGE] * counts[2],
                       END_IMAGE, 10]
    assert expanded == want
    assert [(item.offset, item.length) for item in items] == [
        (2, counts[0]), (6 + counts[0], counts[1]), (8 + counts[0] + counts[1], counts[2])]
    assert len({item.content_hash for item in items}) == 3


def test_videos_and_unmatched_placeholders_are_refused(checkpoints: Callable[[str], Path]
                                                       ) -> None:
    llm = _llm(checkpoints("glm4v"))
    processor = llm.engine.input_processor
    assert processor is not None
    ids, images = CASES["one_image"]()
    with pytest.raises(ValueError, match="multi_modal_data.video"):
        processor.process(ids, {"image": images, "video": [images[0]]})
    with pytest.raises(ValueError, match="image placeholders"):
        processor.process(ids, {"image": images * 2})


def test_the_memory_profile_runs_the_tower_on_the_largest_image(
        checkpoints: Callable[[str], Path]) -> None:
    """``profile_encoder`` runs the tower on the largest image a prompt may carry: the tiny
    processor's ``longest_edge`` (128 * 28**2 pixels, counted over GLM's two temporal
    frames: 64 merged tokens, a 16 x 16 patch grid) or the prompt's tokens, whichever is
    less; the encoder cache is untouched."""
    llm = _llm(checkpoints("glm4v"))
    state = llm.engine.runner.model_state
    grids: list[Any] = []
    embed = state.model.embed_images

    def spy(pixels: torch.Tensor, grid_thw: list[Any]) -> torch.Tensor:
        grids.append((tuple(pixels.shape), list(grid_thw)))
        return embed(pixels, grid_thw)

    state.model.embed_images = spy
    assert state.profile_encoder(4095) == state.encoder_cache_bytes > 0
    assert state.profile_encoder(30) == state.encoder_cache_bytes
    patch_dim = state.model.visual.patch_dim
    assert grids == [((256, patch_dim), [(1, 16, 16)]), ((100, patch_dim), [(1, 10, 10)])]
    assert state.encoder_runs == 0 and not state._cache


@pytest.mark.parametrize("layout", ["transformers", "older"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpoint_names(checkpoints: Callable[[str], Path], family: str, layout: str) -> None:
    """Every parameter loads from HF's names (``model.language_model.*``, ``model.visual.*``)
    and from the older layout (``model.*``, ``visual.*``); GLM-4.5V's MTP layer tensors
    (``layers.{num_hidden_layers}``, as the released checkpoints hold) are skipped."""
    from mrv2.registry import import_object
    from mrv2_glm.plugin import mrv2_register_models

    registered: dict[str, str] = {}
    mrv2_register_models(lambda arch, model, **_: registered.setdefault(arch, model))
    hf = FAMILIES[family][1].from_pretrained(checkpoints(family))
    ours = import_object(registered[type(hf).__name__])(hf.config)
    tensors = list(hf.state_dict().items())
    if family == "glm4v_moe":
        layers = hf.config.text_config.num_hidden_layers
        tensors.append((f"model.language_model.layers.{layers}.eh_proj.weight",
                        torch.zeros(96, 192)))
    if layout == "older":
        tensors = [(name.replace("model.language_model.", "model.").replace(
            "model.visual.", "visual."), t) for name, t in tensors]
    assert ours.load_weights(tensors) == {name for name, _ in ours.named_parameters()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tensor_parallel(checkpoints: Callable[[str], Path], family: str) -> None:
    """TP=2 (ranks as processes; the tower replicated, the decoder's heads, MLPs and experts
    split, GLM-4.1V's q/k rows reordered before a rank takes its heads) gives TP=1's tokens
    for an image prompt and a text prompt in one batch."""
    ids, images = CASES["one_image"]()
    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
               {"prompt_token_ids": [3, 8, 9, 10, 11]}]
    got = {}
    for tp in (1, 2):
        with _llm(checkpoints(family), tensor_parallel_size=tp) as llm:
            got[tp] = [o.outputs[0].token_ids
                       for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got[2] == got[1]


#: The released models' text fields that shape the decoder (the rest: the configs' defaults,
#: which are GLM-4.1V-9B's and GLM-4.5V's; GLM-4.5V cut to 4 of its 46 layers).
RELEASED_TEXT: dict[str, dict[str, Any]] = {
    "glm4v": {"partial_rotary_factor": 0.5, "rope_theta": 10000,
              "rope_scaling": {"type": "default", "mrope_section": [8, 12, 12]}},
    "glm4v_moe": {"partial_rotary_factor": 0.5, "rope_theta": 10000, "head_dim": 128,
                  "rope_scaling": {"type": "default", "mrope_section": [8, 12, 12]},
                  "num_hidden_layers": 4, "n_routed_experts": 128, "num_experts_per_tok": 8,
                  "num_nextn_predict_layers": 1},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_released_sizes(family: str) -> None:
    """Built on the meta device at the released sizes, our model has HF's parameters (HF keeps
    GLM-4.5V's router correction biases as buffers) and rotates 64 of each head's 128 dims by
    ``[8, 12, 12]``."""
    from mrv2.registry import import_object
    from mrv2_glm.plugin import mrv2_register_models

    moe, hf_class = FAMILIES[family]
    config = getattr(transformers, "Glm4vMoeConfig" if moe else "Glm4vConfig")(
        text_config=RELEASED_TEXT[family])
    registered: dict[str, str] = {}
    mrv2_register_models(lambda arch, model, **_: registered.setdefault(arch, model))
    with torch.device("meta"):
        ours = import_object(registered[hf_class.__name__])(config)
        hf = hf_class(config)
    buffers = sum(b.numel() for name, b in hf.named_buffers()
                  if name.endswith("e_score_correction_bias"))
    assert sum(p.numel() for p in ours.parameters()) == sum(
        p.numel() for p in hf.parameters()) + buffers
    rope = ours.model.layers[0].self_attn.rotary_emb
    assert (rope.head_dim, rope.rotary_dim, rope.mrope_section) == (128, 64, [8, 12, 12])


def test_language_model_adapter_matches_merged_hf(tmp_path: Path) -> None:
    """A LoRA adapter on GLM-4.1V's language model (q/k/v/o and the fused ``gate_up_proj``,
    named ``model.language_model.*``; the q/k ``B`` rows put in the halves order as the
    weights') gives HF's tokens of the adapter merged into the weights, with an image in the
    prompt and without."""
    from mrv2 import LoRARequest
    from mrv2.testing_checkpoints import make_lora_adapter, merge_lora_checkpoint

    base = make_tiny_glm4v(tmp_path / "base")
    adapter = make_lora_adapter(base, tmp_path / "lora", rank=4, seed=7, exclude="visual",
                                targets=("q_proj", "k_proj", "v_proj", "o_proj",
                                         "gate_up_proj"))
    merged = merge_lora_checkpoint(base, adapter, tmp_path / "merged")
    llm = _llm(base, enable_lora=True)
    processor = llm.engine.input_processor
    assert processor is not None
    for ids, images in (CASES["one_image"](), CASES["text_only"]()):
        expanded, items = processor.process(ids, {"image": images} if images else {})
        kwargs: dict[str, Any] = {}
        if items:
            kwargs["pixel_values"] = torch.cat([i.data["pixel_values"] for i in items])
            kwargs["image_grid_thw"] = torch.tensor([i.data["grid_thw"] for i in items])
        input_ids = torch.tensor([expanded])
        hf_tokens = []
        for path in (merged, base):
            model = transformers.Glm4vForConditionalGeneration.from_pretrained(path).eval()
            model.generation_config.eos_token_id = None
            with torch.no_grad():
                out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                     max_new_tokens=8, do_sample=False,
                                     mm_token_type_ids=(input_ids == IMAGE).int(), **kwargs)
            hf_tokens.append(out[0, len(expanded):].tolist())
        assert hf_tokens[0] != hf_tokens[1]
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        got = llm.generate(prompt, GREEDY, use_tqdm=False,
                           lora_request=LoRARequest("glm4v", 1, str(adapter)))[0]
        assert got.outputs[0].token_ids == hf_tokens[0]
