"""Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE through ``LLM`` against HF transformers on tiny
random checkpoints (CPU, fp32): greedy tokens and log-probabilities with one image, two images
of different sizes around text, text only; the encoder cache and chunked prefill (an image's
rows, and Qwen3-VL's deepstack features, split across steps) with decode steps on the
CUDA-graph path (CPU stand-ins); the prefix cache never shared across different images; the
bench's bundled configs of the released models; Qwen3-VL-MoE's published expert layout. Bad
inputs, chat, the server and the bench run on Qwen2.5-VL only (the engine's multimodal path,
the same for every family)."""

from __future__ import annotations

import base64
import dataclasses
import functools
import io
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from PIL import Image

from mrv2 import LLM, SamplingParams
from mrv2.testing import emulate_cuda_graphs, make_tiny_checkpoint
from mrv2_qwen_vl.testing import (
    END,
    IMAGE,
    START,
    make_tiny_qwen2_vl,
    make_tiny_qwen3_vl,
    make_tiny_qwen_vl,
    random_image,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
_image = random_image
#: family -> (tiny checkpoint builder, HF model class)
FAMILIES: dict[str, tuple[Callable[[Path], Path], Any]] = {
    "qwen2_vl": (make_tiny_qwen2_vl, transformers.Qwen2VLForConditionalGeneration),
    "qwen2_5_vl": (make_tiny_qwen_vl, transformers.Qwen2_5_VLForConditionalGeneration),
    "qwen3_vl": (make_tiny_qwen3_vl, transformers.Qwen3VLForConditionalGeneration),
    "qwen3_vl_moe": (functools.partial(make_tiny_qwen3_vl, moe=True),
                     transformers.Qwen3VLMoeForConditionalGeneration),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Each family's tiny checkpoint, built on first use."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = FAMILIES[family][0](tmp_path_factory.mktemp(family))
        return built[family]

    return get


@pytest.fixture(scope="module")
def checkpoint(checkpoints: Callable[[str], Path]) -> Path:
    return checkpoints("qwen2_5_vl")


def _prompt(*parts: list[int] | Image.Image) -> tuple[list[int], list[Image.Image]]:
    ids: list[int] = []
    images = []
    for part in parts:
        if isinstance(part, Image.Image):
            ids += [START, IMAGE, END]
            images.append(part)
        else:
            ids += part
    return ids, images


@pytest.fixture(scope="module")
def hf_models(checkpoints: Callable[[str], Path]) -> Callable[[str], Any]:
    """Each family's HF model over its tiny checkpoint, loaded on first use."""
    loaded: dict[str, Any] = {}

    def get(family: str) -> Any:
        if family not in loaded:
            loaded[family] = FAMILIES[family][1].from_pretrained(checkpoints(family)).eval()
        return loaded[family]

    return get


def _hf_inputs(llm: LLM, ids: list[int], images: list[Image.Image]
               ) -> tuple[list[int], dict[str, Any]]:
    """The prompt as our processor expanded it, and HF's image inputs (the same pixels)."""
    processor = llm.engine.input_processor
    assert processor is not None
    expanded, items = processor.process(ids, {"image": images} if images else {})
    kwargs: dict[str, Any] = {}
    if items:
        kwargs["pixel_values"] = torch.cat([i.data["pixel_values"] for i in items])
        kwargs["image_grid_thw"] = torch.tensor([i.data["grid_thw"] for i in items])
    return expanded, kwargs


def _llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, **kwargs)


CASES = {
    "one_image": lambda: _prompt([5, 17], _image(56, 84, 0), [42, 9, 100]),
    "two_images_around_text": lambda: _prompt([3], _image(112, 56, 1), [8, 8, 120, 7],
                                              _image(56, 56, 2), [33]),
    "text_only": lambda: _prompt([5, 17, 42, 9, 100, 3, 77]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_greedy_match_hf(checkpoints: Callable[[str], Path],
                                    hf_models: Callable[[str], Any], family: str,
                                    case: str) -> None:
    """Greedy tokens equal HF ``generate``'s; every prompt and generated position's top-3
    log-probabilities equal HF's ``log_softmax`` of one forward over the whole sequence (image
    rows, M-RoPE positions and the shift after each image all count; for Qwen3-VL also the
    interleaved rotation and the deepstack features added after the first decoder layers)."""
    llm = _llm(checkpoints(family))
    hf_model = hf_models(family)
    ids, images = CASES[case]()
    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3,
                            prompt_logprobs=3)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    got = output.outputs[0].token_ids
    expanded, kwargs = _hf_inputs(llm, ids, images)
    input_ids = torch.tensor([expanded])
    types_ = {"mm_token_type_ids": (input_ids == IMAGE).int()}
    with torch.no_grad():
        want = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=8, do_sample=False, **kwargs, **types_)
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


def _generate(llm: LLM, ids: list[int], images: list[Image.Image]) -> list[int]:
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_encoder_cache_and_prefix_cache(checkpoints: Callable[[str], Path], family: str
                                        ) -> None:
    """Chunked prefill (steps of 4 tokens: an image's rows, with Qwen3-VL's deepstack
    features, split across steps and next to another request's) gives a fresh engine's tokens
    and encodes each image once. The same image in two prompts of one batch and in a later
    request is encoded once and gives the same tokens as a fresh engine; the same prompt
    tokens with a different image of the same size share no image block of the prefix cache
    (its tokens are those of a fresh engine), while the same image again hits it."""
    checkpoint = checkpoints(family)
    a, b = _image(56, 84, 0), _image(56, 84, 5)
    ids, _ = _prompt([5, 17], a, [42, 9, 100])
    fresh = _llm(checkpoint, enable_prefix_caching=False)  # different images: no cache hit
    fresh_a, fresh_b = _generate(fresh, ids, [a]), _generate(fresh, ids, [b])
    assert fresh_a != fresh_b
    two = CASES["two_images_around_text"]()
    fresh_two = _generate(fresh, *two)
    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"image": [a]}},
               {"prompt_token_ids": two[0], "multi_modal_data": {"image": two[1]}}]
    # chunked prefill: the image's 6 placeholder rows spread over steps of 4 tokens; decode
    # steps through the CUDA-graph path (CPU stand-ins), captured without any image rows
    chunked = _llm(checkpoint, enable_prefix_caching=False, max_num_batched_tokens=4,
                   max_num_seqs=2)
    runner = chunked.engine.runner
    emulate_cuda_graphs(runner)
    steps: list[tuple[int, bool]] = []  # (mixed graph replayed, image rows in the step)
    build = runner.builder.build

    def recorded(*args: Any) -> Any:
        plan = build(*args)
        images = runner.model_state.get_mm_embeddings(plan.batch) is not None
        steps.append((plan.replay_tokens, images))
        return plan

    runner.builder.build = recorded
    outs = chunked.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [fresh_a, fresh_two]
    assert runner.model_state.encoder_runs == 3
    graphs = runner.graphs
    assert graphs is not None and sum(g.replays for g in graphs.graphs.values()) >= 7
    # prompt chunks without image rows replay the mixed graph; those with image rows never
    assert any(t for t, _ in steps) and any(images for _, images in steps)
    assert not any(t and images for t, images in steps)
    llm = _llm(checkpoint)
    state = llm.engine.runner.model_state
    prompts = [{"prompt_token_ids": ids, "multi_modal_data": {"image": [a]}},
               {"prompt_token_ids": [3, *ids], "multi_modal_data": {"image": [a]}}]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == fresh_a and state.encoder_runs == 1
    before = llm.engine.stats()["prefix_cache_hits"]
    assert _generate(llm, ids, [b]) == fresh_b and state.encoder_runs == 2
    image_start = 3  # [5, 17, START]: the image's tokens begin in the first block of 4
    assert llm.engine.stats()["prefix_cache_hits"] - before < 4 * (image_start // 4 + 1)
    before = llm.engine.stats()["prefix_cache_hits"]
    assert _generate(llm, ids, [a]) == fresh_a and state.encoder_runs == 2  # cache, prefix
    assert llm.engine.stats()["prefix_cache_hits"] - before >= 8


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decoding_requests_hold_no_image_embeddings(checkpoints: Callable[[str], Path],
                                                    family: str) -> None:
    """A request lets go of its image in the step that computes the image's last row: with
    no pool for released embeddings (``encoder_cache_bytes = 0``), the encoder cache is empty
    once both requests decode. Until then each request holds the image across the chunks of
    its rows (steps of 4 tokens: three steps each): encoded once per request, since the
    second request's prefill starts after the first let go. Tokens as a fresh engine's."""
    checkpoint = checkpoints(family)
    a = _image(56, 84, 0)
    ids, _ = _prompt([5, 17], a, [42, 9, 100])
    second = [3, 11, *ids]
    fresh = _llm(checkpoint, enable_prefix_caching=False)
    want = [_generate(fresh, ids, [a]), _generate(fresh, second, [a])]
    llm = _llm(checkpoint, enable_prefix_caching=False, max_num_batched_tokens=4,
               max_num_seqs=2)
    runner = llm.engine.runner
    state = runner.model_state
    state.encoder_cache_bytes = 0
    held: list[tuple[int, int, bool]] = []  # (cache entries, holds, a prompt row in the step)
    execute = runner.execute

    def spy(scheduled: Any) -> Any:
        out = execute(scheduled)
        in_prompt = any(i.num_computed <= i.num_prompt for i in runner.table.info.values())
        held.append((len(state._cache), sum(state._refs.values()), in_prompt))
        return out

    runner.execute = spy
    prompts = [{"prompt_token_ids": p, "multi_modal_data": {"image": [a]}}
               for p in (ids, second)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert state.encoder_runs == 2  # not once per chunk: held until its last row
    assert max(entries for entries, _, _ in held) == 1
    decoding = [(entries, holds) for entries, holds, in_prompt in held if not in_prompt]
    assert len(decoding) >= 6 and set(decoding) == {(0, 0)}


def test_the_largest_image_grid() -> None:
    from mrv2_qwen_vl.model_state import largest_image_grid, largest_video_grid

    # bounded by the prompt: 4,095 tokens -> a 63 x 63 square of merged tokens
    assert largest_image_grid(4095, 2, 14, 12845056) == (1, 126, 126)
    # bounded by the processor: 12,845,056 px / 28**2 = 16,384 tokens -> 128 x 128
    assert largest_image_grid(131071, 2, 14, 12845056) == (1, 256, 256)
    assert largest_image_grid(131071, 2, 16, 16777216) == (1, 256, 256)  # Qwen3-VL: 32 px
    assert largest_image_grid(100, 2, 14, None) == (1, 20, 20)
    assert largest_image_grid(0, 2, 14, None) is None
    # Qwen2.5-VL's video defaults (768 merged tokens a frame at most): 128k tokens hold 179
    # frame groups of 27 x 27 (729 tokens); a prompt of one frame group's tokens is covered
    # by the image's run
    assert largest_video_grid(131071, 2, 14, 28 * 28 * 768) == (179, 54, 54)
    assert largest_video_grid(700, 2, 14, 28 * 28 * 768) is None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_memory_profile_runs_the_vision_tower_on_the_largest_image(
        checkpoints: Callable[[str], Path], family: str) -> None:
    """``profile_encoder`` (the runner calls it inside its CUDA memory profile) runs the tower
    on the largest image a prompt may carry: the tiny processor's ``max_pixels`` (64 merged
    tokens) or the prompt's tokens, whichever is less; the encoder cache is untouched and
    its budget is what the family keeps beside the peak."""
    llm = _llm(checkpoints(family))
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
    # Qwen2-VL / Qwen2.5-VL: a video is one item, 63 frame groups of 8 x 8 merged tokens (its
    # frames at most the video settings' 64 tokens, the preprocessor config's) fill 4,095
    # tokens; at 30 it is one frame group, which the image covers. Qwen3-VL: a frame group
    # an item.
    video = ([((63 * 256, patch_dim), [(63, 16, 16)])]
             if family in ("qwen2_vl", "qwen2_5_vl") else [])
    assert grids == [((256, patch_dim), [(1, 16, 16)]), *video,
                     ((100, patch_dim), [(1, 10, 10)])]
    assert state.encoder_runs == 0 and not state._cache
    ids, images = CASES["one_image"]()  # the engine serves as before
    assert _generate(llm, ids, images) == _generate(_llm(checkpoints(family)), ids, images)


@pytest.mark.parametrize(("name", "family"), [("Qwen2.5-VL-7B", "qwen2_5_vl"),
                                            ("Qwen3-VL-8B", "qwen3_vl")])
def test_bundled_configs(name: str, family: str) -> None:
    """The bench's bundled configs of the released models: our model has HF's parameter count
    (built on the meta device), and the released image processor config loads (its PIL
    backend without torchvision) with patch rows of the tower's size (14 or 16 pixels)."""
    from mrv2.bench.measure import CONFIGS
    from mrv2.registry import import_object
    from mrv2_qwen_vl.plugin import mrv2_register_models
    from mrv2_qwen_vl.processor import load_image_processor

    config = transformers.AutoConfig.from_pretrained(CONFIGS / name)
    registered: dict[str, str] = {}
    mrv2_register_models(lambda arch, model, **_: registered.setdefault(arch, model))
    with torch.device("meta"):
        ours = import_object(registered[config.architectures[0]])(config)
        hf = FAMILIES[family][1](config)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    processor = load_image_processor(CONFIGS / name)
    out = processor(images=[_image(384, 512, 0)], return_tensors="pt")
    vision = config.vision_config
    t, h, w = out["image_grid_thw"][0].tolist()
    assert out["pixel_values"].shape == (t * h * w, 3 * 2 * vision.patch_size**2)
    # 384 x 512 pixels rounded to whole merged patches: 28 (392 x 504) or 32 pixels (as is)
    assert (h * vision.patch_size, w * vision.patch_size) == {
        "qwen2_5_vl": (392, 504), "qwen3_vl": (384, 512)}[family]


def test_bad_multimodal_inputs_name_the_field(checkpoint: Path, tmp_path: Path) -> None:
    llm = _llm(checkpoint)
    ids, images = CASES["one_image"]()
    bad: list[tuple[dict[str, Any], str]] = [
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": images * 2}},
         "multi_modal_data.image: 2 images but the prompt has 1"),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": images, "audio": images}},
         "unsupported keys \\['audio'\\]; allowed: 'image', 'video'"),
        ({"prompt_token_ids": ids, "multi_modal_data": {"image": ["not an image"]}},
         "multi_modal_data.image: could not process"),
        ({"prompt_token_ids": ids, "multi_modal_data": ["x"]}, "multi_modal_data must be"),
    ]
    for prompt, message in bad:
        with pytest.raises(ValueError, match=message):
            llm.generate([prompt, {"prompt_token_ids": [5, 6]}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()  # nothing of the batch was queued
    # an item of the low-level API whose grid does not give its placeholder count: refused
    # by add_request, before it is queued (it failed the step of every request in it before)
    processor = llm.engine.input_processor
    assert processor is not None
    expanded, items = processor.process(ids, {"image": images})
    wrong = dataclasses.replace(items[0], data={**items[0].data, "grid_thw": (1, 4, 4)})
    with pytest.raises(ValueError, match="request 'odd': an image of grid \\(1, 4, 4\\)"):
        llm.engine.add_request(expanded, GREEDY, request_id="odd", mm_items=[wrong])
    assert not llm.engine.has_unfinished()
    assert _generate(llm, ids, images) == _generate(_llm(checkpoint), ids, images)
    text_model = make_tiny_checkpoint(tmp_path / "text", "Qwen3ForCausalLM")
    with pytest.raises(ValueError, match="multi_modal_data: Qwen3ForCausalLM takes text only"):
        LLM(str(text_model), device="cpu").generate(
            [{"prompt_token_ids": [1, 2], "multi_modal_data": {"image": images}}], GREEDY)


def _data_uri(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_chat_with_image_parts(checkpoint: Path) -> None:
    """``LLM.chat`` with a PIL image part and an OpenAI ``image_url`` data URI part gives the
    tokens of ``generate`` on the template's token ids with the same images; over the limit,
    undecodable data and remote URLs are refused naming the part."""
    llm = _llm(checkpoint, limit_mm_per_prompt=2)
    a, b = _image(56, 84, 0), _image(84, 56, 3)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Hello "}, {"type": "image", "image": a},
        {"type": "text", "text": " world "},
        {"type": "image_url", "image_url": {"url": _data_uri(b)}}]}]
    got = llm.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "Hello "}, {"type": "image"}, {"type": "text", "text": " world "},
        {"type": "image"}]}])
    assert ids.count(IMAGE) == 2 and ids.count(START) == 2
    assert got == _generate(llm, ids, [a, b])
    over = [{"role": "user", "content": [{"type": "image", "image": a}] * 3}]
    with pytest.raises(ValueError, match=re.escape(  # (refused before it is decoded)
            "messages[0].content[2]: more than 2 images; at most 2 per prompt")):
        llm.chat(over, GREEDY, use_tqdm=False)
    for url, message in [("data:image/png;base64,AAAA", "could not decode"),
                         ("https://example.com/cat.png", "remote URLs are not fetched"),
                         ("file:///etc/passwd", "file:// URLs are not read"),
                         ("ftp://example.com/cat.png", "unsupported URL")]:
        bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        where = re.escape("messages[0].content[0].image_url: ")
        with pytest.raises(ValueError, match=where + message):
            llm.chat(bad, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_openai_client_sends_a_data_uri_image(checkpoint: Path, engine_process: bool) -> None:
    """``mrv2 serve``'s chat endpoint with an OpenAI ``image_url`` data URI part: the reply is
    ``LLM.chat``'s; a bad image, too many images and a remote URL get a 400 naming the
    messages and the server keeps serving. With the engine in a process of its own
    (``--engine-process``) the image is preprocessed there and the answers are the same."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from mrv2 import EngineConfig
    from mrv2.engine.engine import LLMEngine
    from mrv2.entrypoints.server import create_app
    from mrv2.testing import serve_in_thread

    kwargs = {"device": "cpu", "dtype": "float32", "block_size": 4, "limit_mm_per_prompt": 1}
    config = EngineConfig.from_kwargs(model=str(checkpoint), **kwargs)
    engine: Any
    if engine_process:
        from mrv2.entrypoints.engine_process import RemoteEngine

        engine = RemoteEngine(config)
    else:
        engine = LLMEngine(config)
    image = _image(56, 84, 0)
    content = [{"type": "text", "text": "Hello "},
               {"type": "image_url", "image_url": {"url": _data_uri(image)}}]
    want = _llm(checkpoint).chat([{"role": "user", "content": content}], GREEDY,
                                 use_tqdm=False)[0].outputs[0].token_ids
    for url in serve_in_thread(create_app(engine, served_model_name="tiny-vl")):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)

        def ask(parts: list[dict[str, Any]], client: Any = client) -> Any:
            return client.chat.completions.create(
                model="tiny-vl", messages=[{"role": "user", "content": parts}], max_tokens=8,
                temperature=0, extra_body={"ignore_eos": True})

        out = ask(content)
        tokenizer = engine.tokenizer
        assert tokenizer is not None
        assert out.usage.completion_tokens == 8
        assert out.choices[0].message.content == tokenizer.decode(want)
        bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
        for parts, message in [(bad, "could not decode"), (content + content[1:], "at most 1"),
                               ([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                                "remote URLs are not fetched")]:
            with pytest.raises(openai.BadRequestError, match=message) as caught:
                ask(parts)
            assert caught.value.status_code == 400
        assert ask(content).choices[0].message.content == out.choices[0].message.content
    engine.shutdown()


def test_the_responses_api_takes_an_image(checkpoint: Path) -> None:
    """``/v1/responses`` with an ``input_image`` part (a data URI): the answer is the chat
    route's for the same image and text; a bad image is a 400 naming ``input``."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from mrv2 import EngineConfig
    from mrv2.engine.engine import LLMEngine
    from mrv2.entrypoints.server import create_app
    from mrv2.testing import serve_in_thread

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(checkpoint), device="cpu",
                                                dtype="float32", block_size=4))
    uri = _data_uri(_image(56, 84, 1))
    for url in serve_in_thread(create_app(engine, served_model_name="tiny-vl")):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        chat_parts = [{"type": "text", "text": "Hello "},
                      {"type": "image_url", "image_url": {"url": uri}}]
        chat = client.chat.completions.create(
            model="tiny-vl", max_tokens=6, temperature=0,
            messages=[{"role": "user", "content": chat_parts}])
        parts = [{"type": "input_text", "text": "Hello "},
                 {"type": "input_image", "image_url": uri}]
        response = client.responses.create(model="tiny-vl", max_output_tokens=6,
                                           temperature=0,
                                           input=[{"role": "user", "content": parts}])
        assert response.output_text == chat.choices[0].message.content
        assert response.usage.input_tokens == chat.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError, match="could not decode") as caught:
            client.responses.create(model="tiny-vl", max_output_tokens=2, input=[
                {"role": "user", "content": [{"type": "input_image",
                                              "image_url": "data:image/png;base64,AAAA"}]}])
        assert caught.value.body["param"] == "input"  # type: ignore[index]


