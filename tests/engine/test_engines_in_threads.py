"""Two engines of one process stepping at once, each in its own thread (two ``LLM`` s, or a
server's engine beside another): each forward sees its own context (layers find the step's
KV caches and metadata through :mod:`mrv2.contract.forward_context`, per thread), so each
engine's greedy tokens are what it gives alone."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_checkpoint


def test_two_engines_stepping_in_threads_keep_their_own_forward(tmp_path: Path) -> None:
    """Two checkpoints of different shapes, each generating in its own thread with the
    interpreter switching threads every microsecond (a context shared by the process mixed
    them up at once: one model's layers read the other's step)."""
    paths = [make_tiny_checkpoint(tmp_path / "a", "Qwen3ForCausalLM", seed=1),
             make_tiny_checkpoint(tmp_path / "b", "LlamaForCausalLM", seed=2)]
    llms = [LLM(str(p), device="cpu", dtype="float32", block_size=4) for p in paths]
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 50 for j in range(5 + i)]}
               for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def tokens(llm: LLM) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)]

    alone = [tokens(llm) for llm in llms]
    got: list[list[list[int]] | BaseException] = [[], []]

    def run(i: int) -> None:
        try:
            for _ in range(3):
                got[i] = tokens(llms[i])
                if got[i] != alone[i]:
                    return
        except BaseException as error:  # noqa: BLE001 (reported below)
            got[i] = error

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
    finally:
        sys.setswitchinterval(interval)
    assert got == alone
