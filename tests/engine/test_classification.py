"""Sequence classifiers (``XForSequenceClassification``: any registered causal LM family plus
its ``score`` head) and scoring, against HF transformers: ``LLM.classify``'s label
probabilities, ``LLM.score`` with a one-label classifier (a reranker: the pair read as one
prompt) and with an embedding model (the cosine of the embeddings)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from mrv2 import LLM, PoolingParams, SamplingParams
from mrv2.testing import make_tiny_checkpoint

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 200], [1 + i % 200 for i in range(23)], [64, 9]]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def _hf_probs(path: Path, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)


def _llm(path: Path, **kwargs: object) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=64,
               **kwargs)


@pytest.mark.parametrize("family", ["Qwen3", "Llama"])
def test_classify_matches_hf(family: str, tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "cls", f"{family}ForSequenceClassification",
                                seed=4, id2label=LABELS,
                                label2id={v: k for k, v in LABELS.items()})
    llm = _llm(path)
    assert llm.engine.num_labels == 3 and llm.engine.id2label == LABELS
    outs = llm.classify([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, ids in zip(outs, PROMPTS, strict=True):
        assert out.outputs.num_classes == 3 and out.prompt_token_ids == ids
        torch.testing.assert_close(torch.tensor(out.outputs.probs), _hf_probs(path, ids),
                                   rtol=1e-4, atol=1e-5)
    # vLLM's LLM.encode: the model's own task (a classifier's labels) as tensors
    encoded = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for enc, out in zip(encoded, outs, strict=True):  # (its prompts' blocks now cached)
        torch.testing.assert_close(enc.outputs.data, torch.tensor(out.outputs.probs),
                                   rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"pooling_task must be one of \['embed', 'classify', "
                                         r"'token_embed', 'token_classify'\], got 'reward'"):
        llm.encode({"prompt_token_ids": [5]}, pooling_task="reward")
    with pytest.raises(ValueError, match="scoring needs a classifier of one label"):
        llm.score({"prompt_token_ids": [5]}, {"prompt_token_ids": [6]}, use_tqdm=False)
    # a classifier is served as a pooling model: no text, by name
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="runner='generate'"):
        _llm(path, runner="generate")


def test_token_classify_matches_hf_chunk_by_chunk(tmp_path: Path) -> None:
    """A token classifier (``Qwen3ForTokenClassification``: the score head, with its bias,
    on every token): a row of label probabilities per prompt token, against HF's, with the
    23-token prompt computed in two chunks; asked again, the rows are computed again (no
    prefix cache for per-token requests), and ``LLM.reward`` gives the same."""
    path = make_tiny_checkpoint(tmp_path / "tok", "Qwen3ForTokenClassification", seed=5,
                                id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    hf = transformers.AutoModelForTokenClassification.from_pretrained(
        str(path), dtype=torch.float32).eval()
    llm = _llm(path, max_num_batched_tokens=16)
    assert llm.engine.default_pooling_task == "token_classify"
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    for outs in (llm.encode(prompts, use_tqdm=False), llm.reward(prompts, use_tqdm=False)):
        for out, ids in zip(outs, PROMPTS, strict=True):
            with torch.no_grad():
                want = torch.softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
            assert out.outputs.data.shape == (len(ids), 3)
            torch.testing.assert_close(out.outputs.data, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="dimensions applies to task='embed' or 'token_embed'"):
        PoolingParams(task="token_classify", dimensions=4)


def test_token_embed_gives_every_tokens_state(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "emb", "Qwen3ForCausalLM", seed=6)
    llm = _llm(path, max_num_batched_tokens=16)
    hf = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    outs = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False,
                      pooling_task="token_embed")
    for out, ids in zip(outs, PROMPTS, strict=True):
        with torch.no_grad():
            states = hf(torch.tensor([ids])).last_hidden_state[0]
        torch.testing.assert_close(out.outputs.data,
                                   torch.nn.functional.normalize(states, dim=-1),
                                   rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="task='token_classify' needs a classification"):
        llm.reward({"prompt_token_ids": [5, 6]}, use_tqdm=False)


def test_a_reranker_scores_each_pair_as_one_prompt(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "rerank", "Qwen3ForSequenceClassification",
                                seed=5, num_labels=1)
    llm = _llm(path)
    query = {"prompt_token_ids": [11, 12, 13]}
    docs = [{"prompt_token_ids": p} for p in PROMPTS]
    got = llm.score(query, docs, use_tqdm=False)
    want = [float(_hf_probs(path, [11, 12, 13] + p)[0]) for p in PROMPTS]
    assert [g.prompt_token_ids for g in got] == [[11, 12, 13] + p for p in PROMPTS]
    for g, w in zip(got, want, strict=True):
        assert abs(g.outputs.score - w) < 1e-5
    assert len({round(g.outputs.score, 6) for g in got}) == len(PROMPTS)  # (they differ)
    pairwise = llm.score(docs[:2], docs[1:], use_tqdm=False)  # item by item
    assert abs(pairwise[0].outputs.score
               - float(_hf_probs(path, PROMPTS[0] + PROMPTS[1])[0])) < 1e-5
    with pytest.raises(ValueError, match="data_1 holds 2 items and data_2 3"):
        llm.score(docs[:2], docs, use_tqdm=False)


def test_a_reranker_reads_text_pairs_as_the_tokenizer_pairs_them(tmp_path: Path) -> None:
    """Two texts make one prompt as the tokenizer pairs them (``tokenizer(text=a,
    text_pair=b)``, as vLLM and sentence-transformers' CrossEncoder read a pair), with any
    separator its pair template puts between them (Llama 3's second BOS)."""
    from tokenizers import processors

    from mrv2.testing import make_tiny_tokenizer

    path = make_tiny_checkpoint(tmp_path / "rerank", "Qwen3ForSequenceClassification",
                                seed=5, num_labels=1, vocab_size=320)
    make_tiny_tokenizer(path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path))
    bos = hf_tok.convert_tokens_to_ids("<s>")
    hf_tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", bos)])
    hf_tok.save_pretrained(str(path))
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path))
    query, docs = "The capital of France", ["is Paris.", "Hello world!"]
    pairs = [hf_tok(text=query, text_pair=d)["input_ids"] for d in docs]
    assert pairs[0].count(bos) == 2
    got = _llm(path).score(query, docs, use_tqdm=False)
    assert [g.prompt_token_ids for g in got] == pairs
    for g, ids in zip(got, pairs, strict=True):
        assert abs(g.outputs.score - float(_hf_probs(path, ids)[0])) < 1e-5


