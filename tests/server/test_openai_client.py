"""The official ``openai`` client against the server: completions, chat, streaming, logprobs."""

from __future__ import annotations

import pytest
from server_util import API_KEY, ENGINE_KWARGS, MODEL, Served

from mrv2 import LLM, SamplingParams

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def client(server: Served) -> object:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def test_models(client: object) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]  # type: ignore[attr-defined]


def test_completion_and_usage(client: object) -> None:
    out = client.completions.create(  # type: ignore[attr-defined]
        model=MODEL, prompt="Hello world", max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5
    assert isinstance(out.choices[0].text, str)


def test_completion_list_and_token_prompts(client: object) -> None:
    out = client.completions.create(  # type: ignore[attr-defined]
        model=MODEL, prompt=["Hello", "The capital"], max_tokens=3, n=2, seed=3,
        extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 12
    out = client.completions.create(  # type: ignore[attr-defined]
        model=MODEL, prompt=[5, 6, 7], max_tokens=2, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 2


def test_chat(client: object) -> None:
    out = client.chat.completions.create(  # type: ignore[attr-defined]
        model=MODEL, messages=[{"role": "user", "content": "Hello"}],
        max_completion_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 4


def test_stream_completion_matches_non_stream(client: object) -> None:
    kwargs = dict(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0.8, seed=7,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)  # type: ignore[attr-defined]
    chunks = list(client.completions.create(  # type: ignore[attr-defined]
        stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_stream_chat_n2_usage(client: object) -> None:
    chunks = list(client.chat.completions.create(  # type: ignore[attr-defined]
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, n=2,
        seed=1, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    assert chunks[-1].usage.completion_tokens == 10


def test_logprobs(client: object) -> None:
    out = client.completions.create(  # type: ignore[attr-defined]
        model=MODEL, prompt="Hello", max_tokens=4, logprobs=3, temperature=0,
        extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) >= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(  # type: ignore[attr-defined]
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 for c in content)
    streamed = list(client.chat.completions.create(  # type: ignore[attr-defined]
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, stream=True,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}))
    n = sum(len(c.choices[0].logprobs.content) for c in streamed
            if c.choices and c.choices[0].logprobs)
    assert n == 3


def test_server_equals_llm_generate(server: Served, client: object) -> None:
    prompts = ["Hello world", "The capital of France"]
    llm = LLM(str(server.model_dir), **ENGINE_KWARGS)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.9, top_k=20, seed=100 + i, max_tokens=8,
                                ignore_eos=True, logprobs=0)
        want = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        out = client.completions.create(  # type: ignore[attr-defined]
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0.9, seed=100 + i,
            logprobs=0, extra_body={"ignore_eos": True, "top_k": 20})
        got = out.choices[0].logprobs.tokens
        assert len(got) == len(want)
        tok = llm.get_tokenizer()
        assert got == [tok.decode([t], skip_special_tokens=False) for t in want]
