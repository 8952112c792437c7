"""Prompts given as embeddings (vLLM's ``enable_prompt_embeds`` / EmbedsPrompt):
``LLM.generate({"prompt_embeds": tensor})`` runs a ``[length, hidden_size]`` tensor in place
of the prompt's token embeddings, the generated tokens through the ordinary embedding. Checked
against the token prompt whose embedding rows they are, against HF transformers'
``inputs_embeds``, over chunked prefill and the CUDA-graph path, apart from token prompts in
the prefix cache; bad tensors and the flag off are ValueErrors naming the field, and nothing
is queued."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.contract.model_state import ModelState
from mrv2.contract.prompt_embeds import PromptEmbedsRows, prompt_embeds_item
from mrv2.engine.beam_search import BeamSearchParams
from mrv2.testing import emulate_cuda_graphs, make_tiny_checkpoint

PROMPT = [5, 9, 33, 12, 7, 100, 3, 8, 44, 2, 71, 19, 250, 6, 27, 90, 14, 38, 61, 4, 17, 23]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # (std 0.15: the tokens depend on every prompt row; see make_tiny_checkpoint)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM", std=0.15)


def _llm(checkpoint: Path, **kwargs: Any) -> LLM:
    return LLM(str(checkpoint), device="cpu", dtype="float32", block_size=4,
               enable_prompt_embeds=True, **kwargs)


def _embeds_of(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The model's own embedding rows of ``ids``."""
    model: Any = llm.engine.runner.model
    with torch.no_grad():
        return model.embed_input_ids(torch.tensor(ids)).detach().clone()


def _random_embeds(n: int, hidden: int, seed: int) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed)) * 0.5


