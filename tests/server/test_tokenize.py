"""``/tokenize``, ``/detokenize`` and ``/version`` (vLLM's routes): the ids a request would
send, text or chat; back to text; bad input is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import httpx
from server_util import API_KEY, MODEL, Served

from mrv2.engine.tokenizer import Tokenizer

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(server: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers=AUTH, timeout=30, json=body)


def test_tokenize_text_and_chat_as_a_request_would(server: Served) -> None:
    tok = Tokenizer.from_pretrained(server.model_dir)
    text = "The capital of France is"
    got = _post(server, "/tokenize", {"model": MODEL, "prompt": text}).json()
    assert got == {"count": len(tok.encode(text)), "max_model_len": server.engine.max_model_len,
                   "tokens": tok.encode(text), "token_strs": None}
    bare = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False,
                                       "return_token_strs": True}).json()
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False)
    assert bare["token_strs"] == tok.convert_ids_to_tokens(bare["tokens"])
    messages = [{"role": "user", "content": "Hello world!"}]
    chat = _post(server, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == tok.apply_chat_template(messages, True)
    no_prompt = _post(server, "/tokenize", {"messages": messages,
                                            "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == tok.apply_chat_template(messages, False)
    assert no_prompt["tokens"] != chat["tokens"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                          {"type": "text", "text": "world!"}]}]
    joined = [{"role": "user", "content": "Hello\nworld!"}]  # (vLLM's: a line a part)
    assert _post(server, "/tokenize", {"messages": parts}).json()["tokens"] == \
        tok.apply_chat_template(joined, True)


def test_detokenize_round_trips_and_version(server: Served) -> None:
    ids = _post(server, "/tokenize", {"prompt": "Hello world!",
                                      "add_special_tokens": False}).json()["tokens"]
    assert _post(server, "/detokenize", {"model": MODEL, "tokens": ids}).json() == {
        "prompt": "Hello world!"}
    version = httpx.get(f"{server.url}/version", headers=AUTH, timeout=30)
    assert version.status_code == 200 and version.json()["version"] == "0.1.0"


def test_bad_input_is_a_400_naming_the_field(server: Served) -> None:
    def error(path: str, body: dict[str, Any], status: int = 400) -> dict[str, Any]:
        response = _post(server, path, body)
        assert response.status_code == status, response.text
        return response.json()["error"]  # type: ignore[no-any-return]

    both = error("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "x"}]})
    assert both["param"] == "prompt" and "either prompt" in both["message"]
    assert error("/tokenize", {})["param"] == "prompt"
    assert error("/tokenize", {"prompt": 5})["param"] == "prompt"
    assert error("/tokenize", {"messages": []})["param"] == "messages"
    assert error("/tokenize", {"model": "other", "prompt": "hi"}, 404)["param"] == "model"
    vocab = server.engine.vocab_size
    out_of_range = error("/detokenize", {"tokens": [1, vocab]})
    assert out_of_range["param"] == "tokens" and f"0 <= id < {vocab}" in out_of_range["message"]
    assert error("/detokenize", {"tokens": [-1]})["param"] == "tokens"
    assert error("/detokenize", {"tokens": ["a"]})["param"].startswith("tokens")
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"},
                      timeout=30).status_code == 200  # no key: the key guards /v1/* (vLLM's)


THINKING = ("{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
            "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }} {% endif %}"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_chat_template_kwargs_reach_the_template(model_dir: Any) -> None:
    """vLLM's ``chat_template_kwargs`` (Qwen3's ``enable_thinking``) in chat completions and
    /tokenize, with the engine's ``--chat-template``; a reserved name is a 400 naming the
    field."""
    from conftest import serve

    messages = [{"role": "user", "content": "Hello world!"}]
    tok = Tokenizer.from_pretrained(model_dir)
    tok.set_chat_template(THINKING)
    for served in serve(model_dir, engine_kwargs={"chat_template": THINKING}):
        plain = _post(served, "/tokenize", {"messages": messages}).json()["tokens"]
        off = _post(served, "/tokenize", {"messages": messages,
                                          "chat_template_kwargs": {"enable_thinking": False}})
        assert plain == tok.encode("Hello world!", add_special_tokens=False)
        assert off.json()["tokens"] == tok.encode("/no_think Hello world!",
                                                  add_special_tokens=False)
        chat = _post(served, "/v1/chat/completions", {
            "messages": messages, "max_tokens": 2, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}})
        assert chat.status_code == 200
        assert chat.json()["usage"]["prompt_tokens"] == len(off.json()["tokens"])
        bad = _post(served, "/v1/chat/completions", {
            "messages": messages, "chat_template_kwargs": {"tokenize": True}})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "chat_template_kwargs"
        assert "'tokenize'" in bad.json()["error"]["message"]
        # OpenAI's reasoning_effort (gpt-oss's template reads it), in chat and Responses
        low = tok.encode("Reasoning: low Hello world!", add_special_tokens=False)
        for path, body in (("/v1/chat/completions", {"messages": messages,
                                                     "reasoning_effort": "low"}),
                           ("/v1/responses", {"input": "Hello world!",
                                              "reasoning": {"effort": "low"}})):
            answer = _post(served, path, {**body, "max_tokens": 2, "max_output_tokens": 2,
                                          "temperature": 0})
            assert answer.status_code == 200, answer.text
            usage = answer.json()["usage"]
            assert usage.get("prompt_tokens", usage.get("input_tokens")) == len(low)
        # vLLM's other efforts reach the template too; a summary (Codex CLI asks for "auto")
        # is taken and ignored, as vLLM's
        minimal = tok.encode("Reasoning: minimal Hello world!", add_special_tokens=False)
        for path, body in (("/v1/chat/completions", {"messages": messages,
                                                     "reasoning_effort": "minimal"}),
                           ("/v1/responses", {"input": "Hello world!", "reasoning": {
                               "effort": "minimal", "summary": "auto"}})):
            answer = _post(served, path, {**body, "max_tokens": 2, "max_output_tokens": 2,
                                          "temperature": 0})
            assert answer.status_code == 200, answer.text
            usage = answer.json()["usage"]
            assert usage.get("prompt_tokens", usage.get("input_tokens")) == len(minimal)
        bad = _post(served, "/v1/chat/completions", {"messages": messages,
                                                     "reasoning_effort": "extreme"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"


def test_vllms_sampling_extras_are_honoured_or_refused(server: Served) -> None:
    """``allowed_token_ids`` and ``bad_words`` reach the sampler, ``truncate_prompt_tokens``
    keeps the prompt's last tokens (``use_beam_search``: test_beam_search_api.py)."""
    body = {"prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 6, "temperature": 1.0, "seed": 3}
    allowed = _post(server, "/v1/completions", {**body, "allowed_token_ids": [11, 12]}).json()
    tok = Tokenizer.from_pretrained(server.model_dir)
    ids = tok.encode(allowed["choices"][0]["text"], add_special_tokens=False)
    assert set(ids) <= {11, 12}, ids
    truncated = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 2,
                                                  "temperature": 0}).json()
    short = _post(server, "/v1/completions", {**body, "prompt": [9, 10],
                                              "temperature": 0}).json()
    assert truncated["usage"]["prompt_tokens"] == 2
    assert truncated["choices"][0]["text"] == short["choices"][0]["text"]
    chat = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello world!"}], "max_tokens": 1,
        "truncate_prompt_tokens": 3}).json()
    assert chat["usage"]["prompt_tokens"] == 3
    bad = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens"


