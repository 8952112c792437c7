"""``LLM.shutdown`` (and the end of a ``with LLM(...)`` block) lets go of the engine's memory
while the object is still referenced, so the next engine of the process finds it free; the
engine then refuses work by name."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "Qwen3ForCausalLM", seed=3)


@pytest.mark.parametrize("kwargs", [{}, {"speculative_config": {
    "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}}])
def test_shutdown_frees_the_model_and_cache_while_referenced(ckpt: Path,
                                                             kwargs: dict) -> None:
    with LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, max_model_len=64,
             **kwargs) as llm:
        runner = llm.engine.runner
        held = [weakref.ref(runner.model), weakref.ref(runner.kv.tensors[0]),
                weakref.ref(runner.table.token_ids), weakref.ref(runner.buffers.input_ids)]
        first = llm.generate([{"prompt_token_ids": [5, 6, 7, 5, 6]}], GREEDY, use_tqdm=False)
        assert len(first[0].outputs[0].token_ids) == 4
        # a request still running when the engine shuts down is dropped with it
        llm.engine.add_request([1, 2, 3], GREEDY)
        llm.engine.step()
    gc.collect()
    assert [ref() for ref in held] == [None] * len(held)  # (llm itself still referenced)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([{"prompt_token_ids": [5, 6]}], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.engine.step()
    llm.engine.abort("0")  # ignored
    llm.shutdown()  # idempotent
