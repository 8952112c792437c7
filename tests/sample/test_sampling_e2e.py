"""Sampling features end to end through ``mrv2.LLM``, checked against HF transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mrv2.sample.prompt_logprobs as prompt_logprobs_module
from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

PROMPT = [5, 17, 99, 3, 42, 8, 120, 7, 64, 33, 2, 200, 11, 76, 150, 9, 31, 250, 4, 18]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM")
    make_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> LLM:
    return LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, max_model_len=128,
               max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def hf(ckpt: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt),
                                                             dtype=torch.float32).eval()


def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _penalize(logits: torch.Tensor, prompt: list[int], output: list[int],
              p: SamplingParams) -> torch.Tensor:
    x = logits.clone()
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=x.numel())
    seen = counts > 0
    seen[prompt] = True
    x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty,
                                      x * p.repetition_penalty), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def test_greedy_penalties_and_logprobs_match_hf(llm: LLM, hf: torch.nn.Module) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3,
                            repetition_penalty=1.5, frequency_penalty=0.5,
                            presence_penalty=0.4)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 12
    total = 0.0
    for i, token in enumerate(out.token_ids):
        logits = _hf_logits(hf, PROMPT + out.token_ids[:i])[-1]
        assert token == int(_penalize(logits, PROMPT, out.token_ids[:i], params).argmax())
        ref = torch.log_softmax(logits, -1)  # raw distribution: before the penalties
        entry = out.logprobs[i]
        assert entry[token].logprob == pytest.approx(float(ref[token]), abs=1e-4)
        assert entry[token].rank == int((ref > ref[token]).sum()) + 1
        top = ref.topk(3).indices.tolist()
        assert set(top) <= set(entry)
        for r, t in enumerate(top, start=1):
            assert entry[t].rank == r and entry[t].decoded_token is not None
        total += float(ref[token])
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)
    # The row is reused: its counts and prompt mask must have been reset.
    again = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    assert again.token_ids == out.token_ids and again.logprobs == out.logprobs
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = llm.generate([{"prompt_token_ids": PROMPT}], plain, use_tqdm=False)[0].outputs[0]
    assert free.token_ids != out.token_ids  # the penalties changed something


def test_prompt_logprobs_chunked_match_hf(
    ckpt: Path, hf: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prefix caching stays on: the first request caches PROMPT's blocks, and a prompt_logprobs
    # request must compute every position anyway (the scheduler skips cache hits for it).
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, max_model_len=128,
              max_num_batched_tokens=16)
    llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1), use_tqdm=False)
    monkeypatch.setattr(prompt_logprobs_module, "DEFAULT_SLICE_TOKENS", 3)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    # 20 prompt tokens, at most 16 per step: two prefill chunks, each in slices of 3 rows.
    res = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:7]}],
                       [params, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)],
                       use_tqdm=False)
    for r, prompt, k in ((res[0], PROMPT, 2), (res[1], PROMPT[:7], 0)):
        lps = r.prompt_logprobs
        assert lps is not None and len(lps) == len(prompt) and lps[0] is None
        ref = torch.log_softmax(_hf_logits(hf, prompt), -1)
        for pos in range(1, len(prompt)):
            entry = lps[pos]
            assert entry is not None
            token = prompt[pos]
            assert entry[token].logprob == pytest.approx(float(ref[pos - 1, token]), abs=1e-4)
            assert entry[token].rank == int((ref[pos - 1] > ref[pos - 1, token]).sum()) + 1
            assert set(ref[pos - 1].topk(k).indices.tolist()) <= set(entry)
            assert len(entry) <= k + 1


def test_seeded_penalized_sampling_ignores_batch(llm: LLM) -> None:
    target = SamplingParams(temperature=1.0, seed=77, max_tokens=10, ignore_eos=True,
                            frequency_penalty=1.0, repetition_penalty=1.3,
                            logit_bias={7: 3.0})
    alone = llm.generate([{"prompt_token_ids": [11, 22, 33]}], target, use_tqdm=False)
    others = [SamplingParams(temperature=0.8, seed=s, max_tokens=4 + s, ignore_eos=True,
                             presence_penalty=0.5 * s) for s in range(3)]
    mixed = llm.generate(
        [{"prompt_token_ids": p} for p in ([9] * 9, [11, 22, 33], [1, 2], [3, 4, 5, 6])],
        [others[0], target, others[1], others[2]], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_n_fans_out_with_derived_seeds(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True,
                            logprobs=1)
    res = llm.generate([{"prompt_token_ids": [3, 1, 4]}], params, use_tqdm=False)
    assert len(res) == 1 and res[0].finished
    outs = res[0].outputs
    assert [o.index for o in outs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 and o.logprobs and len(o.logprobs) == 8 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) == 3
    single = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": [3, 1, 4]}], single, use_tqdm=False)
    assert first[0].outputs[0].token_ids == outs[0].token_ids
    again = llm.generate([{"prompt_token_ids": [3, 1, 4]}], params, use_tqdm=False)
    assert [o.token_ids for o in again[0].outputs] == [o.token_ids for o in outs]


def test_negative_seeds_as_vllm(llm: LLM) -> None:
    """vLLM's seeds: -1 means none (a random one), and any other int64, negative ones too,
    seeds the request reproducibly (clients send ``seed: -1`` for "random")."""
    assert SamplingParams(seed=-1).seed is None
    prompt = [{"prompt_token_ids": [3, 1, 4]}]
    runs = [llm.generate(prompt, SamplingParams(n=2, temperature=1.0, seed=seed, max_tokens=8,
                                                ignore_eos=True), use_tqdm=False)[0]
            for seed in (-5, -5, -2**63, 5)]
    tokens = [[o.token_ids for o in r.outputs] for r in runs]
    assert tokens[0] == tokens[1]  # reproducible
    assert tokens[0][0] != tokens[0][1]  # the two samples differ
    assert len({tuple(t[0]) for t in tokens[1:]}) == 3  # -5, -2**63 and 5: three seeds
    unseeded = llm.generate(prompt, SamplingParams(temperature=1.0, seed=-1, max_tokens=8,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert len(unseeded.outputs[0].token_ids) == 8


def test_allowed_bad_words_and_min_tokens(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    allowed = [10, 20, 30]
    out = llm.generate([{"prompt_token_ids": PROMPT}],
                       SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True,
                                      allowed_token_ids=allowed), use_tqdm=False)[0]
    assert set(out.outputs[0].token_ids) <= set(allowed)
    free = llm.generate([{"prompt_token_ids": PROMPT}],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    words = [(i, tok.decode([t])) for i, t in enumerate(free)]
    words = [(i, w) for i, w in words if w.strip() and tok.encode(w, add_special_tokens=False)
             == [free[i]]]
    assert words, "no generated token round-trips through the tokenizer"
    i, word = words[0]
    banned = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=[word])
    out_ids = llm.generate([{"prompt_token_ids": PROMPT}], banned,
                           use_tqdm=False)[0].outputs[0].token_ids
    assert free[i] not in out_ids and out_ids != free
    eos = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, stop_token_ids=[free[1]])
    out_ids = llm.generate([{"prompt_token_ids": PROMPT}], eos,
                           use_tqdm=False)[0].outputs[0].token_ids
    assert len(out_ids) == 6 and free[1] not in out_ids


def test_a_bad_word_with_a_leading_space_bans_the_bare_word_too(llm: LLM) -> None:
    """vLLM's rule: a bad word is tokenized with its leading whitespace stripped and with one
    space before it, so ``" w"`` bans ``w`` at the start of the output too (it banned only
    the spaced form)."""
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    free = llm.generate([{"prompt_token_ids": PROMPT}], greedy,
                        use_tqdm=False)[0].outputs[0].token_ids
    words = [(t, tok.decode([t])) for t in free]
    words = [(t, w) for t, w in words if w.strip() == w and w and "\ufffd" not in w
             and tok.encode(w, add_special_tokens=False) == [t]
             and tok.encode(" " + w, add_special_tokens=False) != [t]]
    assert words, f"no generated token of {free} is a word of its own: change PROMPT"
    token, word = words[0]
    banned = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            bad_words=[" " + word])
    out = llm.generate([{"prompt_token_ids": PROMPT}], banned,
                       use_tqdm=False)[0].outputs[0].token_ids
    assert token not in out and out != free


def test_bad_words_past_the_models_vocabulary(llm: LLM) -> None:
    """A bad word whose tokens include ids the model has no logit for (the tokenizer's added
    tokens past the model's vocabulary) can never be completed: it bans nothing (it raised an
    IndexError inside the step, failing the whole batch; on a GPU, a device-side assert)."""
    tok = llm.get_tokenizer()
    vocab = llm.engine.vocab_size
    word = "Hello"
    variants = [tok.encode(w, add_special_tokens=False) for w in (word, " " + word)]
    assert all(v and max(v) >= vocab for v in variants), (variants, vocab)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:5]}]
    free = llm.generate(prompts, greedy, use_tqdm=False)
    banned = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=[word])
    got = llm.generate(prompts, [banned, greedy], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in free]


def test_a_requests_bad_words_are_tokenized_once(llm: LLM,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's bad words are tokenized once (each word plain and spaced): ``generate``
    validates every prompt before queueing any, ``add_request`` validates again and then
    prepares the params, and each sample of an ``n > 1`` request does both again (9 passes
    here, 3 for ``n=1``); the server's validate-then-queue the same."""
    engine = llm.engine
    assert engine.tokenizer is not None
    encode, calls = engine.tokenizer.encode, []

    def counted(text: str, add_special_tokens: bool = True) -> list[int]:
        calls.append(text)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(engine.tokenizer, "encode", counted)
    one_pass = ["capital", " capital", "France", " France"]
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=2, n=3,
                            bad_words=one_pass[::2])
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3 and calls == one_pass
    calls.clear()  # (the engine's own calls, as the server makes them)
    params = SamplingParams(temperature=0, max_tokens=2, bad_words=["world"])
    engine.validate(PROMPT, params)
    engine.add_request(PROMPT, params, request_id="worded")
    while engine.has_unfinished():
        engine.step()
    assert calls == ["world", " world"]


