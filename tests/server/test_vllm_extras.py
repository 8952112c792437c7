"""vLLM's extras of the OpenAI API: completions' ``echo`` and ``prompt_logprobs`` (the
prompt's text before the answer, its tokens' logprobs, the engine's as ``LLM.generate``
returns them, first in ``logprobs`` and in ``prompt_logprobs``, whole and streamed); chat's
``prompt_logprobs`` at the top of the answer and ``echo`` only where the last message has the
answer's role; ``stream_options.continuous_usage_stats``; ``return_token_ids`` and
``return_tokens_as_token_ids``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, ENGINE_KWARGS, MODEL, Served

from mrv2 import LLM, SamplingParams

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(url: str, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json={"model": MODEL, **body}, headers=AUTH,
                      timeout=60)


def _chunks(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    got = []
    with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "stream": True, **body}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                got.extend(json.loads(line[6:])["choices"])
    return got


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> LLM:
    return LLM(str(model_dir), **{k: v for k, v in ENGINE_KWARGS.items()
                                  if k not in ("num_gpu_blocks_override", "max_num_seqs")})


PROMPT = [5, 9, 3, 17, 4]


def test_prompt_logprobs_are_the_engines(server: Served, reference: LLM) -> None:
    want = reference.generate(
        {"prompt_token_ids": PROMPT},  # type: ignore[arg-type]
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2),
        use_tqdm=False)[0]
    assert want.prompt_logprobs is not None and len(want.prompt_logprobs) == len(PROMPT)
    choice = _post(server.url, "completions", {"prompt": PROMPT, "max_tokens": 3,
                                               "temperature": 0, "ignore_eos": True,
                                               "prompt_logprobs": 2}).json()["choices"][0]
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(PROMPT)
    for token, mine, theirs in zip(PROMPT[1:], got[1:], want.prompt_logprobs[1:], strict=True):
        assert theirs is not None and str(token) in mine
        assert {int(t): v["rank"] for t, v in mine.items()} == {
            t: lp.rank for t, lp in theirs.items()}
        assert {int(t): v["logprob"] for t, v in mine.items()} == pytest.approx(
            {t: lp.logprob for t, lp in theirs.items()}, abs=1e-5)
    assert choice["text"] == want.outputs[0].text  # (no echo: the answer only)


def test_echo_puts_the_prompt_and_its_logprobs_first(server: Served) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logprobs": 1}
    plain = _post(server.url, "completions", body).json()["choices"][0]
    echoed = _post(server.url, "completions", {**body, "echo": True}).json()["choices"][0]
    tokenizer = server.engine.tokenizer
    assert tokenizer is not None
    prompt_text = tokenizer.decode(PROMPT, False)
    assert echoed["text"] == prompt_text + plain["text"]
    lp, plain_lp = echoed["logprobs"], plain["logprobs"]
    n = len(PROMPT)
    assert lp["tokens"][n:] == plain_lp["tokens"]
    assert lp["token_logprobs"][n:] == plain_lp["token_logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:n])
    assert lp["tokens"][0] == tokenizer.decode([PROMPT[0]], False)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    # echo + logprobs asks for the prompt's logprobs too (vLLM's rule): the same values
    prompt_lps = echoed["prompt_logprobs"]
    assert [None] + [p[str(t)]["logprob"] for t, p in zip(PROMPT[1:], prompt_lps[1:],
                                                            strict=True)] \
        == lp["token_logprobs"][:n]


def test_echoed_prompt_top_logprobs_hold_logprobs_plus_one_entries(server: Served) -> None:
    """With ``echo``, ``logprobs: 1`` and a larger ``prompt_logprobs`` an echoed prompt
    position's ``top_logprobs`` holds 2 entries (the token's, then the top one), as vLLM's
    (``num_output_top_logprobs >= i``); ``prompt_logprobs`` keeps all of them."""
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "echo": True, "prompt_logprobs": 3}
    choice = _post(server.url, "completions", body).json()["choices"][0]
    tops = choice["logprobs"]["top_logprobs"]
    for top, full in zip(tops[1:], choice["prompt_logprobs"][1:], strict=False):
        assert len(full) >= 3 and len(top) == 2
        assert list(top.values()) == [e["logprob"] for e in list(full.values())[:2]]
    assert all(len(top) <= 2 for top in tops[len(PROMPT):])


def test_echo_with_max_tokens_0_answers_the_prompt_alone(server: Served) -> None:
    """OpenAI's legacy scoring (vLLM's ``echo_without_generation``): ``echo`` with
    ``max_tokens: 0`` gives each choice the prompt's text and its tokens' logprobs, no answer,
    whole and streamed; without ``echo`` 0 is a 400 naming max_tokens."""
    body = {"prompt": PROMPT, "max_tokens": 0, "temperature": 0, "logprobs": 1, "echo": True}
    scored = _post(server.url, "completions", body).json()["choices"][0]
    with_answer = _post(server.url, "completions", {**body, "max_tokens": 1}).json()
    answer = with_answer["choices"][0]
    n = len(PROMPT)
    tokenizer = server.engine.tokenizer
    assert tokenizer is not None
    assert scored["text"] == tokenizer.decode(PROMPT, False)
    assert answer["text"].startswith(scored["text"]) and len(answer["logprobs"]["tokens"]) == n + 1
    assert scored["logprobs"] == {key: value[:n] for key, value in answer["logprobs"].items()}
    assert scored["finish_reason"] == "length"
    chunks = _chunks(server.url, body)
    assert "".join(c["text"] for c in chunks) == scored["text"]
    assert [t for c in chunks for t in c["logprobs"]["tokens"]] == scored["logprobs"]["tokens"]
    bad = _post(server.url, "completions", {"prompt": PROMPT, "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_a_streamed_echo_equals_the_whole_answer(server: Served) -> None:
    # (top_k 1: greedy's answer, for n 2 too: greedy itself takes n 1 only, as vLLM's)
    body = {"prompt": "Hello world", "max_tokens": 4, "top_k": 1, "ignore_eos": True,
            "echo": True, "logprobs": 1, "n": 2}
    whole = _post(server.url, "completions", body).json()["choices"]
    chunks = _chunks(server.url, body)
    for choice in whole:
        mine = [c for c in chunks if c["index"] == choice["index"]]
        assert mine[0]["text"].startswith("Hello world")
        assert "".join(c["text"] for c in mine) == choice["text"]
        tokens = [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]]
        offsets = [t for c in mine if c["logprobs"] for t in c["logprobs"]["text_offset"]]
        assert tokens == choice["logprobs"]["tokens"]
        assert offsets == choice["logprobs"]["text_offset"]
        assert mine[0]["prompt_logprobs"] == choice["prompt_logprobs"]
        assert all("prompt_logprobs" not in c for c in mine[1:])


def test_chat_prompt_logprobs_and_echo(server: Served) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "temperature": 0, "ignore_eos": True}
    answer = _post(server.url, "chat/completions", {**body, "prompt_logprobs": 0}).json()
    prompt = answer["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == answer["usage"]["prompt_tokens"]
    assert all(len(p) == 1 for p in prompt[1:])  # k=0: the prompt token's own only
    # echo: the last message is the user's, not the answer's role: nothing is put before it
    plain = _post(server.url, "chat/completions", body).json()["choices"][0]["message"]
    echoed = _post(server.url, "chat/completions", {**body, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == plain["content"]
    bad = _post(server.url, "completions", {"prompt": PROMPT, "prompt_logprobs": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_continuous_usage_stats(server: Served, route: str) -> None:
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries its choice's
    usage so far (the prompt's tokens, the choice's tokens up to that chunk), the last usage
    chunk the totals; without it chunks carry none."""
    body: dict[str, Any] = {"max_tokens": 5, "ignore_eos": True, "n": 2, "stream": True}
    body.update({"prompt": PROMPT} if route == "completions" else
                {"messages": [{"role": "user", "content": "Hi"}]})
    chunks = []
    for options in ({"include_usage": True, "continuous_usage_stats": True},
                    {"include_usage": True}):
        got = []
        with httpx.stream("POST", f"{server.url}/v1/{route}", headers=AUTH, timeout=60,
                          json={"model": MODEL, **body, "stream_options": options}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got.append(json.loads(line[6:]))
        chunks.append(got)
    continuous, plain = chunks
    total = continuous[-1]["usage"]
    assert not continuous[-1]["choices"] and total["completion_tokens"] == 10
    assert all("usage" not in c for c in plain[:-1]) and plain[-1]["usage"] == total
    seen: dict[int, int] = {}
    for chunk in continuous[:-1]:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == total["prompt_tokens"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["completion_tokens"] >= seen.get(choice["index"], 0)
        seen[choice["index"]] = usage["completion_tokens"]
    assert seen == {0: 5, 1: 5}



def test_return_token_ids_whole_and_streamed(server: Served, reference: LLM) -> None:
    """vLLM's ``return_token_ids``: the prompt's ids and each choice's beside its text (the
    engine's own, as ``LLM.generate`` gives them), streamed as the prompt's in the first
    chunk and each chunk's new ids; ``return_tokens_as_token_ids`` names logprobs' tokens
    by id."""
    want = reference.generate({"prompt_token_ids": PROMPT},  # type: ignore[arg-type]
                              SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0].token_ids
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 1, "return_tokens_as_token_ids": True}
    choice = _post(server.url, "completions", body).json()["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT and choice["token_ids"] == want
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in want]
    chunks = _chunks(server.url, body)
    assert chunks[0]["prompt_token_ids"] == PROMPT
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == want
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    answer = _post(server.url, "chat/completions", chat).json()
    assert len(answer["prompt_token_ids"]) == answer["usage"]["prompt_tokens"]
    ids = answer["choices"][0]["token_ids"]
    assert len(ids) == 4
    streamed, prompt_ids = [], []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, **chat, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                prompt_ids.append(chunk.get("prompt_token_ids"))
                streamed += [t for c in chunk["choices"] for t in c.get("token_ids", [])]
    assert streamed == ids
    assert prompt_ids[0] == answer["prompt_token_ids"] and not any(prompt_ids[1:])
    plain = _post(server.url, "completions", {"prompt": PROMPT, "max_tokens": 2}).json()
    assert "token_ids" not in plain["choices"][0]


def test_logprobs_past_a_float_are_clamped_as_vllm_clamps_them() -> None:
    """-inf (a token no sampling can give) and NaN are not JSON: every logprob field shows
    them as -9999.0 (vLLM's clamp), so the answer stays valid JSON."""
    import json
    import math

    from mrv2.engine.outputs import Logprob
    from mrv2.entrypoints.openai_logprobs import (
        chat_logprobs,
        completion_logprobs,
        prompt_logprobs_body,
    )

    pos = {5: Logprob(-math.inf, 2, "a"), 6: Logprob(-0.25, 1, "b"),
           7: Logprob(math.nan, 3, "c")}
    bodies = [completion_logprobs([pos, pos], [5, 7], 0)[0], chat_logprobs([pos], [5], 3),
              prompt_logprobs_body([None, pos])]
    text = json.dumps(bodies, allow_nan=False)  # (raised ValueError before)
    assert "-9999.0" in text and "-0.25" in text
    completion = bodies[0]
    assert completion["token_logprobs"] == [-9999.0, -9999.0]
    assert completion["top_logprobs"][0] == {"a": -9999.0, "b": -0.25, "c": -9999.0}


def test_spaces_between_special_tokens_is_taken(server: Served) -> None:
    """vLLM's request field reaches the SamplingParams (it was ignored); a byte-level BPE
    decoder puts no space between special tokens, so for this tokenizer False changes nothing
    (what it drops elsewhere: test_detokenizer)."""
    from mrv2.entrypoints.openai_protocol import CompletionRequest

    fields = {"prompt": PROMPT, "spaces_between_special_tokens": False}
    assert not CompletionRequest.model_validate(fields).sampling_params() \
        .spaces_between_special_tokens
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "allowed_token_ids": [0, 2, 3],
            "skip_special_tokens": False, "return_token_ids": True}
    texts = []
    for spaces in (True, False):
        choice = _post(server.url, "completions",
                       {**body, "spaces_between_special_tokens": spaces}).json()["choices"][0]
        texts.append(choice["text"])
    tokenizer = server.engine.tokenizer
    assert tokenizer is not None
    assert texts[0] == texts[1] == tokenizer.decode(choice["token_ids"], False)
    bad = _post(server.url, "chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                 "spaces_between_special_tokens": "no"})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "spaces_between_special_tokens"
