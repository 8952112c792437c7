"""vLLM's pooling routes for classifiers and scoring: ``/classify``, ``/score`` and ``/rerank``
give ``LLM.classify``'s and ``LLM.score``'s numbers (a sequence classifier, a one-label
reranker, an embedding model), with the engine in this process and in its own; bad requests
are a 400 naming the field."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from server_util import API_KEY, ENGINE_KWARGS, MODEL, Served

from mrv2 import LLM, EngineConfig
from mrv2.testing import make_tiny_checkpoint, serve_in_thread

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
DOCS = [[5, 17, 99, 3], [1 + i % 200 for i in range(23)], [64, 9], [7, 7, 7]]
QUERY = [11, 12, 13]
KWARGS = {k: v for k, v in ENGINE_KWARGS.items() if k != "num_gpu_blocks_override"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("scoring")
    return {
        "classifier": make_tiny_checkpoint(root / "cls", "Qwen3ForSequenceClassification",
                                           seed=4, id2label=LABELS,
                                           label2id={v: k for k, v in LABELS.items()}),
        "reranker": make_tiny_checkpoint(root / "rerank", "Qwen3ForSequenceClassification",
                                         seed=5, num_labels=1),
    }


@pytest.fixture(scope="module")
def reference_llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), **{k: v for k, v in KWARGS.items() if k != "max_num_seqs"})


def _serve(path: Path) -> Iterator[str]:
    from conftest import serve

    for served in serve(path):
        yield served.url


def _post(url: str, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{route}", json={"model": MODEL, **body}, headers=AUTH, timeout=60)


def test_classify_gives_the_engines_probabilities(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["classifier"]
    want = LLM(str(path), **KWARGS).classify(
        [{"prompt_token_ids": d} for d in DOCS], use_tqdm=False)
    for url in _serve(path):
        answer = _post(url, "/classify", {"input": DOCS}).json()
        assert answer["object"] == "list" and answer["model"] == MODEL
        assert answer["usage"]["prompt_tokens"] == sum(map(len, DOCS))
        for item, w in zip(answer["data"], want, strict=True):
            assert item["probs"] == pytest.approx(w.outputs.probs, rel=1e-5, abs=1e-6)
            best = max(range(3), key=w.outputs.probs.__getitem__)
            assert item["label"] == LABELS[best] and item["num_classes"] == 3
        response = _post(url, "/score", {"text_1": QUERY, "text_2": DOCS})
        assert response.status_code == 400
        assert "num_labels=3" in response.json()["error"]["message"]


def test_score_and_rerank_give_the_rerankers_scores(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["reranker"]
    want = [o.outputs.score for o in LLM(str(path), **KWARGS).score(
        {"prompt_token_ids": QUERY}, [{"prompt_token_ids": d} for d in DOCS], use_tqdm=False)]
    assert len(set(want)) == len(DOCS)
    for url in _serve(path):
        for route in ("/score", "/v1/score"):
            data = _post(url, route, {"text_1": QUERY, "text_2": DOCS}).json()["data"]
            assert [d["index"] for d in data] == list(range(len(DOCS)))
            assert [d["score"] for d in data] == pytest.approx(want, rel=1e-5, abs=1e-6)
        for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
            answer = _post(url, route, {"query": QUERY, "documents": DOCS, "top_n": 2}).json()
            order = sorted(range(len(DOCS)), key=lambda i: -want[i])[:2]
            assert [r["index"] for r in answer["results"]] == order
            assert [r["relevance_score"] for r in answer["results"]] == pytest.approx(
                [want[i] for i in order], rel=1e-5, abs=1e-6)
            assert answer["results"][0]["document"] == {"tokens": DOCS[order[0]]}
            tokens = sum(len(QUERY) + len(d) for d in DOCS)  # (vLLM's RerankUsage)
            assert answer["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_text_pairs_are_the_tokenizers_pairs(tmp_path: Path) -> None:
    """/score and /rerank read two texts as the tokenizer pairs them (its pair template's
    separators kept), as vLLM does and as ``LLM.score`` does."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from mrv2.testing import make_tiny_tokenizer

    path = make_tiny_checkpoint(tmp_path, "Qwen3ForSequenceClassification", seed=5,
                                num_labels=1, vocab_size=320)
    make_tiny_tokenizer(path)
    hf_tok = AutoTokenizer.from_pretrained(str(path))
    bos = hf_tok.convert_tokens_to_ids("<s>")
    hf_tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", bos)])
    hf_tok.save_pretrained(str(path))
    query, docs = "The capital of France", ["is Paris.", "Hello world!", "France"]
    pairs = [AutoTokenizer.from_pretrained(str(path))(text=query, text_pair=d)["input_ids"]
             for d in docs]
    want = [o.outputs.probs[0] for o in LLM(str(path), **KWARGS).classify(
        [{"prompt_token_ids": p} for p in pairs], use_tqdm=False)]
    for url in _serve(path):
        data = _post(url, "/score", {"text_1": query, "text_2": docs}).json()
        assert [d["score"] for d in data["data"]] == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert data["usage"]["prompt_tokens"] == sum(map(len, pairs))
        answer = _post(url, "/rerank", {"query": query, "documents": docs}).json()
        assert {r["index"]: r["relevance_score"] for r in answer["results"]} == \
            pytest.approx(dict(enumerate(want)), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_2"),
    ("/score", {"text_1": [], "text_2": DOCS}, "text_1"),
    ("/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
    ("/classify", {"input": [[5, 100_000]]}, "input"),
])
def test_bad_requests_name_the_field(checkpoints: dict[str, Path], route: str,
                                     body: dict[str, Any], param: str) -> None:
    for url in _serve(checkpoints["reranker"]):
        response = _post(url, route, body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param


def test_an_embedding_server_reranks_by_cosine(server: Served, reference_llm: LLM) -> None:
    query, docs = "The capital of France is", ["Paris", "a city of lights", "bananas"]
    want = [o.outputs.score for o in reference_llm.score(query, docs, use_tqdm=False)]
    answer = _post(server.url, "/rerank", {"query": query, "documents": docs}).json()
    by_index = {r["index"]: r for r in answer["results"]}
    assert [by_index[i]["relevance_score"] for i in range(3)] == pytest.approx(
        want, rel=1e-5, abs=1e-6)
    assert by_index[0]["document"] == {"text": "Paris"}
    response = _post(server.url, "/classify", {"input": "x"})
    assert response.status_code == 400 and "task='classify'" in response.text
    # (each text is a prompt of its own: a bad one is named by its own field)
    for route, body, param in [("/rerank", {"query": [5, 100_000], "documents": docs}, "query"),
                               ("/score", {"text_1": [[5, 9]], "text_2": [[100_000]]},
                                "text_2"),
                               ("/score", {"text_1": [[100_000]], "text_2": [[5]]},
                                "text_1")]:
        response = _post(server.url, route, body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_rerank_return_documents_and_document_objects(server: Served) -> None:
    """``return_documents`` (Jina's and Cohere's; default true, as vLLM always returns
    them): false leaves each result's ``document`` out; documents given as Cohere's
    ``{"text": ...}`` objects rank as their texts."""
    query, docs = "The capital of France is", ["Paris", "a city of lights", "bananas"]
    plain = _post(server.url, "/v1/rerank", {"query": query, "documents": docs}).json()
    assert all(r["document"] == {"text": docs[r["index"]]} for r in plain["results"])
    bare = _post(server.url, "/rerank", {"query": query, "documents": docs,
                                         "return_documents": False})
    assert bare.status_code == 200, bare.text
    assert [r["index"] for r in bare.json()["results"]] == [
        r["index"] for r in plain["results"]]
    assert all("document" not in r for r in bare.json()["results"])
    objects = _post(server.url, "/v1/rerank", {
        "query": query, "documents": [{"text": d} for d in docs], "top_n": 2})
    assert objects.status_code == 200, objects.text
    assert objects.json()["results"] == plain["results"][:2]
    for bad in ([{"title": "x"}], [{"text": 5}], ["Paris", [5, 6]]):
        response = _post(server.url, "/rerank", {"query": query, "documents": bad})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "documents"


def test_classify_through_the_engine_process(checkpoints: dict[str, Path]) -> None:
    from mrv2.entrypoints.engine_process import RemoteEngine
    from mrv2.entrypoints.server import create_app

    path = checkpoints["classifier"]
    engine = RemoteEngine(EngineConfig.from_kwargs(model=str(path), **ENGINE_KWARGS))
    try:
        assert engine.num_labels == 3 and engine.id2label == LABELS
        for url in serve_in_thread(create_app(engine, served_model_name=MODEL,
                                              api_key=API_KEY)):
            answer = _post(url, "/classify", {"input": DOCS[0]}).json()
            assert answer["data"][0]["num_classes"] == 3
            response = _post(url, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
            assert response.status_code == 400
    finally:
        engine.shutdown()


@pytest.mark.parametrize("process", [False, True])
def test_pooling_route_gives_every_tokens_labels(tmp_path: Path, process: bool) -> None:
    """vLLM's ``POST /pooling``: a token classifier's label probabilities per prompt token
    (its own task), as ``LLM.encode`` gives them, through the engine thread and the engine's
    process; ``task`` picks another (a per-token embedding); a bad task is a 400."""
    from mrv2.engine.engine import LLMEngine
    from mrv2.entrypoints.engine_process import RemoteEngine
    from mrv2.entrypoints.server import create_app

    path = make_tiny_checkpoint(tmp_path / "tok", "Qwen3ForTokenClassification", seed=6,
                                id2label=LABELS, label2id={v: k for k, v in LABELS.items()},
                                is_matryoshka=True)
    want = LLM(str(path), **KWARGS).encode([{"prompt_token_ids": d} for d in DOCS],
                                           use_tqdm=False)
    config = EngineConfig.from_kwargs(model=str(path), **KWARGS)
    engine = RemoteEngine(config) if process else LLMEngine(config)
    try:
        for url in serve_in_thread(create_app(engine, served_model_name=MODEL,
                                              api_key=API_KEY)):
            answer = _post(url, "/pooling", {"input": DOCS}).json()
            assert answer["usage"]["prompt_tokens"] == sum(map(len, DOCS))
            for item, w in zip(answer["data"], want, strict=True):
                assert item["object"] == "pooling"
                got = torch.tensor(item["data"])
                assert got.shape == w.outputs.data.shape == (len(DOCS[item["index"]]), 3)
                torch.testing.assert_close(got, w.outputs.data, rtol=1e-5, atol=1e-6)
            rows = _post(url, "/pooling", {"input": DOCS[:1], "task": "token_embed",
                                           "dimensions": 8}).json()["data"][0]["data"]
            assert len(rows) == len(DOCS[0]) and all(len(r) == 8 for r in rows)
            packed = _post(url, "/pooling", {"input": DOCS, "encoding_format": "base64"})
            for item, w in zip(packed.json()["data"], want, strict=True):
                got = np.frombuffer(base64.b64decode(item["data"]), dtype="<f4")
                np.testing.assert_allclose(got, w.outputs.data.numpy().ravel(), rtol=1e-5,
                                           atol=1e-6)
            raw = _post(url, "/pooling", {"input": DOCS[:1], "use_activation": False}).json()
            torch.testing.assert_close(torch.tensor(raw["data"][0]["data"]).softmax(-1),
                                       want[0].outputs.data, rtol=1e-5, atol=1e-6)
            bad = _post(url, "/pooling", {"input": DOCS, "task": "reward"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "task"
    finally:
        engine.shutdown()


def test_use_activation_false_gives_the_raw_logits(checkpoints: dict[str, Path]) -> None:
    """vLLM's ``use_activation`` (older ``softmax``, ``activation``): false answers a
    classifier's raw logits (/classify's ``probs``, /score's and /rerank's scores), whose
    softmax (a reranker's: sigmoid) is the default answer."""
    for url in _serve(checkpoints["classifier"]):
        probs = _post(url, "/classify", {"input": DOCS}).json()["data"]
        for name in ("use_activation", "softmax", "activation"):
            logits = _post(url, "/classify", {"input": DOCS, name: False}).json()["data"]
            for p, q in zip(probs, logits, strict=True):
                assert torch.tensor(q["probs"]).softmax(-1).tolist() == pytest.approx(
                    p["probs"], rel=1e-5, abs=1e-6)
                assert q["label"] == p["label"]
        same = _post(url, "/classify", {"input": DOCS, "use_activation": True}).json()
        assert [d["probs"] for d in same["data"]] == [d["probs"] for d in probs]
    for url in _serve(checkpoints["reranker"]):
        want = [d["score"] for d in _post(url, "/score", {"text_1": QUERY,
                                                          "text_2": DOCS}).json()["data"]]
        raw = [d["score"] for d in _post(url, "/score", {
            "text_1": QUERY, "text_2": DOCS, "use_activation": False}).json()["data"]]
        assert torch.tensor(raw).sigmoid().tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
        ranked = _post(url, "/rerank", {"query": QUERY, "documents": DOCS,
                                        "use_activation": False}).json()["results"]
        assert [r["relevance_score"] for r in ranked] == pytest.approx(
            sorted(raw, reverse=True), rel=1e-5, abs=1e-6)


def test_score_takes_vllms_other_field_names(checkpoints: dict[str, Path]) -> None:
    """/score's two fields under each name vLLM takes (``text_1``/``text_2``,
    ``data_1``/``data_2``, ``queries``/``documents``, ``queries``/``items``), with the
    same scores; anything but one pair is a 400 naming the fields, and a bad item is
    named by its field."""
    for url in _serve(checkpoints["reranker"]):
        want = _post(url, "/score", {"text_1": QUERY, "text_2": DOCS}).json()["data"]
        for first, second in [("data_1", "data_2"), ("queries", "documents"),
                              ("queries", "items")]:
            got = _post(url, "/v1/score", {first: QUERY, second: DOCS})
            assert got.status_code == 200, got.text
            assert got.json()["data"] == want
        for body in ({"text_1": QUERY}, {"queries": QUERY, "documents": DOCS, "items": DOCS},
                     {"text_1": QUERY, "data_2": DOCS}):
            response = _post(url, "/score", body)
            assert response.status_code == 400, response.text
            assert "give one pair of fields" in response.json()["error"]["message"]
        response = _post(url, "/score", {"queries": QUERY, "documents": []})
        assert response.status_code == 400 and response.json()["error"]["param"] == "documents"
