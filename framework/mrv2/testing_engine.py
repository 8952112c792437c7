"""Helpers for tests that run the engine (above :mod:`mrv2.engine`, beside the lower
:mod:`mrv2.testing`): the tokens an ``LLM`` generates at each tensor-parallel size."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mrv2.contract.params import SamplingParams
from mrv2.engine.llm import LLM

__all__ = ["tokens_at_tp"]


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
