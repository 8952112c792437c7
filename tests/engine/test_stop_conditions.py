"""Stop tokens, EOS, stop strings, max_tokens, min_tokens and aborts; what a streamed request's
outputs hold (cumulative, deltas, final only) and that none shows text a stop string cuts.

The cases are built from a first greedy run of the fixed tiny model (its seed is fixed, so the
run is too): a stop token is one the run produces for the first time at a known index, a stop
string one that occurs exactly once and straddles two tokens. Where the run could not give such
a case the test fails (pick another ``PROMPT``); it never skips."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from mrv2 import LLM, RequestOutput, RequestOutputKind, SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

PROMPT = "Hello world"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "LlamaForCausalLM",
                                vocab_size=320)
    make_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> LLM:
    return LLM(str(ckpt), device="cpu", dtype="float32", block_size=4)


@pytest.fixture(scope="module")
def free_run(llm: LLM) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(set(tokens[:6])) == 6, f"{PROMPT!r} gives a repetitive run {tokens}: change it"
    return tokens


def _first_new(tokens: list[int], start: int) -> int:
    """Index of the first token at or after ``start`` not seen before it (the fixture makes
    the first six tokens distinct, so any ``start`` < 6 has one)."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


def _straddling_stop(text_of: list[str], full: str) -> tuple[str, int]:
    """A stop string of three characters that occurs exactly once in ``full`` and starts
    inside one token's text and ends inside a later one; and where it starts."""
    for k in range(2, len(text_of) - 2):
        cut = len(text_of[k])  # characters decoded from the first k tokens
        stop = full[cut - 1 : cut + 2]
        if len(stop) == 3 and full.find(stop) == cut - 1 and full.count(stop) == 1:
            return stop, cut - 1
    raise AssertionError(f"no unique straddling stop string in {full!r}: change PROMPT")


def test_max_tokens(llm: LLM, free_run: list[int]) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run[:5] and out.finish_reason == "length"


def test_stop_token_ids(llm: LLM, free_run: list[int]) -> None:
    i = _first_new(free_run, 2)
    params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[free_run[i]])
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run[: i + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", free_run[i])


@pytest.mark.parametrize("skip_special", [True, False])
def test_a_stop_tokens_text_is_not_the_answers(llm: LLM, free_run: list[int],
                                              skip_special: bool) -> None:
    """As vLLM's: the token that stopped a request (a stop token id, or EOS) is in its
    token ids but not in its text, even with special tokens kept; only
    ``include_stop_str_in_output`` keeps its text."""
    tokenizer = llm.get_tokenizer()
    i = _first_new(free_run, 2)
    params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[free_run[i]],
                            skip_special_tokens=skip_special)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run[: i + 1]
    assert out.text == tokenizer.decode(free_run[:i], skip_special_tokens=skip_special)
    assert out.text != tokenizer.decode(free_run[: i + 1], skip_special_tokens=skip_special)
    kept = llm.generate(PROMPT, SamplingParams(
        temperature=0, max_tokens=16, stop_token_ids=[free_run[i]],
        skip_special_tokens=skip_special, include_stop_str_in_output=True),
        use_tqdm=False)[0].outputs[0]
    assert kept.text == tokenizer.decode(free_run[: i + 1], skip_special_tokens=skip_special)


def test_min_tokens_defers_stop(llm: LLM, free_run: list[int]) -> None:
    i = _first_new(free_run, 1)
    params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[free_run[i]],
                            min_tokens=i + 2)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= i + 2
    # vLLM's semantics: the stop token is masked (not just ignored) until min_tokens outputs.
    assert out.token_ids[:i] == free_run[:i]
    assert free_run[i] not in out.token_ids[: i + 2]


def test_min_tokens_masks_the_eos_under_ignore_eos(llm: LLM) -> None:
    """vLLM's rule: ``min_tokens`` masks every stop token, the EOS included even under
    ``ignore_eos`` (its ``all_stop_token_ids``), so the first ``min_tokens`` outputs hold no
    EOS; after them the request goes on through EOS tokens (ignored)."""
    tokenizer = llm.engine.tokenizer
    assert tokenizer is not None and tokenizer.eos_token_id is not None
    eos = tokenizer.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=4, ignore_eos=True,
                            logit_bias={eos: 100.0})  # (the bias makes the EOS the argmax)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6
    assert eos not in out.token_ids[:4] and out.token_ids[4:] == [eos, eos]