def test_truncate_prompt_tokens_minus_one_is_the_context(server: Served) -> None:
    """vLLM's ``truncate_prompt_tokens: -1``: keep the prompt's last max_model_len - max_tokens
    tokens (the request's own max_tokens), at most the longest prompt the engine takes
    (a pooling request's: max_model_len, as vLLM's); 0 and -2 are a
    400."""
    limit = server.engine.max_model_len
    long = [5 + i % 200 for i in range(limit + 6)]
    body = {"prompt": long, "max_tokens": 4, "temperature": 0}
    cut = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": -1})
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == limit - 4
    short = _post(server, "/v1/completions", {**body, "prompt": long[-(limit - 4):]}).json()
    assert cut.json()["choices"][0]["text"] == short["choices"][0]["text"]
    chat = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hello world! " * limit}], "max_tokens": 2,
        "truncate_prompt_tokens": -1})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == limit - 2
    unset = _post(server, "/v1/chat/completions", {  # (no max_tokens: the longest prompt)
        "messages": [{"role": "user", "content": "Hello world! " * limit}],
        "truncate_prompt_tokens": -1})
    assert unset.status_code == 200, unset.text
    assert unset.json()["usage"]["prompt_tokens"] == limit - 1
    for route in ("/v1/embeddings", "/pooling"):
        pooled = _post(server, route, {"input": long, "truncate_prompt_tokens": -1})
        assert pooled.status_code == 200, pooled.text
        assert pooled.json()["usage"]["prompt_tokens"] == limit  # (vLLM's: the context)
        assert pooled.json()["data"][0] == _post(server, route, {
            "input": long[-limit:]}).json()["data"][0]
    for k in (0, -2):
        for route, extra in (("/v1/completions", body), ("/v1/embeddings", {"input": long})):
            bad = _post(server, route, {**extra, "truncate_prompt_tokens": k})
            assert bad.status_code == 400, (route, k, bad.text)
            assert bad.json()["error"]["param"] == "truncate_prompt_tokens"


