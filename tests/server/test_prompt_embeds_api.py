"""``/v1/completions``' ``prompt_embeds`` (vLLM's, ``--enable-prompt-embeds``): each the base64
of a ``torch.save``'d ``[length, hidden_size]`` tensor, one or a list, beside ``prompt`` or
alone (answered first); with the engine on a thread or in its own process. Every bad input is
a 400 naming the field, and the server keeps answering; with the flag off, a 400 naming it."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_util import API_KEY, MODEL, Served

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEXT = "the lazy dog jumps over"


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "max_tokens": 5, "temperature": 0, **body})


def _b64(obj: Any) -> str:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def _texts(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def _embeds_of(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """Rows of the checkpoint's own embedding table (what the engine embeds ``ids`` as)."""
    from safetensors.torch import load_file

    weights = load_file(str(next(model_dir.glob("*.safetensors"))))
    return weights["model.embed_tokens.weight"][torch.tensor(ids)].to(torch.float32)


@pytest.fixture(scope="module", params=["thread", "process"])
def enabled(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[str]:
    if request.param == "thread":
        from conftest import serve

        for served in serve(model_dir, {"enable_prompt_embeds": True}):
            yield served.url
    else:
        from test_engine_process import _remote

        for url, _ in _remote(model_dir, enable_prompt_embeds=True):
            yield url


def test_embeddings_answer_as_their_tokens_do(enabled: str, model_dir: Path) -> None:
    import transformers

    ids = transformers.AutoTokenizer.from_pretrained(str(model_dir)).encode(TEXT)
    want = _texts(_post(enabled, {"prompt": ids}))
    embeds = _embeds_of(model_dir, ids)
    r = _post(enabled, {"prompt_embeds": _b64(embeds)})
    assert _texts(r) == want
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    # a list of them with prompts: the embeddings' answers first (vLLM's order)
    other = _texts(_post(enabled, {"prompt": "another one"}))
    mixed = _post(enabled, {"prompt": ["another one"],
                            "prompt_embeds": [_b64(embeds), _b64(embeds.to(torch.bfloat16))]})
    texts = _texts(mixed)
    assert texts[0] == want[0] and texts[2] == other[0] and len(texts) == 3
    streamed = httpx.post(f"{enabled}/v1/completions", headers=AUTH, timeout=60, json={
        "model": MODEL, "max_tokens": 5, "temperature": 0, "stream": True,
        "prompt_embeds": _b64(embeds)})
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text


def _bad_inputs() -> list[tuple[dict[str, Any], str, str]]:
    """(body, the error's param, a piece of its message)."""
    good = _b64(torch.zeros(3, 64))
    return [
        ({"prompt_embeds": "not base64!"}, "prompt_embeds", "not valid base64"),
        ({"prompt_embeds": base64.b64encode(b"junk").decode()}, "prompt_embeds",
         "not a torch.save'd tensor"),
        ({"prompt_embeds": _b64({"a": torch.zeros(2, 64)})}, "prompt_embeds",
         "must be a torch.Tensor"),
        ({"prompt_embeds": _b64(torch.zeros(3, 64, dtype=torch.int32))}, "prompt_embeds",
         "must be float32, bfloat16 or float16"),
        ({"prompt_embeds": _b64(torch.zeros(64))}, "prompt_embeds", "must be a 2-D tensor"),
        ({"prompt_embeds": _b64(torch.zeros(3, 48))}, "prompt_embeds",
         "hidden size 48; the model's is 64"),
        ({"prompt_embeds": _b64(torch.zeros(0, 64))}, "prompt_embeds", "is empty"),
        ({"prompt_embeds": _b64(torch.zeros(64, 64))}, "prompt_embeds",
         "max_model_len=64"),
        ({"prompt_embeds": [good, _b64(torch.full((2, 64), float("nan")))]}, "prompt_embeds",
         "prompt_embeds[1] holds non-finite"),
        ({"prompt_embeds": []}, "prompt_embeds", "empty list"),
        ({"prompt_embeds": good, "echo": True}, "echo", "not with prompt_embeds"),
        ({"prompt_embeds": good, "use_beam_search": True}, "use_beam_search",
         "not with prompt_embeds"),
        ({"prompt_embeds": good, "truncate_prompt_tokens": 2}, "truncate_prompt_tokens",
         "not with prompt_embeds"),
        ({"prompt_embeds": good, "prompt_logprobs": 1}, "prompt_logprobs",
         "not with prompt_embeds"),
        ({"prompt_embeds": _b64(torch.zeros(40, 64)), "max_tokens": 30}, "max_tokens", ""),
    ]


def test_bad_inputs_are_400s_naming_the_field(enabled: str) -> None:
    for body, param, message in _bad_inputs():
        r = _post(enabled, body)
        assert r.status_code == 400, (body.keys(), r.text)
        error = r.json()["error"]
        assert error["param"] == param, (param, error)
        assert message in error["message"], (message, error)
    assert _texts(_post(enabled, {"prompt_embeds": _b64(torch.zeros(3, 64))}))  # (still serving)


def test_flag_off_names_the_flag(server: Served) -> None:
    r = _post(server.url, {"prompt_embeds": _b64(torch.zeros(3, 64))})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt_embeds" and "--enable-prompt-embeds" in error["message"]
    r = _post(server.url, {"max_tokens": 2})  # neither prompt nor prompt_embeds
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