def test_min_tokens_and_stop_strings(llm: LLM, free_run: list[int]) -> None:
    """vLLM's rule: with ``min_tokens=k`` a stop string that ends in the text of the first k
    tokens does not stop the request (it stopped on token k), nor does a longer stop string
    beside it make the next token's check look back into that text; with ``k - 1`` it
    stops on token k."""
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.decode(free_run[:k]) for k in range(17)]
    full = texts[16]
    k, stop = next((k, texts[k][-1]) for k in range(2, 8)
                   if len(texts[k - 1]) < len(texts[k]) < len(texts[k + 1])
                   and full.count(texts[k][-1]) == 1 and texts[k][-1] != "\ufffd")
    for stops in ([stop], [stop, "a stop string longer than the rest"]):
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=stops,
                                min_tokens=k)
        out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.text, out.finish_reason) == (free_run, full, "length")
        params.min_tokens = k - 1
        out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        assert (out.token_ids, out.text) == (free_run[:k], texts[k][:-1])
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_the_tokenizers_eos_stops_with_no_stop_reason(llm: LLM) -> None:
    """vLLM's check: the tokenizer's EOS first (no stop_reason), even when it is also a stop
    token; under ignore_eos a stop token that is the EOS is named."""
    tokenizer = llm.engine.tokenizer
    assert tokenizer is not None and tokenizer.eos_token_id is not None
    eos = tokenizer.eos_token_id
    for extra, want in (({}, None), ({"stop_token_ids": [eos]}, None),
                        ({"stop_token_ids": [eos], "ignore_eos": True}, eos)):
        out = llm.generate(PROMPT, SamplingParams(max_tokens=4, allowed_token_ids=[eos],
                                                  **extra), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == [eos]
        assert (out.finish_reason, out.stop_reason) == ("stop", want)


def test_eos_from_generation_config(ckpt: Path, free_run: list[int], tmp_path: Path) -> None:
    i = _first_new(free_run, 3)
    copy = tmp_path / "ckpt"
    shutil.copytree(ckpt, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [free_run[i]]}))
    llm = LLM(str(copy), device="cpu", dtype="float32", block_size=4)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run[: i + 1]
    # vLLM's: an EOS only the configs name is one of the stop tokens, named as stop_reason
    # (the tokenizer's own EOS stops with none)
    assert llm.engine.tokenizer is not None and llm.engine.tokenizer.eos_token_id != free_run[i]
    assert (out.finish_reason, out.stop_reason) == ("stop", free_run[i])
    ignoring = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert ignoring.outputs[0].token_ids == free_run


def test_stop_string_across_tokens(llm: LLM, free_run: list[int]) -> None:
    tokenizer = llm.get_tokenizer()
    full = tokenizer.decode(free_run)
    stop, at = _straddling_stop([tokenizer.decode(free_run[:k]) for k in range(17)], full)
    params = SamplingParams(temperature=0, max_tokens=16, stop=[stop], ignore_eos=True)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.text == full[:at]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(out.token_ids) < len(free_run)  # stopped early
    kept = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, stop=[stop],
                                               include_stop_str_in_output=True, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full[: at + len(stop)]


def test_stop_string_of_byte_fallback_tokens(tmp_path: Path) -> None:
    """A stop string a byte-fallback token makes (Llama-2's "\\n" is ``<0x0A>``) stops the
    request on that token: the detokenizer holds a byte run back until it ends, which must
    neither let the request run on (up to a whole run) nor put the stop string in the text."""
    from mrv2.bench.detokenize import sentencepiece_bpe

    tokenizer = sentencepiece_bpe()
    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=len(tokenizer))
    tokenizer.hf.save_pretrained(str(path))
    newline = int(tokenizer.hf.get_vocab()["<0x0A>"])
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=3, stop=["\n"],
                            allowed_token_ids=[newline])
    out = llm.generate("Hi", params, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.text) == ([newline], "")
    assert (out.finish_reason, out.stop_reason) == ("stop", "\n")


def test_a_sentencepiece_answer_keeps_its_leading_space(tmp_path: Path) -> None:
    """The output's text is decoded after the prompt's last tokens (vLLM's rule): a
    sentencepiece model's first word keeps its space ("is" + "▁Pa" + "ris" reads " Paris",
    not "Paris"), so prompt + output reads as the model wrote it."""
    from mrv2.bench.detokenize import sentencepiece_bpe

    tokenizer = sentencepiece_bpe()
    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=len(tokenizer))
    tokenizer.hf.save_pretrained(str(path))
    vocab = tokenizer.hf.get_vocab()
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4)
    prompt = "The capital of France is"
    for allowed, want in ((vocab["\u2581Pa"], " Pa"), (vocab["ris"], "ris")):
        params = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=[allowed])
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert out.text == want
    # after a prompt that ends in a byte-fallback run (Llama-2's "\n" is <0x0A>) too
    ids = tokenizer.encode(prompt + " 가")
    assert ids[-1] in tokenizer.byte_fallback_ids
    params = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=[vocab["\u2581Pa"]])
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    assert out.text == " Pa" == tokenizer.decode(ids + out.token_ids)[len(tokenizer.decode(ids)):]


