"""vLLM's engine arguments that scripts pass (``mrv2 serve --max-logprobs 50``,
``LLM(kv_cache_memory_bytes=...)``): each parses, reaches the config and has its effect, or is
refused naming the field and the values mrv2 takes."""

from __future__ import annotations

import argparse
import base64
import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.config import CacheConfig, EngineConfig
from mrv2.config_cli import add_cli_args, config_from_cli
from mrv2.testing import emulate_cuda_graphs, make_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("flags"), "Qwen3ForCausalLM")


def _llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, max_num_seqs=4,
               max_model_len=64, **kwargs)


def _cli(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return config_from_cli(parser.parse_args(list(argv)), None)


def test_vllm_engine_flags_parse(tmp_path: Path) -> None:
    config = _cli(
        "--max-logprobs", "50", "--logprobs-mode", "raw_logits", "--kv-cache-memory-bytes",
        "8G", "--cuda-graph-sizes", "1", "2", "8", "--max-seq-len-to-capture", "8192",
        "--tokenizer-mode", "slow", "--revision", "main", "--tokenizer-revision", "v1",
        "--code-revision", "c1", "--download-dir", str(tmp_path), "--trust-remote-code",
        "--mm-processor-kwargs", '{"max_pixels": 1003520}',
        "--allowed-local-media-path", str(tmp_path), "--disable-custom-all-reduce",
        "--swap-space", "4", "--cpu-offload-gb", "0", "--no-calculate-kv-scales")
    model = config.model
    assert (model.max_logprobs, model.logprobs_mode, model.tokenizer_mode) == (
        50, "raw_logits", "slow")
    assert (model.revision, model.tokenizer_revision, model.code_revision) == ("main", "v1", "c1")
    assert model.download_dir == str(tmp_path) and model.trust_remote_code
    assert config.cache.kv_cache_memory_bytes == 8 << 30
    assert config.device.cuda_graph_sizes == [1, 2, 8]
    assert config.device.max_seq_len_to_capture == 8192
    assert config.multimodal.mm_processor_kwargs == {"max_pixels": 1003520}
    assert config.multimodal.allowed_local_media_path == str(tmp_path.resolve())
    assert config.parallel.disable_custom_all_reduce
    assert _cli("--cuda-graph-sizes", "256").device.cuda_graph_sizes == [256]
    defaults = EngineConfig()
    assert defaults.model.max_logprobs == 20 and defaults.model.logprobs_mode == "raw_logprobs"


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"logprobs_mode": "processed_logprobs"}, r"logprobs_mode='processed_logprobs' is not "
     r"supported.*allowed: 'raw_logprobs', 'raw_logits'"),
    ({"logprobs_mode": "raw"}, r"allowed: 'raw_logprobs', 'raw_logits'"),
    ({"tokenizer_mode": "mistral"}, r"tokenizer_mode='mistral' is not supported.*allowed: "
     r"'auto', 'hf', 'slow'"),
    ({"tokenizer_mode": "custom"}, r"allowed: 'auto', 'hf', 'slow'"),
    ({"cpu_offload_gb": 1.5}, r"cpu_offload_gb=1.5 is not supported.*allowed: 0"),
    ({"calculate_kv_scales": True}, r"calculate_kv_scales=True is not supported"),
    ({"max_logprobs": -2}, r"(?s)max_logprobs.*greater than or equal to -1"),
    ({"kv_cache_memory_bytes": 0}, r"(?s)kv_cache_memory_bytes.*greater than or equal to 1"),
    ({"cuda_graph_sizes": [4, 0]}, r"(?s)cuda_graph_sizes.*batch sizes >= 1"),
    ({"allowed_local_media_path": "/no/such/dir"}, r"is not a directory"),
])
def test_refused_values_name_the_field(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        EngineConfig.from_kwargs(**kwargs)


def test_max_logprobs_bounds_requests(model: Path) -> None:
    """vLLM's ``max_logprobs``: a request asking more logprobs (or prompt logprobs) than it
    is refused naming the field; up to it they are returned (20 was a fixed ceiling)."""
    prompt = {"prompt_token_ids": [5, 6, 7]}
    llm = _llm(model, max_logprobs=30)
    out = llm.generate([prompt], SamplingParams(max_tokens=2, logprobs=25, prompt_logprobs=30,
                                                temperature=0.0), use_tqdm=False)[0]
    assert all(len(position) >= 25 for position in out.outputs[0].logprobs)
    assert all(len(p) >= 30 for p in out.prompt_logprobs[1:])
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=31 .*max_logprobs"):
            llm.generate([prompt], SamplingParams(max_tokens=2, **{field: 31}), use_tqdm=False)
    llm.shutdown()
    llm = _llm(model)  # the default: vLLM's 20
    with pytest.raises(ValueError, match=r"SamplingParams\.logprobs=21 .*\[0, 20\]"):
        llm.generate([prompt], SamplingParams(max_tokens=2, logprobs=21), use_tqdm=False)
    llm.shutdown()
    llm = _llm(model, max_logprobs=-1)  # the whole vocabulary
    vocab = llm.engine.runner.vocab_size
    out = llm.generate([prompt], SamplingParams(max_tokens=1, logprobs=vocab), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) == vocab
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate([prompt], SamplingParams(max_tokens=1, logprobs=vocab + 1), use_tqdm=False)
    llm.shutdown()


def test_logprobs_mode_raw_logits(model: Path) -> None:
    """``raw_logits``: the model's logits at the same ids and ranks as raw_logprobs' values,
    which are those logits less the row's logsumexp."""
    prompt = {"prompt_token_ids": [5, 17, 42]}
    params = SamplingParams(max_tokens=4, logprobs=5, temperature=0.0)
    runs = []
    for mode in ("raw_logprobs", "raw_logits"):
        llm = _llm(model, logprobs_mode=mode)
        runs.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0])
        llm.shutdown()
    logprobs, logits = runs
    assert logprobs.token_ids == logits.token_ids
    for lp, lg in zip(logprobs.logprobs, logits.logprobs, strict=True):
        assert lp.keys() == lg.keys()
        assert all(lp[t].rank == lg[t].rank for t in lp)
        shifts = [lg[t].logprob - lp[t].logprob for t in lp]
        assert max(shifts) - min(shifts) < 1e-4  # one logsumexp a row
        assert shifts[0] > 1e-3  # (a logsumexp over 1000s of tokens: never 0)
        assert sum(math.exp(lp[t].logprob) for t in lp) <= 1 + 1e-5