def test_a_pooling_cut_longer_than_the_context_is_refused(server: Served) -> None:
    """vLLM's pooling routes: ``truncate_prompt_tokens`` above max_model_len is a 400, however
    short the prompt (max_model_len itself is taken)."""
    limit = server.engine.max_model_len
    bodies: dict[str, dict[str, Any]] = {
        "/v1/embeddings": {"input": "Hello"}, "/pooling": {"input": "Hello"},
        "/classify": {"input": "Hello"}, "/v1/score": {"text_1": "Hello", "text_2": "world"},
        "/rerank": {"query": "Hello", "documents": ["world"]}}
    for route, body in bodies.items():
        bad = _post(server, route, {**body, "truncate_prompt_tokens": limit + 1})
        assert bad.status_code == 400, (route, bad.text)
        error = bad.json()["error"]
        assert error["param"] == "truncate_prompt_tokens", route
        assert "Please request a smaller truncation size." in error["message"]
    ok = _post(server, "/v1/embeddings", {"input": "Hello", "truncate_prompt_tokens": limit})
    assert ok.status_code == 200, ok.text


def test_a_generation_cut_longer_than_the_room_is_refused(server: Served) -> None:
    """vLLM's generation routes: ``truncate_prompt_tokens`` above max_model_len less the
    request's own max_tokens (max_completion_tokens; none given: the context) is a 400 naming
    it, however short the prompt; the bound itself is taken."""
    limit = server.engine.max_model_len
    cases: list[tuple[str, dict[str, Any], int, str]] = [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 4}, limit - 4, "max_tokens"),
        ("/v1/completions", {"prompt": [5, 6]}, limit - 16, "max_tokens"),  # (OpenAI's 16)
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                  "max_completion_tokens": 3}, limit - 3,
         "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 2}, limit - 2, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, limit,
         "max_model_len")]
    for route, body, most, named in cases:
        for extra in ({}, {"stream": True}):
            bad = _post(server, route, {**body, **extra, "truncate_prompt_tokens": most + 1})
            assert bad.status_code == 400, (route, body, bad.text)
            error = bad.json()["error"]
            assert error["param"] == "truncate_prompt_tokens", error
            assert f"truncate_prompt_tokens={most + 1}" in error["message"] or \
                f"({most + 1}) is greater than" in error["message"], error
            assert named in error["message"] and "smaller truncation size" in error["message"]
        ok = _post(server, route, {**body, "truncate_prompt_tokens": most})
        assert ok.status_code == 200, (route, body, ok.text)