def test_abort_frees_everything_and_spares_others(llm: LLM, free_run: list[int]) -> None:
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    keep = engine.add_request(tokenizer.encode(PROMPT), params)
    doomed = engine.add_request([5, 6, 7, 8, 9], params)
    waiting = engine.add_request([9, 9], params)
    engine.abort(waiting)  # aborted while waiting
    finished = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 3:
            engine.abort(doomed)  # aborted mid-decode
    assert finished == {keep: free_run}
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert len(engine.runner.table) == 0


def test_chat_uses_template(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.chat([{"role": "user", "content": "Hello"}], params, use_tqdm=False)[0]
    expected = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Hello"}])
    assert out.prompt_token_ids == expected
    assert out.prompt == "<|user|>Hello</s><|assistant|>"  # the rendered text, as vLLM's


def test_chat_text_parts_are_a_line_each(llm: LLM) -> None:
    """A conversation of text parts only renders as vLLM renders it for a string-content
    template (the server's chat route too): the parts' text, a line each (the template got
    the list of parts before: its repr, for a template that inserts the content)."""
    params = SamplingParams(temperature=0, max_tokens=1)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                          {"type": "text", "text": "world"}]}]
    out = llm.chat(parts, params, use_tqdm=False)[0]
    assert out.prompt == "<|user|>Hello\nworld</s><|assistant|>"