def test_beam_search_refuses_raw_logits(model: Path) -> None:
    from mrv2.engine.beam_search import BeamSearchParams

    llm = _llm(model, logprobs_mode="raw_logits")
    with pytest.raises(ValueError, match="beam search needs logprobs_mode='raw_logprobs'"):
        llm.beam_search([{"prompt_token_ids": [5, 6]}], BeamSearchParams(beam_width=2,
                                                                          max_tokens=2))
    llm.shutdown()


def test_kv_cache_memory_bytes_sizes_the_cache(model: Path) -> None:
    from mrv2.runner.kv_cache import num_blocks_for

    cache = CacheConfig(kv_cache_memory_bytes=10_000)
    assert num_blocks_for(cache, 1000, torch.device("cpu")) == 10
    llm = _llm(model)
    runner = llm.engine.runner
    per_block = runner.kv.bytes_per_block(runner.block_size, runner.dtype)
    llm.shutdown()
    llm = _llm(model, kv_cache_memory_bytes=per_block * 37 + 5)
    assert llm.engine.block_manager.num_blocks == 37
    llm.shutdown()
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):  # the setting to raise
        _llm(model, kv_cache_memory_bytes=per_block * 2)


def test_cuda_graph_sizes_choose_the_decode_graphs(model: Path) -> None:
    from mrv2.runner.cuda_graphs import capture_sizes

    assert capture_sizes(256) == capture_sizes(256, sizes=[512])
    assert capture_sizes(512, sizes=[16]) == [1, 2, 4, 8, 16]
    assert capture_sizes(8, sizes=[1, 3, 6, 32]) == [1, 3, 6]  # (past max_num_seqs: dropped)
    llm = _llm(model, cuda_graph_sizes=[1, 3])
    emulate_cuda_graphs(llm.engine.runner)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.plan[1] == [1, 3]
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(4)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    eager = _llm(model)
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params,
                                                                  use_tqdm=False)]
    eager.shutdown()


def test_tokenizer_mode_and_trust_remote_code_reach_the_tokenizer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from mrv2.engine.request_inputs import _load_tokenizer, tokenizer_kwargs
    from mrv2.testing import make_tiny_tokenizer

    make_tiny_tokenizer(tmp_path)
    seen: list[dict[str, Any]] = []
    original = transformers.AutoTokenizer.from_pretrained

    def recorded(*args: Any, **kwargs: Any) -> Any:
        seen.append(dict(kwargs))
        kwargs.pop("trust_remote_code", None)  # (no remote code in the tiny tokenizer)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", recorded)
    config = EngineConfig.from_kwargs(tokenizer_mode="slow", trust_remote_code=True)
    assert tokenizer_kwargs(config.model) == {"use_fast": False, "trust_remote_code": True}
    assert tokenizer_kwargs(EngineConfig().model) == {}
    assert _load_tokenizer(str(tmp_path), kwargs=tokenizer_kwargs(config.model)) is not None
    assert seen[-1]["use_fast"] is False and seen[-1]["trust_remote_code"] is True


def _png_bytes() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_allowed_local_media_path(tmp_path: Path) -> None:
    from mrv2.engine.media import load_image_url, split_chat_media

    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(_png_bytes())
    (tmp_path / "outside.png").write_bytes(_png_bytes())
    (root / "link.png").symlink_to(tmp_path / "outside.png")
    allowed = EngineConfig.from_kwargs(
        allowed_local_media_path=str(root)).multimodal.allowed_local_media_path
    assert allowed == str(root.resolve())
    assert load_image_url(f"file://{root}/a.png", local_root=allowed).size == (8, 6)
    for url in (f"file://{tmp_path}/outside.png", f"file://{root}/../outside.png",
                f"file://{root}/link.png"):
        with pytest.raises(ValueError, match="not under the allowed local media path"):
            load_image_url(url, local_root=allowed)
    with pytest.raises(ValueError, match="could not read"):
        load_image_url(f"file://{root}/missing.png", local_root=allowed)
    with pytest.raises(ValueError, match="--allowed-local-media-path"):  # (off by default)
        load_image_url(f"file://{root}/a.png")
    message = {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"file://{root}/a.png"}},
        {"type": "text", "text": "what is it?"}]}
    _, data = split_chat_media([message], local_root=allowed)
    assert [image.size for image in data["image"]] == [(8, 6)]
    data_uri = "data:image/png;base64," + base64.b64encode(_png_bytes()).decode()
    assert load_image_url(data_uri, local_root=allowed).size == (8, 6)


def test_mm_processor_kwargs_refused_for_a_text_model(model: Path) -> None:
    with pytest.raises(ValueError, match="mm_processor_kwargs=.*takes text only"):
        _llm(model, mm_processor_kwargs={"max_pixels": 1000})
    llm = _llm(model, disable_custom_all_reduce=True, revision="main", download_dir="/tmp",
               max_seq_len_to_capture=16)  # accepted: no effect on a local CPU engine
    assert llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=1),
                        use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