def test_bad_words_never_come_out(server: Served) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    free = _post(server, "/v1/completions", body).json()["choices"][0]["text"]
    tok = Tokenizer.from_pretrained(server.model_dir)
    first = tok.decode(tok.encode(free, add_special_tokens=False)[:1])
    assert first.strip()  # the greedy text's first token is a word to ban
    banned = _post(server, "/v1/completions", {**body, "bad_words": [first.strip()]}).json()
    assert banned["choices"][0]["text"] != free


def test_continue_final_message_and_the_fields_this_server_refuses(server: Served) -> None:
    """vLLM's ``continue_final_message``: the prompt ends inside the last (assistant)
    message; it needs ``add_generation_prompt: false``; with ``echo`` the answer starts with
    that message's text, whole and streamed (vLLM's). ``tool_choice`` that asks for a tool
    (there are none) is refused by name."""
    messages = [{"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "The capital"}]
    tok = Tokenizer.from_pretrained(server.model_dir)
    text = tok.render_chat_template(messages, False, continue_final_message=True)
    assert text.endswith("The capital")
    got = _post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                      "continue_final_message": True}).json()
    assert got["tokens"] == tok.encode(text, add_special_tokens=False)
    chat = {"messages": messages, "max_tokens": 2}
    response = _post(server, "/v1/chat/completions", {
        **chat, "add_generation_prompt": False, "continue_final_message": True})
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == len(got["tokens"])
    cont = {**chat, "add_generation_prompt": False, "continue_final_message": True,
            "temperature": 0, "ignore_eos": True}
    plain = _post(server, "/v1/chat/completions", cont).json()["choices"][0]["message"]
    echoed = _post(server, "/v1/chat/completions", {**cont, "echo": True}).json()
    assert echoed["choices"][0]["message"]["content"] == "The capital" + plain["content"]
    streamed = ""
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, **cont, "echo": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    streamed += c["delta"].get("content") or ""
    assert streamed == echoed["choices"][0]["message"]["content"]
    for extra in ({"continue_final_message": True}, {"tool_choice": "required"}):
        response = _post(server, "/v1/chat/completions", {**chat, **extra})
        assert response.status_code == 400, extra
        assert next(iter(extra)) in response.json()["error"]["message"]
    assert _post(server, "/v1/chat/completions", {**chat, "tool_choice": "none"}
                 ).status_code == 200


#: What a message carries into the template, each field shown where the message has it.
FIELDS = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}"
          "{% if m.name is defined %}:{{ m.name }}{% endif %}]"
          "{% if m.reasoning_content is defined %}<r>{{ m.reasoning_content }}|"
          "{{ m.reasoning }}</r>{% endif %}{{ m['content'] }}"
          "{% for c in m.tool_calls or [] %}{{ c.function.name }}"
          "({{ c.function.arguments.city }}){% endfor %}{% endfor %}"
          "{% for d in documents or [] %}<doc>{{ d.title }}: {{ d.text }}</doc>{% endfor %}"
          "{% if add_generation_prompt %}>{% endif %}")


def _bos_model(path: Any) -> Any:
    """The tiny checkpoint whose tokenizer adds ``<s>`` (id 0) in front of a text, as Llama's."""
    from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

    make_tiny_checkpoint(path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(path)
    file = path / "tokenizer.json"
    data = json.loads(file.read_text())
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}}
    file.write_text(json.dumps(data))
    return path


