"""vLLM's ``SamplingParams`` rules that a request meets before it runs: a temperature in
(0, 0.01) raised to 0.01 with a warning, one above 2 refused; greedy with ``n > 1`` refused
(a beam search's ``n`` beams excepted); offline ``logit_bias`` taken at any finite value (the
server clamps a request's to [-100, 100])."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.engine.beam_search import BeamSearchParams
from mrv2.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest
from mrv2.testing import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    ckpt: Path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "LlamaForCausalLM")
    return LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, max_model_len=64)


@pytest.mark.parametrize("low", [1e-7, 0.001, 0.0099])
def test_a_temperature_below_a_hundredth_is_raised_to_it_with_a_warning(
        low: float, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mrv2"):
        params = SamplingParams(temperature=low)
    assert params.temperature == 0.01 and not params.greedy
    assert any("raised to 0.01" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mrv2"):
        for kept in (0.0, 0.01, 0.5, 2.0):  # (0 stays greedy; 2 is the highest)
            assert SamplingParams(temperature=kept).temperature == kept
    assert not caplog.records


@pytest.mark.parametrize("hot", [2.0001, 3, 100.0])
def test_a_temperature_above_two_is_refused(hot: float) -> None:
    with pytest.raises(ValueError, match=r"SamplingParams.temperature=.* \[0, 2\]"):
        SamplingParams(temperature=hot)
    with pytest.raises(ValueError, match=r"SamplingParams.temperature="):
        CompletionRequest(prompt="hi", temperature=hot).sampling_params()
    with pytest.raises(ValueError, match=r"BeamSearchParams.temperature="):
        BeamSearchParams(beam_width=2, max_tokens=3, temperature=hot)


def test_greedy_with_n_above_one_is_refused_naming_n() -> None:
    for temperature in (0, 0.0):
        with pytest.raises(ValueError, match=r"SamplingParams.n=2 is invalid: .*greedy"):
            SamplingParams(n=2, temperature=temperature)
    assert SamplingParams(n=1, temperature=0.0).greedy
    assert SamplingParams(n=2, temperature=0.001).n == 2  # (raised to 0.01: not greedy)
    for request in (CompletionRequest(prompt="hi", temperature=0, n=2),
                    ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                          temperature=0, n=2)):
        with pytest.raises(ValueError, match=r"SamplingParams.n=2"):
            request.sampling_params()


def test_a_greedy_beam_search_of_n_beams_is_no_greedy_n() -> None:
    """vLLM builds a beam search no SamplingParams: its n (the beam width) with temperature 0
    is taken, and still counts n sequences against the server's limits."""
    for request in (CompletionRequest(prompt="hi", temperature=0, n=3, use_beam_search=True),
                    ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                          temperature=0, n=3, use_beam_search=True)):
        params = request.sampling_params()
        assert request.sequences(params) == 3
        beams = request.beam_search_params(params, room=10)
        assert (beams.beam_width, beams.temperature) == (3, 0.0)
    sampled = CompletionRequest(prompt="hi", temperature=0.5, n=3)
    assert sampled.sequences(sampled.sampling_params()) == 3


def test_offline_logit_bias_takes_any_finite_value(llm: LLM) -> None:
    """vLLM's ``SamplingParams`` takes a bias outside [-100, 100] as given (only its server
    clamps); a bias of 1000 on a token outweighs any logit, so greedy picks it every time."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                            logit_bias={17: 1000.0, 3: -1e4})
    assert params.logit_bias == {17: 1000.0, 3: -1e4}
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == [17] * 4
    for bad in (float("nan"), float("inf"), 1e39):
        with pytest.raises(ValueError, match="SamplingParams.logit_bias="):
            SamplingParams(logit_bias={3: bad})
    served = CompletionRequest(prompt="hi", logit_bias={"17": 1000.0, "3": -1e4})
    assert served.sampling_params().logit_bias == {17: 100.0, 3: -100.0}  # (the server's)
