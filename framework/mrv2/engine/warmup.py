"""Start-up warm-up: a few requests through the whole step path before the first real one.

The runner's start-up captures CUDA graphs from dummy batches; it never builds a batch from
real requests (``BatchBuilder.build``: the input-preparation kernels) and never samples a
step's tokens eagerly (the prefill step's sampler, the Gumbel kernels of each sampling kind,
logprobs, structured outputs' mask kernel). On a machine whose Triton cache is empty those
kernels compile when the first real request needs them, and that request waits (0.7-1.1 s on
the H200 for the first greedy request, Qwen3-0.6B; 0.3-0.5 s more for the first with
logprobs, and for min-p, 0.65-0.96 s for the first with a penalty), and the first request
with a structured output built llguidance's view of the tokenizer (0.3 s for a 49K
vocabulary, ~1 s at 151K). :func:`warm_up` runs those paths once, then leaves the engine as
it found it: the request ids it hands out, the seeds it draws, the prefix cache, the penalty
counters (freed again) and every counter of :meth:`LLMEngine.stats` are those of an engine
that never ran it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import time
from typing import Any, Protocol

import torch

from mrv2.contract.params import SamplingParams, StructuredOutputsParams
from mrv2.contract.pooling import PoolingParams
from mrv2.distributed.parallel_state import tp_size
from mrv2.sample.state import PENALTY_STATE_MAX_ELEMENTS, SamplingState
from mrv2_kernels.token_bitmask import apply_token_bitmask

logger = logging.getLogger(__name__)

#: Request ids of the warm-up (the engine's own ids are decimal numbers).
WARMUP_ID_PREFIX = "mrv2-warmup-"

#: One batch per sampling kind (a step's sampler plan, and so which kernels and which decode
#: tail it runs, follows the whole batch): greedy; temperature alone; top-k and top-p;
#: logprobs of the samples and of the prompt; min-p, alone and with top-k / top-p (sampled
#: eagerly: the filter then runs over min-p's fp32 logits, another compile). Explicit seeds
#: (greedy requests draw one too) leave the engine's seed stream untouched.
WARMUP_BATCHES: tuple[tuple[SamplingParams, ...], ...] = (
    (SamplingParams(temperature=0.0, seed=0), SamplingParams(temperature=0.0, seed=1)),
    (SamplingParams(temperature=1.0, seed=0),),
    (SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=0),),
    (SamplingParams(temperature=0.0, seed=0, logprobs=2, prompt_logprobs=2),),
    (SamplingParams(temperature=1.0, seed=0, min_p=0.1),
     SamplingParams(temperature=0.8, seed=1, min_p=0.05, top_k=40, top_p=0.95)),
)

#: Then penalties, one batch per way the sampler reads their fp32 logits (greedy; temperature;
#: top-k / top-p thresholds; Triton compiles a kernel per pointer dtype, so the batches above
#: do not cover these). Their per-token counters (``max_num_seqs x vocab``, 5 bytes each:
#: ~190 MB for 256 x 151,936) are freed again after them, so an engine whose requests never
#: ask for a penalty does not hold them; skipped where the counters would pass
#: :data:`~mrv2.sample.state.PENALTY_STATE_MAX_ELEMENTS`, where the device has not twice
#: their bytes free, and under tensor parallelism (each rank's sampler would keep its own).
PENALTY_BATCHES: tuple[tuple[SamplingParams, ...], ...] = (
    (SamplingParams(temperature=0.0, seed=0, repetition_penalty=1.1),),
    (SamplingParams(temperature=1.0, seed=0, frequency_penalty=0.5),),
    (SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=0, presence_penalty=1.5),),
)


class WarmableEngine(Protocol):
    """What :func:`warm_up` uses of an engine (:class:`~mrv2.engine.engine.LLMEngine`)."""

    runner: Any
    max_model_len: int
    tokenizer: Any
    config: Any

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, *,
                    pooling_params: PoolingParams | None = None) -> str: ...

    def step(self) -> list[Any]: ...

    def has_unfinished(self) -> bool: ...

    def reset_after_warmup(self) -> None: ...


def warmup_prompt(vocab_size: int, max_model_len: int, block_size: int) -> list[int]:
    """A prompt of one KV block and a half (no longer than leaves room for 4 new tokens): the
    batches after the first find its first block in the prefix cache, so both a prefill from
    scratch and one after a cached prefix run."""
    length = max(1, min(block_size + block_size // 2, max_model_len - 4))
    return [(7 * i + 3) % vocab_size for i in range(length)]


def warm_up(engine: WarmableEngine, max_tokens: int = 4) -> float:
    """Run :data:`WARMUP_BATCHES` through ``engine`` to completion, one batch at a time, then
    reset what they changed (the prefix cache and the scheduler's and speculation's
    counters). Returns the seconds it took. The engine must be idle."""
    if engine.has_unfinished():
        raise RuntimeError("warm_up needs an idle engine: requests are in flight")
    start = time.perf_counter()
    runner = engine.runner
    prompt = warmup_prompt(runner.vocab_size, engine.max_model_len, runner.block_size)
    max_tokens = max(1, min(max_tokens, engine.max_model_len - len(prompt)))
    if engine.config.model.runner == "pooling":  # embedding requests only: two of them
        for b in range(2):  # (the second after the first's cached prefix)
            engine.add_request(prompt, SamplingParams(), request_id=f"{WARMUP_ID_PREFIX}{b}",
                               pooling_params=PoolingParams())
            while engine.has_unfinished():
                engine.step()
        engine.reset_after_warmup()
        seconds = time.perf_counter() - start
        logger.info("warm-up: 2 embedding requests through the step path in %.2f s", seconds)
        return seconds
    state = getattr(runner.sampler, "state", None)
    penalties = isinstance(state, SamplingState) and _penalty_state_fits(state)
    batches = WARMUP_BATCHES + (PENALTY_BATCHES if penalties else ())
    for b, batch in enumerate(batches):
        for i, params in enumerate(batch):
            params = dataclasses.replace(params, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(prompt, params, request_id=f"{WARMUP_ID_PREFIX}{b}-{i}")
        while engine.has_unfinished():
            engine.step()
    _warm_bitmask_kernel(runner)
    structured = _warm_structured_outputs(engine, prompt, max_tokens)
    if penalties:
        assert isinstance(state, SamplingState)
        if state.release_penalty_state() and state.device.type == "cuda":
            torch.cuda.synchronize(state.device)  # (the last step's count is done with it)
            torch.cuda.empty_cache()  # the counters' memory back to the device
    engine.reset_after_warmup()
    seconds = time.perf_counter() - start
    logger.info("warm-up: %d batches through the step path in %.2f s%s%s", len(batches),
                seconds, "" if penalties else " (penalties left out)",
                "" if structured is None else
                f" (structured outputs: {structured:.2f} s, llguidance's tokenizer built)")
    return seconds


def _warm_structured_outputs(engine: WarmableEngine, prompt: list[int], max_tokens: int
                             ) -> float | None:
    """A request with a structured output through the step path (llguidance's view of the
    tokenizer built, a grammar compiled, the masks filled during a forward), so the first
    real one waits for none of it; the seconds it took, or None where llguidance or the
    tokenizer is missing, or the engine cannot take structured outputs (logged)."""
    if engine.tokenizer is None or importlib.util.find_spec("llguidance") is None:
        return None
    start = time.perf_counter()
    params = SamplingParams(temperature=0.0, seed=0, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    try:
        engine.add_request(prompt, params, request_id=f"{WARMUP_ID_PREFIX}structured")
    except ValueError as error:  # e.g. an EOS outside the tokenizer's vocabulary
        logger.warning("warm-up: no structured outputs for this model: %s", error)
        return None
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def _warm_bitmask_kernel(runner: Any) -> None:
    """Structured outputs' mask kernel compiled for the logits it may get (the model's dtype,
    a decode graph's before its sampling tail; fp32 beside rare stages), so the first
    constrained request does not wait for it (no grammar or llguidance needed for that)."""
    device, vocab = runner.device, int(runner.vocab_size)
    mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32, device=device)
    rows = torch.zeros(1, dtype=torch.int64, device=device)
    for dtype in dict.fromkeys((runner.dtype, torch.float32)):
        apply_token_bitmask(torch.zeros(1, vocab, dtype=dtype, device=device), mask, rows)


def _penalty_state_fits(state: SamplingState) -> bool:
    """Whether the warm-up may allocate the penalty counters for a moment (see
    :data:`PENALTY_BATCHES`)."""
    if tp_size() > 1 or state.penalty_state_elements > PENALTY_STATE_MAX_ELEMENTS:
        return False
    if state.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(state.device)
        return free >= 2 * state.penalty_state_bytes()
    return True
