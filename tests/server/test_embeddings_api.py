"""``POST /v1/embeddings`` through the official client: each input's vector is
``LLM.embed``'s (texts, token ids, ``dimensions``, float and base64 encodings), with the engine
in this process and in its own; bad inputs are a 400 naming the field."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from server_util import API_KEY, ENGINE_KWARGS, MODEL, Served

from mrv2 import LLM, EngineConfig, PoolingParams
from mrv2.testing import serve_in_thread

openai = pytest.importorskip("openai")

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEXTS = ["Hello world", "The capital of France is"]


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> LLM:
    return LLM(str(model_dir), **{k: v for k, v in ENGINE_KWARGS.items()
                                  if k not in ("num_gpu_blocks_override", "max_num_seqs")})


def _want(reference: LLM, inputs: list[Any], dimensions: int | None = None
          ) -> list[list[float]]:
    tokenizer = reference.get_tokenizer()
    prompts = [{"prompt_token_ids": tokenizer.encode(x) if isinstance(x, str) else x}
               for x in inputs]
    outs = reference.embed(prompts, PoolingParams(dimensions=dimensions), use_tqdm=False)
    return [o.outputs.embedding for o in outs]


def _counters(url: str) -> tuple[float, float]:
    """``/metrics``' prompt and generation token totals."""
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=60).text
    values = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines()
              if line.startswith(("mrv2_prompt_tokens_total", "mrv2_generation_tokens_total"))}
    return values["mrv2_prompt_tokens_total"], values["mrv2_generation_tokens_total"]


