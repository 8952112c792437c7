"""Helpers for tests that run the engine (above :mod:`mrv2.engine`, beside the lower
:mod:`mrv2.testing`): the tokens an ``LLM`` generates at each tensor-parallel size, and the
check every image family runs against HF transformers (:func:`check_images_against_hf`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from mrv2.contract.params import SamplingParams
from mrv2.engine.llm import LLM

__all__ = ["HfInputs", "check_images_against_hf", "tokens_at_tp"]


def tokens_at_tp(path: str | Path, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 tp_sizes: Iterable[int] = (1, 2), **llm_kwargs: Any) -> dict[int, list[list[int]]]:
    """``{tp: each prompt's generated token ids}`` of the checkpoint at ``path``, one engine per
    tensor-parallel size (on the CPU in fp32 with 4-token blocks unless ``llm_kwargs`` say
    otherwise; the ranks run as processes, so a CPU machine runs TP=2 too)."""
    kwargs: dict[str, Any] = {"device": "cpu", "dtype": "float32", "block_size": 4,
                              **llm_kwargs}
    out = {}
    for tp in tp_sizes:
        with LLM(str(path), tensor_parallel_size=tp, **kwargs) as llm:
            outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                                use_tqdm=False)
        out[tp] = [list(o.outputs[0].token_ids) for o in outs]
    return out


HfInputs = Callable[[list[int], list[Any], list[Any]], dict[str, Any]]
"""``(prompt ids, the engine's items, the images) -> HF's extra forward kwargs`` (pixel
values, grids, token-type ids); ``{}`` for a text prompt."""


def check_images_against_hf(llm: LLM, hf: torch.nn.Module,
                            prompts: Sequence[tuple[list[int], list[Any]]],
                            hf_inputs: HfInputs, *, max_tokens: int = 8,
                            encoder_runs: int | None = None, logprobs_of: int | None = 1,
                            atol: float = 1e-4) -> list[tuple[list[int], list[Any]]]:
    """The engine against HF transformers on ``(prompt ids, images)`` pairs: each prompt's
    greedy tokens (``ignore_eos``) equal HF's ``generate``; a second round of the image prompts
    gives the same tokens without running the encoder again (``encoder_runs``: how many runs
    the first round takes, e.g. the distinct images); every position's log-probability of the
    prompt at index ``logprobs_of`` is within ``atol`` of HF's forward. Returns each prompt's
    expanded ids and the engine's items, for the family's own checks of the expansion."""
    processor = llm.engine.input_processor
    assert processor is not None, "check_images_against_hf: the engine has no input processor"
    hf.generation_config.eos_token_id = None  # type: ignore[union-attr]  # (as ignore_eos)
    expanded, want = [], []
    for prompt, images in prompts:
        ids, items = processor.process(prompt, {"image": images})
        expanded.append((ids, items))
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]),  # type: ignore[operator]
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=max_tokens, do_sample=False,
                              **hf_inputs(ids, items, images))
        want.append([int(t) for t in out[0, len(ids):]])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = [{"prompt_token_ids": p, "multi_modal_data": {"image": i}} for p, i in prompts]
    outs = llm.generate(requests, params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    state = llm.engine.runner.model_state
    runs = state.encoder_runs
    if encoder_runs is not None:
        assert runs == encoder_runs, (runs, encoder_runs)
    with_images = [i for i, (_, images) in enumerate(prompts) if images]
    again = llm.generate([requests[i] for i in with_images], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in again] == [want[i] for i in with_images]
    assert state.encoder_runs == runs  # (the encoder cache)
    if logprobs_of is not None:
        ids, items = expanded[logprobs_of]
        with torch.no_grad():
            logits = hf(torch.tensor([ids]), **hf_inputs(ids, items, prompts[logprobs_of][1]))
        want_lp = torch.log_softmax(logits.logits[0].double(), dim=-1)
        got = llm.generate([requests[logprobs_of]],
                           SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0].prompt_logprobs
        assert got is not None and got[0] is None and len(got) == len(ids)
        for pos in range(1, len(ids)):
            mine = got[pos]
            assert mine is not None
            diff = abs(mine[ids[pos]].logprob - float(want_lp[pos - 1, ids[pos]]))
            assert diff <= atol, (pos, diff)
    return expanded
