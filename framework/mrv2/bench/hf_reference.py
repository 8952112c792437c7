"""HF transformers ``generate`` as the reference of ``mrv2 bench latency --device cpu``.

The same prompts, greedy, exactly ``new_tokens`` tokens each (``min_new_tokens`` ignores EOS),
timed like mrv2's rows: TTFT from the call to the first generated token (a streamer stamps it),
TPOT as the time after that token over the ``new_tokens - 1`` that follow.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class _FirstTokenClock:
    """A ``generate`` streamer that stamps when the first generated tokens arrive (the first
    ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def load_hf_model(model_dir: str, load_format: str, dtype: torch.dtype, seed: int = 0) -> Any:
    """The checkpoint through ``AutoModelForCausalLM`` on the CPU in ``dtype`` (``dummy``:
    random weights from the config; speed does not depend on the values)."""
    import transformers

    if load_format == "dummy":
        config = transformers.AutoConfig.from_pretrained(model_dir)
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.eval()


def hf_measure(model: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """TTFT and time per output token of ``prompts`` (equal lengths) generated as one batch."""
    ids = torch.tensor(prompts, dtype=torch.long)
    clock = _FirstTokenClock()
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       streamer=clock)
        end = time.perf_counter()
    assert clock.first is not None
    return {"ttft_ms": (clock.first - start) * 1e3,
            "tpot_ms": (end - clock.first) * 1e3 / max(1, new_tokens - 1)}