def _check(url: str, reference: LLM) -> None:
    prompt_before, generated_before = _counters(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    got = client.embeddings.create(model=MODEL, input=TEXTS)  # (the client asks base64)
    assert [d.index for d in got.data] == [0, 1]
    want = _want(reference, TEXTS)
    for d, w in zip(got.data, want, strict=True):
        np.testing.assert_allclose(d.embedding, w, rtol=1e-5, atol=1e-6)
    assert got.usage.prompt_tokens == sum(len(reference.get_tokenizer().encode(t))
                                          for t in TEXTS)
    ids = [5, 9, 3, 17]
    short = client.embeddings.create(model=MODEL, input=ids, dimensions=8,
                                     encoding_format="float")
    np.testing.assert_allclose(short.data[0].embedding, _want(reference, [ids], 8)[0],
                               rtol=1e-5, atol=1e-6)
    # as vLLM's, an input may fill the context (max_model_len 64 tokens)
    full = [1 + (3 * i) % 300 for i in range(64)]
    whole = client.embeddings.create(model=MODEL, input=full, encoding_format="float")
    np.testing.assert_allclose(whole.data[0].embedding, _want(reference, [full])[0],
                               rtol=1e-5, atol=1e-6)
    # embeddings read prompts and generate nothing (their one sampled token is the engine's)
    prompt_after, generated_after = _counters(url)
    assert generated_after == generated_before
    assert prompt_after - prompt_before == got.usage.prompt_tokens + len(ids) + len(full)


def test_embeddings_are_the_engines(server: Served, reference: LLM) -> None:
    _check(server.url, reference)


def test_embeddings_through_the_engine_process(model_dir: Path, reference: LLM) -> None:
    from mrv2.entrypoints.engine_process import RemoteEngine
    from mrv2.entrypoints.server import create_app

    engine = RemoteEngine(EngineConfig.from_kwargs(model=str(model_dir), **ENGINE_KWARGS))
    try:
        for url in serve_in_thread(create_app(engine, served_model_name=MODEL,
                                              api_key=API_KEY)):
            _check(url, reference)
    finally:
        engine.shutdown()


def test_base64_is_little_endian_float32(server: Served, reference: LLM) -> None:
    body = {"model": MODEL, "input": "Hello world", "encoding_format": "base64"}
    data = httpx.post(f"{server.url}/v1/embeddings", json=body, headers=AUTH,
                      timeout=60).json()["data"]
    vector = np.frombuffer(base64.b64decode(data[0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, _want(reference, ["Hello world"])[0], rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": [""]}, "input"),
    ({"input": "x", "dimensions": 10_000}, "dimensions"),
    ({"input": "x", "dimensions": 0}, "dimensions"),
    ({"input": [[5, 100_000]]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_inputs_name_the_field(server: Served, body: dict[str, Any], param: str) -> None:
    response = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, **body},
                          headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_dimensions_need_a_matryoshka_model(model_dir: Path) -> None:
    """As vLLM's: a model whose config.json says nothing of Matryoshka embeddings refuses
    ``dimensions`` (/v1/embeddings and /pooling), a 400 naming the field."""
    from conftest import serve

    for served in serve(model_dir, {"hf_overrides": {"is_matryoshka": False}}):
        for route in ("/v1/embeddings", "/pooling"):
            response = httpx.post(f"{served.url}{route}", headers=AUTH, timeout=60,
                                  json={"model": MODEL, "input": "x", "dimensions": 8})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "dimensions" and "Matryoshka" in error["message"]


def _sentence_transformers_checkpoint(path: Path, mean: bool) -> None:
    """A tiny Llama with a tokenizer and sentence-transformers modules: a Transformer and a
    Pooling module of the mean of the tokens (``mean``) or the last token's state."""
    import json

    from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

    make_tiny_checkpoint(path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(path)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": mean, "pooling_mode_lasttoken": not mean}))


def test_a_mean_pooled_model_is_refused_embeddings(tmp_path: Path) -> None:
    """A sentence-transformers checkpoint that pools by the tokens' mean (modules.json) gets
    a 400 saying so, not the last token's state, through the engine's own process too."""
    from mrv2.entrypoints.engine_process import RemoteEngine
    from mrv2.entrypoints.server import create_app

    _sentence_transformers_checkpoint(tmp_path, mean=True)
    engine = RemoteEngine(EngineConfig.from_kwargs(model=str(tmp_path), **ENGINE_KWARGS))
    try:
        for url in serve_in_thread(create_app(engine, served_model_name=MODEL,
                                              api_key=API_KEY)):
            response = httpx.post(f"{url}/v1/embeddings", headers=AUTH, timeout=60,
                                  json={"model": MODEL, "input": "x"})
            assert response.status_code == 400, response.text
            assert "pooling_mode_mean_tokens" in response.json()["error"]["message"]
    finally:
        engine.shutdown()


def test_without_a_normalize_module_vectors_are_raw(tmp_path: Path) -> None:
    """A last-token sentence-transformers checkpoint without a Normalize module answers its
    raw states unless the request asks ``normalize`` (vLLM's default from modules.json),
    through the engine's own process."""
    from mrv2.entrypoints.engine_process import RemoteEngine
    from mrv2.entrypoints.server import create_app

    _sentence_transformers_checkpoint(tmp_path, mean=False)
    ids = [5, 9, 3, 17]
    want = LLM(str(tmp_path), **{k: v for k, v in ENGINE_KWARGS.items() if k not in (
        "num_gpu_blocks_override", "max_num_seqs")}).embed(
        {"prompt_token_ids": ids}, PoolingParams(normalize=False), use_tqdm=False)
    raw = np.asarray(want[0].outputs.embedding)
    assert abs(np.linalg.norm(raw) - 1) > 0.1
    engine = RemoteEngine(EngineConfig.from_kwargs(model=str(tmp_path), **ENGINE_KWARGS))
    try:
        for url in serve_in_thread(create_app(engine, served_model_name=MODEL,
                                              api_key=API_KEY)):
            for body, vector in [({}, raw), ({"normalize": True}, raw / np.linalg.norm(raw))]:
                got = httpx.post(f"{url}/v1/embeddings", headers=AUTH, timeout=60,
                                 json={"model": MODEL, "input": ids,
                                       "encoding_format": "float", **body}).json()
                np.testing.assert_allclose(got["data"][0]["embedding"], vector, rtol=1e-5,
                                           atol=1e-6)
    finally:
        engine.shutdown()


def test_a_pooling_server_refuses_generation(model_dir: Path, reference: LLM) -> None:
    from conftest import serve

    for served in serve(model_dir, {"runner": "pooling"}):
        _check(served.url, reference)
        response = httpx.post(f"{served.url}/v1/completions", headers=AUTH, timeout=60,
                              json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert response.status_code == 400
        assert "runner='pooling'" in response.json()["error"]["message"]


def test_chat_messages_embed_the_templated_chat(server: Served, reference: LLM) -> None:
    """vLLM's chat form of ``/v1/embeddings`` and ``/pooling``: ``messages`` through the
    chat template (no generation prompt, no special tokens on top by default), embedded as
    one prompt; ``input`` and ``messages`` together, or neither, is a 400 naming them."""
    from mrv2.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(server.model_dir)
    messages = [{"role": "user", "content": "Hello world!"}]
    for extra, prompted in [({}, False), ({"add_generation_prompt": True}, True)]:
        ids = tok.apply_chat_template(messages, prompted)
        want = _want(reference, [ids])[0]
        for route, key in [("/v1/embeddings", "embedding"), ("/pooling", "data")]:
            answer = httpx.post(f"{server.url}{route}", headers=AUTH, timeout=60, json={
                "model": MODEL, "messages": messages, "encoding_format": "float",
                **extra}).json()
            np.testing.assert_allclose(answer["data"][0][key], want, rtol=1e-5, atol=1e-6)
            assert answer["usage"]["prompt_tokens"] == len(ids)
    for body in ({"input": "x", "messages": messages}, {}):
        response = httpx.post(f"{server.url}/v1/embeddings", headers=AUTH, timeout=60,
                              json={"model": MODEL, **body})
        assert response.status_code == 400, response.text
        assert "either input" in response.json()["error"]["message"]
    media = [{"role": "user", "content": [{"type": "image_url",
                                           "image_url": {"url": "data:image/png;base64,"}}]}]
    response = httpx.post(f"{server.url}/v1/embeddings", headers=AUTH, timeout=60,
                          json={"model": MODEL, "messages": media})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_use_activation_is_normalize(server: Served, reference: LLM) -> None:
    """vLLM's newer name of ``normalize`` (/v1/embeddings, /pooling): ``use_activation:
    false`` answers the raw state; disagreeing with ``normalize`` is a 400 naming it."""
    ids = [5, 9, 3, 17]
    raw = reference.embed({"prompt_token_ids": ids}, PoolingParams(normalize=False),
                          use_tqdm=False)[0].outputs.embedding
    assert abs(np.linalg.norm(raw) - 1) > 0.1
    for route, key in [("/v1/embeddings", "embedding"), ("/pooling", "data")]:
        got = httpx.post(f"{server.url}{route}", headers=AUTH, timeout=60, json={
            "model": MODEL, "input": ids, "encoding_format": "float",
            "use_activation": False}).json()["data"][0][key]
        np.testing.assert_allclose(got, raw, rtol=1e-5, atol=1e-6)
        response = httpx.post(f"{server.url}{route}", headers=AUTH, timeout=60, json={
            "model": MODEL, "input": ids, "use_activation": False, "normalize": True})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "use_activation"


def test_add_special_tokens(tmp_path: Path) -> None:
    """A text input gets the tokenizer's special tokens (its BOS) unless the request says
    ``add_special_tokens: false`` (vLLM's field of /v1/embeddings, /classify, /pooling);
    a chat's are the template's, none on top unless asked."""
    import transformers
    from tokenizers import processors

    from conftest import serve
    from mrv2.engine.tokenizer import Tokenizer
    from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

    make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    bos = int(hf.convert_tokens_to_ids("<s>"))  # type: ignore[arg-type]  # (one token)
    hf.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)])
    hf.save_pretrained(str(tmp_path))
    text = "Hello world!"
    bare = hf(text, add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": text}]
    chat = Tokenizer.from_pretrained(tmp_path).apply_chat_template(messages, False)
    llm = LLM(str(tmp_path), **{k: v for k, v in ENGINE_KWARGS.items()
                                if k not in ("num_gpu_blocks_override", "max_num_seqs")})
    cases: list[tuple[dict[str, Any], list[int]]] = [
        ({"input": text}, [bos, *bare]),
        ({"input": text, "add_special_tokens": False}, bare),
        ({"messages": messages}, chat),
        ({"messages": messages, "add_special_tokens": True}, [bos, *chat])]
    for served in serve(tmp_path):
        for body, ids in cases:
            want = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs.embedding
            got = httpx.post(f"{served.url}/v1/embeddings", headers=AUTH, timeout=60, json={
                "model": MODEL, "encoding_format": "float", **body}).json()
            assert got["usage"]["prompt_tokens"] == len(ids), body
            np.testing.assert_allclose(got["data"][0]["embedding"], want, rtol=1e-5,
                                       atol=1e-6)