def test_an_embedding_model_scores_cosine_similarity(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "emb", "Qwen3ForCausalLM", seed=6)
    llm = _llm(path)
    hf = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        vecs = [torch.nn.functional.normalize(hf(torch.tensor([p])).last_hidden_state[0, -1],
                                              dim=-1) for p in PROMPTS]
    got = llm.score({"prompt_token_ids": PROMPTS[0]},
                    [{"prompt_token_ids": p} for p in PROMPTS[1:]], use_tqdm=False)
    for g, v in zip(got, vecs[1:], strict=True):
        assert abs(g.outputs.score - float(torch.dot(vecs[0], v))) < 1e-5


def test_classify_needs_a_classifier(tmp_path: Path) -> None:
    llm = _llm(make_tiny_checkpoint(tmp_path / "lm", "Qwen3ForCausalLM", seed=7))
    with pytest.raises(ValueError, match="task='classify' needs a classification model"):
        llm.classify([{"prompt_token_ids": [5, 6]}], use_tqdm=False)
    embedded = llm.embed({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)[0].outputs.embedding
    encoded = llm.encode({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(encoded, torch.tensor(embedded), rtol=1e-4, atol=1e-5)
    assert encoded.numel() == len(embedded)  # (a causal LM's own task: its embedding)
    with pytest.raises(ValueError, match="PoolingParams.task must be one of"):
        PoolingParams(task="reward")


def test_a_causal_lm_becomes_a_yes_no_reranker(tmp_path: Path) -> None:
    """Qwen3-Reranker's recipe (vLLM's ``hf_overrides``): the causal LM's ``P("yes")`` over
    ``{"no", "yes"}`` at the last token, as one score."""
    from mrv2.model_loader.default_model import ensure_default_model

    path = make_tiny_checkpoint(tmp_path / "lm", "Qwen3ForCausalLM", seed=8,
                                vocab_size=49152, tie_word_embeddings=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(ensure_default_model()))
    tokenizer.save_pretrained(str(path))
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path),
                                                           dtype=torch.float32).eval()
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
    llm = _llm(path, hf_overrides=overrides)
    assert llm.engine.num_labels == 1
    got = llm.score({"prompt_token_ids": [11, 12]}, [{"prompt_token_ids": p} for p in PROMPTS],
                    use_tqdm=False)
    for g, p in zip(got, PROMPTS, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([[11, 12] + p])).logits[0, -1]
        want = float(torch.softmax(logits[[no, yes]], dim=-1)[1])
        assert abs(g.outputs.score - want) < 1e-5
    with pytest.raises(ValueError, match="not a token of the model's tokenizer"):
        _llm(path, hf_overrides={**overrides, "classifier_from_token": ["no", "yess-not"]})


def test_truncate_prompt_tokens_keeps_the_last_tokens(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "cls", "Qwen3ForSequenceClassification", seed=9,
                                num_labels=2)
    llm = _llm(path)
    long = PROMPTS[1]
    cut = llm.classify({"prompt_token_ids": long}, use_tqdm=False, truncate_prompt_tokens=5)
    assert cut[0].prompt_token_ids == long[-5:]
    torch.testing.assert_close(torch.tensor(cut[0].outputs.probs),
                               _hf_probs(path, long[-5:]), rtol=1e-4, atol=1e-5)
    short = llm.embed({"prompt_token_ids": PROMPTS[2]}, use_tqdm=False,
                      truncate_prompt_tokens=5)  # (shorter than the cut: whole)
    assert short[0].prompt_token_ids == PROMPTS[2]
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be an int >= 1"):
        llm.classify({"prompt_token_ids": long}, use_tqdm=False, truncate_prompt_tokens=0)
    # vLLM's -1: as many as the context holds (max_model_len, 64), as the server takes it
    too_long = [1 + (3 * i) % 200 for i in range(70)]
    for run in (llm.classify, llm.embed):
        out = run({"prompt_token_ids": too_long}, use_tqdm=False, truncate_prompt_tokens=-1)
        assert out[0].prompt_token_ids == too_long[-64:]
    out = llm.encode({"prompt_token_ids": long}, use_tqdm=False, truncate_prompt_tokens=-1)
    assert out[0].prompt_token_ids == long
    for run in (llm.classify, llm.embed):  # (vLLM's: a cut longer than the context, refused)
        with pytest.raises(ValueError, match=r"truncate_prompt_tokens value \(65\) is greater"):
            run({"prompt_token_ids": long}, use_tqdm=False, truncate_prompt_tokens=65)


def test_encode_with_pooling_params_keeps_the_models_task(tmp_path: Path) -> None:
    """vLLM's ``LLM.encode``: ``PoolingParams`` without a task take the ``pooling_task``
    asked for, else (here) the model's own: a classifier's label probabilities, not its
    embedding; a task in the params that differs from ``pooling_task`` is refused by name.
    A prompt of ``max_model_len`` tokens is classified as HF classifies it."""
    path = make_tiny_checkpoint(tmp_path / "cls", "Qwen3ForSequenceClassification", seed=4,
                                id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    llm = _llm(path)
    full = [1 + (5 * i) % 200 for i in range(64)]
    for ids in (PROMPTS[0], full):
        got = llm.encode({"prompt_token_ids": ids}, PoolingParams(), use_tqdm=False)[0]
        torch.testing.assert_close(got.outputs.data, _hf_probs(path, ids), rtol=1e-4,
                                   atol=1e-5)
    embedded = llm.encode({"prompt_token_ids": PROMPTS[0]}, PoolingParams(task="embed"),
                          use_tqdm=False)[0].outputs.data
    assert embedded.shape == (llm.engine.hidden_size,)
    with pytest.raises(ValueError, match="pooling_task='classify'.*task='embed'"):
        llm.encode({"prompt_token_ids": PROMPTS[0]}, PoolingParams(task="embed"),
                   pooling_task="classify")
    with pytest.raises(ValueError, match="pooling_task='embed'.*task='classify'"):
        llm.embed({"prompt_token_ids": PROMPTS[0]}, PoolingParams(task="classify"))


def test_use_activation_false_gives_the_raw_logits(tmp_path: Path) -> None:
    """vLLM's ``PoolingParams(use_activation=False)``: ``LLM.classify`` answers the score
    head's logits (HF's), ``LLM.score`` a reranker's logit (its sigmoid is the default
    score), ``LLM.encode`` a classifier's logits too; for an embedding it is
    ``normalize``."""
    path = make_tiny_checkpoint(tmp_path / "cls", "Qwen3ForSequenceClassification", seed=4,
                                num_labels=3)
    llm = _llm(path)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    raw = PoolingParams(use_activation=False)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=torch.float32).eval()
    for out, ids in zip(llm.classify(prompts, use_tqdm=False, pooling_params=raw), PROMPTS,
                        strict=True):
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0].float()
        torch.testing.assert_close(torch.tensor(out.outputs.probs), want, rtol=1e-4,
                                   atol=1e-5)
    encoded = llm.encode(prompts[:1], raw, use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(encoded.softmax(-1), _hf_probs(path, PROMPTS[0]), rtol=1e-4,
                               atol=1e-5)
    reranker = _llm(make_tiny_checkpoint(tmp_path / "rerank", "Qwen3ForSequenceClassification",
                                         seed=5, num_labels=1))
    query, docs = {"prompt_token_ids": [11, 12, 13]}, prompts
    scores = [g.outputs.score for g in reranker.score(query, docs, use_tqdm=False)]
    logits = [g.outputs.score for g in reranker.score(query, docs, use_tqdm=False,
                                                      pooling_params=raw)]
    assert torch.tensor(logits).sigmoid().tolist() == pytest.approx(scores, abs=1e-6)
    assert PoolingParams(use_activation=False).normalize is False
    assert PoolingParams(task="classify", use_activation=False).normalize is None
    with pytest.raises(ValueError, match="use_activation=False disagrees with normalize"):
        PoolingParams(normalize=True, use_activation=False)