def test_logprobs_same_with_async_off(ckpt: Path, llm: LLM) -> None:
    sync = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, max_model_len=128,
               max_num_batched_tokens=16, async_scheduling=False)
    params = SamplingParams(temperature=0.9, seed=4, max_tokens=6, ignore_eos=True, logprobs=2,
                            presence_penalty=0.7)
    prompts = [{"prompt_token_ids": PROMPT[:5]}, {"prompt_token_ids": PROMPT[3:9]}]
    a = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    b = [o.outputs[0] for o in sync.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for x, y in zip(a, b, strict=True):
        assert x.logprobs is not None and y.logprobs is not None
        for px, py in zip(x.logprobs, y.logprobs, strict=True):
            assert px.keys() == py.keys()
            assert all(px[t].logprob == pytest.approx(py[t].logprob, abs=1e-5) for t in px)


def test_penalties_min_tokens_survive_preemption(ckpt: Path, llm: LLM) -> None:
    """A preempted request resumes with prompt + outputs as prefill; its penalty counts,
    min_tokens and logprobs must continue as if nothing happened."""
    tiny = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, max_model_len=128,
               max_num_batched_tokens=16, num_gpu_blocks_override=14)
    prompts = [{"prompt_token_ids": [i + 1, 2 * i + 3, 7, i + 40, 9]} for i in range(4)]
    # Negative penalties reward repeating earlier outputs: lost counts would show.
    params = SamplingParams(temperature=0.8, seed=21, max_tokens=14, min_tokens=14,
                            frequency_penalty=-0.7, presence_penalty=-1.5, logprobs=1)
    got = tiny.generate(prompts, params, use_tqdm=False)
    assert tiny.engine.scheduler.num_preemptions > 0
    want = llm.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob,
                                                                abs=1e-3)


def test_abort_of_an_n_parent_cancels_every_sample(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=20, ignore_eos=True)
    parent = engine.add_request([3, 4, 5, 6], params)
    engine.step()
    engine.abort(parent)
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    assert outputs == []
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert len(engine.runner.table) == 0
