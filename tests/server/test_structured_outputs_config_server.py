"""vLLM's ``structured_outputs_config.reasoning_parser`` through the Python API's server
(``create_app``): the engine config's parser is the server's; one that disagrees with
``reasoning_parser`` is refused."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from server_util import API_KEY

from mrv2 import EngineConfig

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def test_the_engine_configs_reasoning_parser_splits_chat_answers(model_dir: Path) -> None:
    """deepseek_r1 (no ``</think>`` in a random model's text): all of it is reasoning."""
    from conftest import serve

    body = {"messages": [{"role": "user", "content": "Hello world!"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    config = {"structured_outputs_config": {"reasoning_parser": "deepseek_r1"}}
    for served in serve(model_dir, engine_kwargs=config):
        message = httpx.post(f"{served.url}/v1/chat/completions", headers=AUTH, timeout=60,
                             json=body).json()["choices"][0]["message"]
        assert message["content"] is None and message["reasoning_content"], message


def test_a_reasoning_parser_that_disagrees_is_refused() -> None:
    from mrv2.entrypoints.server import create_app

    engine = SimpleNamespace(config=EngineConfig.from_kwargs(
        structured_outputs_config={"reasoning_parser": "qwen3"}))
    with pytest.raises(ValueError, match="disagree"):
        create_app(engine, reasoning_parser="deepseek_r1")  # type: ignore[arg-type]