def test_the_byte_floor_leaves_the_vision_tower_out(checkpoint: Path) -> None:
    """A text step reads the language model and the LM head, not the vision tower (run per
    image): the floor's weight bytes and the roofline's FLOPs count the text model alone."""
    from mrv2 import EngineConfig
    from mrv2.bench.measure import linear_flops, weight_bytes
    from mrv2.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(checkpoint), device="cpu",
                                                dtype="float32", block_size=4))
    model = engine.runner.model
    tower = {id(p) for p in model.visual.parameters()}
    assert tower
    text = [p for p in model.parameters() if id(p) not in tower]
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    table = 0 if tied else model.model.embed_tokens.weight.numel() * 4
    assert weight_bytes(engine.runner) == sum(p.numel() * 4 for p in text) - table
    with_tower = sum(p.numel() for p in model.visual.parameters() if p.dim() >= 2)
    model.media_encoders = ()  # (the old count, for the difference)
    flops_all = linear_flops(engine.runner)[0]
    del model.media_encoders
    assert flops_all - linear_flops(engine.runner)[0] == 2 * with_tower
    engine.shutdown()


def test_bench_multimodal_runs(checkpoint: Path) -> None:
    """``mrv2 bench multimodal`` on the tiny model (CPU): every row reported."""
    from mrv2.bench.multimodal import bench
    from mrv2.entrypoints.cli import build_parser

    args = build_parser().parse_args([
        "bench", "multimodal", "--model", str(checkpoint), "--device", "cpu", "--dtype",
        "float32", "--load-format", "auto", "--batch-sizes", "1", "2", "--image-size", "56",
        "--prompt-len", "6", "--new-tokens", "3", "--max-model-len", "256"])
    results = bench(args)
    assert results["encoder_ms_per_image"] > 0
    assert [r["batch"] for r in results["with_image"]] == [1, 2]
    assert all(r["images_per_s"] > 0 and r["tpot_ms"] > 0 for r in results["with_image"])
    assert [r["batch"] for r in results["text_only"]] == [1, 2]