def test_chat_continues_the_final_message(llm: LLM) -> None:
    """vLLM's ``LLM.chat(continue_final_message=True)``: the reply goes on from the last
    (assistant) message, its end-of-turn left out; refused beside add_generation_prompt."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Pa"}]
    out = llm.chat(messages, params, use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False).endswith(
        "<|assistant|>Pa")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(messages, params, use_tqdm=False, continue_final_message=True)


def test_streaming_deltas_add_up(llm: LLM, free_run: list[int]) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    streamed = engine.add_request(llm.get_tokenizer().encode(PROMPT), params, stream=True)
    quiet = engine.add_request([5, 6, 7], params)
    deltas: list[list[int]] = []
    texts: list[str] = []
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == streamed:
                deltas.append(out.new_token_ids)
                texts.append(out.new_text)
            if out.finished:
                finals[out.request_id] = out
            else:
                assert out.request_id == streamed  # non-streaming requests: final output only
    assert len(deltas) == 10 and all(len(d) == 1 for d in deltas)
    assert [t for d in deltas for t in d] == finals[streamed].outputs[0].token_ids == free_run[:10]
    assert "".join(texts) == finals[streamed].outputs[0].text
    assert set(finals) == {streamed, quiet}


def test_stream_interval_sends_every_kth_token(ckpt: Path, free_run: list[int]) -> None:
    """``stream_interval=4``: a streamed request's first token at once, then an output each
    time four more are in, and its end whatever is left: 1, 4, 4, 1 tokens of 10; the deltas
    add up to the free run and its text. n=2 streams its merged choices the same way."""
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, stream_interval=4)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    streamed = engine.add_request(llm.get_tokenizer().encode(PROMPT), params, stream=True)
    pair = engine.add_request(llm.get_tokenizer().encode(PROMPT),
                              SamplingParams(top_k=1, max_tokens=10, ignore_eos=True, n=2),
                              stream=True)
    deltas: list[list[int]] = []
    texts: list[str] = []
    pair_lengths: list[list[int]] = []
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == streamed:
                deltas.append(out.new_token_ids)
                texts.append(out.new_text)
                final = out if out.finished else final
            else:
                assert out.request_id == pair
                pair_lengths.append([len(o.token_ids) for o in out.outputs])
    assert [len(d) for d in deltas] == [1, 4, 4, 1]
    assert final is not None and [t for d in deltas for t in d] == free_run[:10]
    assert final.outputs[0].token_ids == free_run[:10] and "".join(texts) == final.outputs[0].text
    assert pair_lengths[-1] == [10, 10]
    assert all(max(lengths) in (1, 5, 9, 10) for lengths in pair_lengths)


def _outputs(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]
             ) -> list[list[RequestOutput]]:
    """Every output of each request (added streamed), in the order they came."""
    ids = [engine.add_request(prompt, params, stream=True) for prompt, params in requests]
    got: dict[str, list[RequestOutput]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].append(out)
    return [got[i] for i in ids]


def _folded(outputs: list[RequestOutput]) -> RequestOutput:
    whole = copy.deepcopy(outputs[0])
    for out in outputs[1:]:
        whole.add(out)
    return whole


@pytest.mark.parametrize("include", [False, True])
def test_a_stream_never_shows_text_a_stop_string_cuts(llm: LLM, free_run: list[int],
                                                      include: bool) -> None:
    """A stop string across tokens: while the request runs its outputs keep back the last
    ``len(stop) - 1`` characters, so a cumulative output's text only grows, the deltas' texts
    add up to the final text, and that text is ``generate``'s (the stop string cut off, or
    kept with ``include_stop_str_in_output``, which needs no holding back)."""
    tokenizer = llm.get_tokenizer()
    full = tokenizer.decode(free_run)
    stop, at = _straddling_stop([tokenizer.decode(free_run[:k]) for k in range(17)], full)
    want = full[: at + (len(stop) if include else 0)]
    prompt = tokenizer.encode(PROMPT)
    runs = _outputs(llm.engine, [
        (prompt, SamplingParams(temperature=0, max_tokens=16, stop=[stop], ignore_eos=True,
                                include_stop_str_in_output=include, output_kind=kind))
        for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA)])
    cumulative, delta = runs
    texts = [o.outputs[0].text for o in cumulative]
    assert texts[-1] == want and len(cumulative) > 2
    assert all(want.startswith(t) for t in texts)  # never more than the answer
    assert "".join(o.new_text for o in cumulative) == want
    assert all(o.delta for o in delta) and not any(o.delta for o in cumulative)
    assert "".join(o.outputs[0].text for o in delta) == want
    assert [t for o in delta for t in o.outputs[0].token_ids] == cumulative[-1].outputs[0].token_ids


@pytest.mark.parametrize("interval", [1, 3])
def test_delta_outputs_add_up_to_the_cumulative_ones(ckpt: Path, interval: int) -> None:
    """The same seeded requests (sampled, logprobs and prompt logprobs; and n=2) as
    CUMULATIVE and as DELTA in one batch: each delta holds only the new tokens (its logprobs
    theirs, prompt logprobs in the first output only), and the deltas folded together
    (``RequestOutput.add``) equal the last cumulative output."""
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4,
              stream_interval=interval)
    prompt = llm.get_tokenizer().encode(PROMPT)
    requests = []
    for n in (1, 2):
        for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
            requests.append((prompt, SamplingParams(
                n=n, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, logprobs=2,
                prompt_logprobs=1, output_kind=kind)))
    runs = _outputs(llm.engine, requests)
    for cumulative, delta in (runs[0:2], runs[2:4]):
        assert all(o.delta for o in delta) and not any(o.delta for o in cumulative)
        assert delta[0].prompt_logprobs is not None
        assert all(o.prompt_logprobs is None for o in delta[1:])
        for out in delta:
            for c in out.outputs:
                assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
                assert len(c.token_ids) <= interval
        whole, last = _folded(delta), cumulative[-1]
        assert whole.finished and last.finished
        assert whole.prompt_logprobs == last.prompt_logprobs
        assert [(c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob,
                 c.finish_reason) for c in whole.outputs] == [
            (c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason)
            for c in last.outputs]
        assert len(last.outputs) == len(whole.outputs) == (1 if cumulative is runs[0] else 2)
        assert sum(len(o.outputs[0].token_ids) for o in delta) == sum(
            len(c.token_ids) for c in last.outputs)


def test_final_only_gives_one_output_even_streamed(llm: LLM, free_run: list[int]) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    (outs,) = _outputs(llm.engine, [(llm.get_tokenizer().encode(PROMPT), params)])
    assert len(outs) == 1 and outs[0].finished and outs[0].outputs[0].token_ids == free_run[:6]


def test_output_kind_is_checked() -> None:
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA  # type: ignore[arg-type]
    for bad in ("delta", 3, True, None):
        with pytest.raises(ValueError, match="output_kind"):
            SamplingParams(output_kind=bad)  # type: ignore[arg-type]


def test_outputs_of_two_kinds_do_not_fold() -> None:
    from mrv2.engine.outputs import CompletionOutput

    delta = RequestOutput("r", None, [1], [CompletionOutput(0, "a", [3])], False, delta=True)
    with pytest.raises(ValueError, match="delta"):
        delta.add(RequestOutput("r", None, [1], [CompletionOutput(0, "ab", [3, 4])], False))
    with pytest.raises(ValueError, match="'q'"):
        delta.add(RequestOutput("q", None, [1], [CompletionOutput(0, "b", [4])], False,
                                delta=True))