def _tokens(llm: LLM, prompts: list[Any], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def _hf_greedy_embeds(checkpoint: Path, embeds: torch.Tensor, n: int) -> list[int]:
    """HF transformers' greedy tokens after ``inputs_embeds`` (a full forward a token, each
    generated token through its embedding table)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(checkpoint), dtype=torch.float32).eval()
    table = model.get_input_embeddings()
    x, out = embeds[None].clone(), []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(inputs_embeds=x).logits[0, -1].argmax())
            out.append(token)
            x = torch.cat([x, table(torch.tensor([[token]]))], dim=1)
    return out


def test_embedding_rows_give_the_token_prompts_tokens_and_logprobs(checkpoint: Path) -> None:
    llm = _llm(checkpoint)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    by_ids, by_embeds = llm.generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_embeds": _embeds_of(llm, PROMPT)}], params,
        use_tqdm=False)
    assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids
    want, got = by_ids.outputs[0].logprobs, by_embeds.outputs[0].logprobs
    assert want is not None and got is not None
    for w, g in zip(want, got, strict=True):
        assert w.keys() == g.keys()
        for token in w:
            assert g[token].logprob == pytest.approx(w[token].logprob, abs=1e-5)
    assert len(by_embeds.prompt_token_ids) == len(PROMPT)  # (placeholders: usage counts them)
    # a [1, length, hidden] batch of one is taken too (vLLM's)
    assert _tokens(llm, [{"prompt_embeds": _embeds_of(llm, PROMPT)[None]}]) == [
        list(by_ids.outputs[0].token_ids)]


def test_random_embeddings_match_hf_inputs_embeds(checkpoint: Path) -> None:
    llm = _llm(checkpoint)
    hidden = llm.engine.hidden_size
    embeds = [_random_embeds(n, hidden, seed) for n, seed in ((13, 1), (6, 2))]
    got = _tokens(llm, [{"prompt_embeds": e} for e in embeds] + [{"prompt_token_ids": PROMPT}])
    for e, tokens in zip(embeds, got, strict=False):
        assert tokens == _hf_greedy_embeds(checkpoint, e, 8)
    assert got[2] == _tokens(_llm(checkpoint), [{"prompt_token_ids": PROMPT}])[0]


def test_chunked_prefill_splits_the_embeddings(checkpoint: Path) -> None:
    embeds = _random_embeds(21, 64, 3)
    whole = _tokens(_llm(checkpoint), [{"prompt_embeds": embeds}])
    chunked = _llm(checkpoint, enable_chunked_prefill=True, max_num_batched_tokens=8,
                   max_num_seqs=4)
    steps = 0
    engine = chunked.engine
    engine.add_request([0] * 21, GREEDY, request_id="r", mm_items=[
        prompt_embeds_item(embeds, 64, engine.max_model_len)])
    out: Any = None
    while engine.has_unfinished():
        steps += 1
        for o in engine.step():
            if o.finished:
                out = o
    assert steps >= 3 + 8 - 1  # (21 rows over budgets of 8: three prefill steps)
    assert list(out.outputs[0].token_ids) == whole[0]
    # several embeddings prompts and token prompts sharing the chunked steps
    mixed = [{"prompt_embeds": embeds}, {"prompt_token_ids": PROMPT},
             {"prompt_embeds": _random_embeds(9, 64, 4)}]
    assert _tokens(chunked, mixed) == _tokens(_llm(checkpoint), mixed)


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_requests_resume_with_their_embeddings(checkpoint: Path, caching: bool
                                                         ) -> None:
    prompts: list[Any] = [{"prompt_embeds": _random_embeds(10 + i, 64, 20 + i)}
                          for i in range(4)] + [{"prompt_token_ids": PROMPT[:9]}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = _tokens(_llm(checkpoint), prompts, params)
    tight = _llm(checkpoint, num_gpu_blocks_override=12, enable_prefix_caching=caching)
    assert _tokens(tight, prompts, params) == want
    assert tight.engine.stats()["num_preemptions"] > 0


def test_graph_path_runs_embedding_steps_eager(checkpoint: Path) -> None:
    plain = _llm(checkpoint)
    graphed = _llm(checkpoint, max_num_seqs=4)
    emulate_cuda_graphs(graphed.engine.runner)
    prompts = [{"prompt_embeds": _random_embeds(11, 64, 5)}, {"prompt_token_ids": PROMPT[:7]},
               {"prompt_embeds": _embeds_of(plain, PROMPT)}]
    assert _tokens(graphed, prompts) == _tokens(plain, prompts)


def test_prefix_cache_keeps_embeddings_apart_from_tokens(checkpoint: Path) -> None:
    llm = _llm(checkpoint, enable_prefix_caching=True)
    zeros = [0] * 22  # (the placeholder ids of a 22-row prompt given as embeddings)
    embeds = _random_embeds(22, 64, 6)

    def run(prompt: dict[str, Any]) -> tuple[int, list[int]]:
        out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        return out.num_cached_tokens, list(out.outputs[0].token_ids)

    assert run({"prompt_token_ids": zeros})[0] == 0
    cached, tokens = run({"prompt_embeds": embeds})
    assert cached == 0  # the token prompt of its placeholder ids shares nothing
    assert tokens == _hf_greedy_embeds(checkpoint, embeds, 8)
    assert run({"prompt_embeds": embeds}) == (20, tokens)  # the same embeddings: a hit
    assert run({"prompt_embeds": embeds.clone()})[0] == 20  # (by content, not identity)
    other = embeds.clone()
    other[-1, 0] += 1.0  # (after every full block: the blocks before are shared)
    assert run({"prompt_embeds": other})[0] == 20
    other[0, 0] += 1.0
    assert run({"prompt_embeds": other})[0] == 0
    as_tokens = run({"prompt_token_ids": PROMPT})
    assert as_tokens[0] == 0
    assert run({"prompt_embeds": _embeds_of(llm, PROMPT)})[0] == 0  # (rows equal, still apart)
    assert run({"prompt_token_ids": PROMPT}) == (20, as_tokens[1])


@pytest.mark.parametrize(("bad", "match"), [
    (torch.zeros(4, 64, dtype=torch.int64), "prompt_embeds must be float32"),
    (torch.zeros(64), "prompt_embeds must be a 2-D tensor"),
    (torch.zeros(2, 4, 64), "prompt_embeds must be a 2-D tensor"),
    (torch.zeros(4, 32), "prompt_embeds has hidden size 32; the model's is 64"),
    (torch.zeros(0, 64), "prompt_embeds is empty"),
    (torch.zeros(64, 64), "prompt_embeds has 64 rows; max_model_len=64"),
    (torch.full((3, 64), float("nan")), "prompt_embeds holds non-finite"),
    (torch.tensor([[float("inf")] * 64]), "prompt_embeds holds non-finite"),
    ([[0.0] * 64], "prompt_embeds must be a torch.Tensor"),
])
def test_bad_embeddings_are_refused_and_the_engine_keeps_serving(
        checkpoint: Path, bad: Any, match: str) -> None:
    llm = _llm(checkpoint, max_model_len=64)
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_embeds": bad}], GREEDY,
                     use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert len(_tokens(llm, [{"prompt_embeds": _random_embeds(3, 64, 7)}])[0]) == 8


def test_what_needs_prompt_tokens_is_refused(checkpoint: Path) -> None:
    llm = _llm(checkpoint)
    embeds = _random_embeds(5, 64, 8)
    with pytest.raises(ValueError, match="prompt_logprobs: not with prompt_embeds"):
        llm.generate([{"prompt_embeds": embeds}], SamplingParams(prompt_logprobs=1),
                     use_tqdm=False)
    with pytest.raises(ValueError, match=r"takes no \['prompt_token_ids'\]"):
        llm.generate([{"prompt_embeds": embeds, "prompt_token_ids": [1]}], use_tqdm=False)
    with pytest.raises(ValueError, match="no prompt_embeds"):
        llm.beam_search([{"prompt_embeds": embeds}], BeamSearchParams(beam_width=2,
                                                                       max_tokens=2))
    assert not llm.engine.has_unfinished()
    # n > 1 samples share the embeddings (seeded: each its own tokens, as a token prompt's)
    out = llm.generate([{"prompt_embeds": embeds}],
                       SamplingParams(n=2, seed=3, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 2


def test_a_reranker_refuses_a_pair_of_embeddings(tmp_path: Path) -> None:
    """A cross-encoder reads a pair as one token prompt: embeddings can't be joined to it."""
    path = make_tiny_checkpoint(tmp_path, "Qwen3ForSequenceClassification", num_labels=1)
    llm = LLM(str(path), device="cpu", dtype="float32", enable_prompt_embeds=True)
    with pytest.raises(ValueError, match="no prompt_embeds"):
        llm.score({"prompt_embeds": _random_embeds(3, 64, 10)}, {"prompt_token_ids": [4, 5]})
    assert llm.score({"prompt_token_ids": [7, 8]}, {"prompt_token_ids": [4, 5]}, use_tqdm=False)


def test_flag_off_is_a_clear_error(checkpoint: Path) -> None:
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", block_size=4)
    with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
        llm.generate([{"prompt_embeds": _random_embeds(3, 64, 9)}], use_tqdm=False)
    engine = llm.engine  # (an item made elsewhere, handed to the engine directly)
    item = prompt_embeds_item(_random_embeds(3, 64, 9), 64, 100)
    with pytest.raises(ValueError, match="--enable-prompt-embeds"):
        engine.add_request([0, 0, 0], GREEDY, mm_items=[item])
    assert not engine.has_unfinished()


def test_a_model_state_that_cant_take_them_refuses_the_flag(
        checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ModelState, "prompt_embeds_supported", False)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM model takes no prompt embeddings"):
        _llm(checkpoint)
    LLM(str(checkpoint), device="cpu", dtype="float32")  # (the flag off: it starts)


def test_rows_are_held_until_their_last_row_is_computed() -> None:
    """The device copy is made once, at add; a step computing the last row lets go of it (a
    second call for the same step gets the same rows), a dummy batch's rows get none."""
    rows = PromptEmbedsRows(torch.device("cpu"), torch.float32)
    rows.add(3, "a", prompt_embeds_item(torch.ones(5, 8), 8, 100), num_computed=0)
    assert not rows.graph_allowed([3], [0], [2]) and rows.graph_allowed([2], [0], [5])
    rows.add(4, "b", prompt_embeds_item(torch.ones(5, 8), 8, 100), num_computed=5)
    assert rows.graph_allowed([4], [5], [1])  # (the prefix cache held every row)
    rows.remove(3)
    assert rows.graph_allowed([3], [0], [2])


def test_tensor_parallel_ranks_splice_the_same_rows(checkpoint: Path) -> None:
    """At TP=2 (ranks as processes) each rank gets the rows with the request: the tokens are
    TP=1's."""
    embeds = _random_embeds(13, 64, 11)
    prompts: list[Any] = [{"prompt_embeds": embeds}, {"prompt_token_ids": PROMPT[:5]}]
    got = {}
    for tp in (1, 2):
        with LLM(str(checkpoint), device="cpu", dtype="float32", block_size=4,
                 tensor_parallel_size=tp, enable_prompt_embeds=True) as llm:
            got[tp] = _tokens(llm, prompts)
    assert got[2] == got[1]


@pytest.mark.parametrize("architecture", ["GraniteForCausalLM", "GraniteMoeForCausalLM"])
def test_given_embeddings_follow_the_familys_hf_scaling(tmp_path: Path,
                                                        architecture: str) -> None:
    """Prompt embeddings mean what the family's HF model does with ``inputs_embeds``: Granite
    multiplies them by ``embedding_multiplier`` after its lookup, so raw table rows given as
    the prompt are the token prompt (the engine scales them on arrival, the model's
    ``prompt_embeds_scale``; Gemma's and Falcon-H1's HF models scale inside the lookup, and
    given rows arrive as they are)."""
    import transformers

    extra: dict[str, Any] = {"embedding_multiplier": 3.0}
    if architecture == "GraniteMoeForCausalLM":
        extra.update(num_local_experts=4, num_experts_per_tok=2)
    path = make_tiny_checkpoint(tmp_path, architecture, std=0.15, **extra)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        raw = hf.get_input_embeddings()(torch.tensor(PROMPT)).detach().clone()
    llm = _llm(path)
    model: Any = llm.engine.runner.model
    assert model.prompt_embeds_scale == 3.0
    ids, embeds = _tokens(llm, [{"prompt_token_ids": PROMPT}, {"prompt_embeds": raw}])
    assert embeds == ids == _hf_greedy_embeds(path, raw, len(embeds))
