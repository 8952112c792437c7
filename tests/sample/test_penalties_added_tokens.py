"""Logit bias and the repetition penalty on a token the tokenizer *added* (``add_tokens``: an
id past the trained vocabulary, within the model's logits) work as on any other id, as vLLM's
sampler: the bias first, then the penalty divides (or, for a negative logit, multiplies) the
biased logit of every token of the prompt or the output. An added token's text in a prompt is
tokenized to the added id, so such a prompt penalizes that token from the first step: with
``repetition_penalty=2``, ``logit_bias={fav: 80, added: 60}`` writes ``fav`` then ``added``
after a prompt without it (``(l + 80) / 2 < l' + 60``), but only ``fav`` after one that holds
it (``(l + 80) / 2 > (l' + 60) / 2``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

ADDED = ["</th", "ink>"]
MODEL_VOCAB = 320


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("added"), "LlamaForCausalLM",
                                vocab_size=MODEL_VOCAB)
    make_tiny_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.add_tokens(ADDED)  # plain added tokens (not special), after the trained vocabulary
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> LLM:
    return LLM(str(ckpt), device="cpu", dtype="float32", block_size=4)


@pytest.fixture(scope="module")
def hf(ckpt: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(ckpt),
                                                             dtype=torch.float32).eval()


def _vllm_greedy(hf: torch.nn.Module, prompt: list[int], params: SamplingParams) -> list[int]:
    """vLLM's greedy tokens stated directly: the raw logits plus the bias, then the repetition
    penalty on each token of the prompt or of the output so far, then the argmax."""
    assert params.logit_bias is not None and params.max_tokens is not None
    out: list[int] = []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            x = hf(torch.tensor([prompt + out])).logits[0, -1].float()
        for token, value in params.logit_bias.items():
            x[token] += value
        seen = torch.zeros(x.numel(), dtype=torch.bool)
        seen[prompt + out] = True
        rep = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        out.append(int(x.argmax()))
    return out


def test_a_biased_added_token_is_penalized_as_any_other(llm: LLM, hf: torch.nn.Module) -> None:
    """An added token and an ordinary one, each biased below a favourite, after a prompt
    without it and one with it (the added token's text, the ordinary token's id): the same
    tokens for both, those of vLLM's order (bias, then penalty over prompt and output)."""
    tok = llm.get_tokenizer()
    raw = tok.backend  # (tokenizers.Tokenizer)
    added = raw.token_to_id(ADDED[1])
    base = raw.get_vocab_size(with_added_tokens=False)
    assert base <= added < MODEL_VOCAB == llm.engine.vocab_size  # past the base, in the logits
    fav, plain = tok.encode("Paris", add_special_tokens=False)[0], 100
    free = tok.encode("Hi", add_special_tokens=False)
    spelled = tok.encode("Hi <think>", add_special_tokens=False)
    assert spelled[-1] == added  # the added token's text in a prompt is the added id
    assert not {fav, plain} & {*free, *spelled} and added not in free
    cases = [(added, free, [fav, added, fav, fav]), (added, spelled, [fav] * 4),
             (plain, free, [fav, plain, fav, fav]), (plain, free + [plain], [fav] * 4)]
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                             repetition_penalty=2.0, logit_bias={fav: 80.0, other: 60.0})
              for other, _, _ in cases]
    outs = llm.generate([{"prompt_token_ids": prompt} for _, prompt, _ in cases], params,
                        use_tqdm=False)
    for (_, prompt, want), p, out in zip(cases, params, outs, strict=True):
        got = out.outputs[0].token_ids
        assert got == want == _vllm_greedy(hf, prompt, p), (prompt, p.logit_bias)


def test_a_bias_past_the_models_logits_is_refused(llm: LLM) -> None:
    """A bias key the model has no logit for (an added token past its vocabulary) is refused
    naming the field, not dropped."""
    params = SamplingParams(max_tokens=2, logit_bias={llm.engine.vocab_size: 60.0})
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate({"prompt_token_ids": [5, 6]}, params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