def test_messages_reach_the_template_as_vllm_gives_them(tmp_path: Any) -> None:
    """vLLM's rendering of chat messages: an earlier assistant turn's ``reasoning_content``
    (or ``reasoning``) under both names, its calls' JSON-text ``arguments`` as objects,
    ``name``, the ``developer`` role as sent; the request's ``documents`` reach the template;
    the BOS the template writes is the only one (chat: no special tokens added, vLLM's
    default), while a completion adds it unless ``add_special_tokens: false``; a
    ``chat_template`` in the body is refused (vLLM without --trust-request-chat-template)."""
    from conftest import serve

    model = _bos_model(tmp_path)
    tok = Tokenizer.from_pretrained(model)
    assert tok.encode("Paris")[0] == 0  # (the tokenizer adds BOS)
    call = {"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Weather?", "name": "ann"},
                {"role": "assistant", "content": "", "reasoning_content": "look it up",
                 "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
                {"role": "assistant", "content": "Sunny.", "reasoning": "easy"},
                {"role": "user", "content": "Thanks"}]
    documents = [{"title": "Paris", "text": "It is sunny."}]
    text = ("<s>[developer]Be brief.[user:ann]Weather?[assistant]<r>look it up|look it up</r>"
            "weather(Paris)[tool]sunny[assistant]<r>easy|easy</r>Sunny.[user]Thanks")
    for served in serve(model, engine_kwargs={"chat_template": FIELDS, "max_model_len": 256}):
        got = _post(served, "/tokenize", {"messages": messages}).json()["tokens"]
        assert got == tok.encode(text + ">", add_special_tokens=False)
        assert got.count(0) == 1
        chat = _post(served, "/v1/chat/completions", {
            "messages": messages, "documents": documents, "max_tokens": 1})
        assert chat.status_code == 200, chat.text
        with_docs = text + "<doc>Paris: It is sunny.</doc>>"
        assert chat.json()["usage"]["prompt_tokens"] == len(
            tok.encode(with_docs, add_special_tokens=False))
        # vLLM's add_special_tokens (chat and chat /tokenize: off by default): the BOS on top
        bos = _post(served, "/tokenize", {"messages": messages, "add_special_tokens": True})
        assert bos.json()["tokens"] == [0, *got]
        for extra, count in (({}, 0), ({"add_special_tokens": True}, 1)):
            chat = _post(served, "/v1/chat/completions", {
                "messages": messages, "max_tokens": 1, **extra})
            assert chat.status_code == 200, chat.text
            assert chat.json()["usage"]["prompt_tokens"] == len(got) + count, extra
        for path in ("/v1/chat/completions", "/tokenize"):
            own = _post(served, path, {"messages": messages, "max_tokens": 1,
                                       "chat_template": "{{ messages[0]['content'] }}"})
            assert own.status_code == 400, own.text
            assert own.json()["error"]["param"] == "chat_template"
        prompt = "<s>The capital"
        for extra, count in (({}, len(tok.encode(prompt))),
                             ({"add_special_tokens": False},
                              len(tok.encode(prompt, add_special_tokens=False)))):
            done = _post(served, "/v1/completions", {"prompt": prompt, "max_tokens": 1, **extra})
            assert done.status_code == 200, done.text
            assert done.json()["usage"]["prompt_tokens"] == count, extra
        assert len(tok.encode(prompt)) == len(tok.encode(prompt, add_special_tokens=False)) + 1


def test_trust_request_chat_template_renders_the_requests_template(model_dir: Any) -> None:
    """vLLM's ``--trust-request-chat-template``: a request's own ``chat_template`` is
    rendered instead of the model's, in chat completions and chat /tokenize (with the
    request's ``chat_template_kwargs``); a request without one keeps the model's."""
    from conftest import serve

    messages = [{"role": "user", "content": "Hello world!"}]
    own = "{% if shout is defined %}HEY {% endif %}{{ messages[0]['content'] }} ok"
    tok = Tokenizer.from_pretrained(model_dir)
    want = tok.encode("HEY Hello world! ok", add_special_tokens=False)
    for served in serve(model_dir, trust_request_chat_template=True):
        got = _post(served, "/tokenize", {"messages": messages, "chat_template": own,
                                          "chat_template_kwargs": {"shout": True}})
        assert got.status_code == 200, got.text
        assert got.json()["tokens"] == want
        chat = _post(served, "/v1/chat/completions", {
            "messages": messages, "max_tokens": 1, "chat_template": own,
            "chat_template_kwargs": {"shout": True}})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == len(want)
        plain = _post(served, "/tokenize", {"messages": messages}).json()["tokens"]
        assert plain == tok.apply_chat_template(messages, True)