def test_qwen3_vl_moe_loads_the_published_expert_layout(checkpoints: Callable[[str], Path],
                                                        tmp_path: Path) -> None:
    """The released Qwen3-VL-MoE checkpoints keep each layer's experts stacked and transposed
    (``gate_up_proj`` ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``); transformers saves them
    untransposed. Both give the same tokens and log-probabilities."""
    import shutil

    from safetensors.torch import load_file, save_file

    saved = checkpoints("qwen3_vl_moe")
    published = tmp_path / "published"
    shutil.copytree(saved, published)
    tensors = load_file(saved / "model.safetensors")
    moved = 0
    for name in list(tensors):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
            moved += 1
    assert moved == 4  # two sparse layers, two stacks each
    save_file(tensors, published / "model.safetensors", metadata={"format": "pt"})
    ids, images = CASES[sorted(CASES)[0]]()
    prompt: dict[str, Any] = {"prompt_token_ids": ids}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    outs = [_llm(path).generate([prompt], params, use_tqdm=False)[0]
            for path in (saved, published)]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    for a, b in zip(outs[0].prompt_logprobs[1:], outs[1].prompt_logprobs[1:], strict=True):
        assert a is not None and b is not None
        assert {t: round(p.logprob, 4) for t, p in a.items()} == {
            t: round(p.logprob, 4) for t, p in b.items()}
