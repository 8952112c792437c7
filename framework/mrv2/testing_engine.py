"""Helpers for tests that run the engine (above :mod:`mrv2.engine`, beside the lower
:mod:`mrv2.testing`): the tokens an ``LLM`` generates at each tensor-parallel size, the
check every image family runs against HF transformers (:func:`check_images_against_hf`) and
the ones every family with per-request state runs (:func:`check_state_prefix_cache`,
:func:`check_state_speculation`), and every video family's refusals (:func:`check_bad_videos`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mrv2.contract.params import SamplingParams
from mrv2.engine.llm import LLM

__all__ = ["HfInputs", "check_bad_videos", "check_bf16_graphs_against_eager",
           "check_images_against_hf",
           "check_prompt_logprobs", "check_state_prefix_cache", "check_state_speculation",
           "tokens_at_tp"]


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
        check_prompt_logprobs(llm, requests[logprobs_of], ids, logits.logits[0], atol)
    return expanded


def check_prompt_logprobs(llm: LLM, request: dict[str, Any], ids: Sequence[int],
                          logits: torch.Tensor, atol: float = 1e-4) -> None:
    """Every position's log-probability of the prompt ``ids`` (``request``: the prompt as
    ``LLM.generate`` takes it) from the engine (``prompt_logprobs=0``) within ``atol`` of
    ``log_softmax(logits)``, HF's ``[len(ids), vocab]`` logits of that prompt (the first
    position has none)."""
    want = torch.log_softmax(logits.double(), dim=-1)
    got = llm.generate([request], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0].prompt_logprobs
    assert got is not None and got[0] is None and len(got) == len(ids)
    for pos in range(1, len(ids)):
        mine = got[pos]
        assert mine is not None
        diff = abs(mine[ids[pos]].logprob - float(want[pos - 1, ids[pos]]))
        assert diff < atol, (pos, diff)


def check_bad_videos(llm: LLM, ids: Sequence[int], good: np.ndarray,
                     extra: Sequence[tuple[Any, str]] = ()) -> None:
    """The refusals every video family gives through ``llm.generate`` (the core's clip parsing,
    :mod:`mrv2.contract.video_inputs`, and the placeholder count), then the family's own
    ``extra`` cases (``(video, message pattern)``): for ``multi_modal_data={"video": video}``
    on the one-video prompt ``ids``, beside a plain request, a ValueError matching the pattern,
    and nothing of any batch queued. ``good``: a valid ``[T, H, W, 3]`` uint8 clip, T >= 2."""
    field = r"multi_modal_data\.video"
    cases: list[tuple[Any, str]] = [
        (good[0], rf"{field}\[0\]: a numpy clip must be \[T, H, W, 3\]"),
        (good.astype(np.float32), rf"{field}\[0\]: frames must be uint8"),
        (torch.from_numpy(good), rf"{field}\[0\]: a torch clip must be "),
        (good[:0], rf"{field}\[0\]: a clip needs at least one frame"),
        ((good, {"fps": 0}), rf"{field}\[0\]: fps must be a positive"),
        ((good, {"rate": 2}), rf"{field}\[0\]: unknown options"),
        ([good, good], rf"{field}: 2 videos but the prompt has 1 video placeholders"),
        ("clip.mp4", rf"{field}: expected a clip"),
        *extra,
    ]
    requests = [{"prompt_token_ids": list(ids), "multi_modal_data": {"video": video}}
                for video, _ in cases]
    requests.append({"prompt_token_ids": list(ids), "multi_modal_data": {}})
    patterns = [pattern for _, pattern in cases]
    patterns.append(rf"{field}: 0 videos but the prompt has 1 video placeholders")
    params = SamplingParams(temperature=0, max_tokens=4)
    for request, pattern in zip(requests, patterns, strict=True):
        try:
            llm.generate([{"prompt_token_ids": [5, 6]}, request], params, use_tqdm=False)
        except ValueError as e:
            assert re.search(pattern, str(e)), (pattern, str(e))
        else:
            raise AssertionError(f"no ValueError matching {pattern!r}")
    assert not llm.engine.has_unfinished()  # nothing of the batches was queued


def check_bf16_graphs_against_eager(graphs: Sequence[Sequence[int]],
                                    eager: Sequence[Sequence[int]],
                                    fp32: Sequence[Sequence[int]]) -> None:
    """bf16 greedy tokens with CUDA graphs against eager and the fp32 (HF-checked) ones, per
    prompt: graphs and eager round differently (the decode graph's fused kernels) and a near
    tie may part after the first token, so the first tokens agree everywhere, the first four
    in all prompts but one, and the first token is fp32's in all prompts but one."""
    n = len(graphs)
    assert [g[0] for g in graphs] == [e[0] for e in eager]
    same = sum(list(g[:4]) == list(e[:4]) for g, e in zip(graphs, eager, strict=True))
    assert same >= n - 1, (graphs, eager)
    assert sum(g[0] == w[0] for g, w in zip(graphs, fp32, strict=True)) >= n - 1


def check_greedy_up_to_ties(got: Sequence[int], prompt: Sequence[int],
                            logprobs: Callable[[list[int]], torch.Tensor],
                            tol: float) -> float:
    """``got``, greedy tokens of a low-precision engine after ``prompt``, checked token by token
    against a reference fed the engine's own sequence: ``logprobs(ids)`` gives the reference's
    log-probabilities ``[len(ids), vocab]``. Each token must be the reference's argmax or within
    ``tol`` of it: in bf16 a near tie may go either way, and after it the sequences part, so
    comparing with the reference's own greedy tokens would test the rounding, not the engine.
    Returns the largest gap seen, the reference's best less the engine's token."""
    ids = [*prompt, *got]
    ref = logprobs(ids).float()
    assert ref.shape[0] == len(ids), (ref.shape, len(ids))
    worst = 0.0
    for i, token in enumerate(got):
        row = ref[len(prompt) - 1 + i]
        gap = float(row.max() - row[token])
        assert gap <= tol, (f"token {i} ({token}) is {gap:.3f} below the reference's best "
                            f"({int(row.argmax())}), more than {tol}")
        worst = max(worst, gap)
    return worst


STATE_TEST_BLOCKS = 256
"""KV blocks of the engines :func:`check_state_prefix_cache` and
:func:`check_state_speculation` build (1,024 tokens at their block size of 4; their requests
allocate under 80 blocks in all, so none cached is evicted): the CPU default (2 GiB) of a
tiny model is millions of blocks, seconds to list and to free at each engine."""


def _small_kv_cache(llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``llm_kwargs`` with :data:`STATE_TEST_BLOCKS` KV blocks unless they size the cache."""
    if {"num_gpu_blocks_override", "kv_cache_memory_bytes", "cpu_kv_cache_gb"} & set(llm_kwargs):
        return llm_kwargs
    return {"num_gpu_blocks_override": STATE_TEST_BLOCKS, **llm_kwargs}


def check_state_prefix_cache(path: str | Path, max_tokens: int = 6,
                             **llm_kwargs: Any) -> LLM:
    """A model with per-request state (linear attention, Mamba) under prefix caching: greedy
    tokens equal HF ``generate`` while requests resume from state snapshots (block size 4,
    prompts in chunks of 8): a prompt repeated (it resumes at its last full block before its
    last token), then prompts sharing its first 13 tokens (the first of them computes from the
    start, its prefix hit cut to no snapshot, and saves the junction after 12; the next
    resumes there), and a repeated prompt once more after the rows were reused; asserts the
    cached token counts each request reports. Then those prompts all at once, and through an
    engine of one snapshot slot; then the slots one step writes, neither read nor evicted by
    another admission of that step. Returns the first LLM. Each engine holds
    :data:`STATE_TEST_BLOCKS` KV blocks unless ``llm_kwargs`` size the cache: no cached block
    is evicted (asserted), as with the CPU default."""
    from mrv2.testing import hf_greedy

    llm_kwargs = _small_kv_cache(llm_kwargs)
    base = [3 + (11 * i) % 97 for i in range(23)]
    share = [base[:13] + [50 + i, 7, 90 - i, 31 + 2 * i] for i in range(3)]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=8, **llm_kwargs)
    if not llm.engine.prefix_caching or not llm.engine.state_snapshot_slots:
        raise AssertionError("prefix caching is off for this model")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # (prompt, the tokens it must find cached)
    rounds = [(base, 0), (base, 20), (share[0], 0), (share[1], 12), (share[2], 12), (base, 20)]
    wants: dict[tuple[int, ...], list[int]] = {}
    for i, (prompt, cached) in enumerate(rounds):
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        want = wants.setdefault(tuple(prompt), hf_greedy(path, prompt, max_tokens)
                                if tuple(prompt) not in wants else [])
        assert out.outputs[0].token_ids == want, (i, out.outputs[0].token_ids, want)
        assert out.num_cached_tokens == cached, (i, out.num_cached_tokens, cached)
    snapshots = llm.engine.scheduler.snapshots
    assert snapshots is not None and snapshots.num_resumed == 4 and snapshots.num_saved >= 2
    # All at once (one prompt twice: two admissions in a step resume from one slot and plan
    # the same snapshots), then with one slot (every save evicts the last).
    together = [share[0], share[1], base, share[2], share[0]]
    outs = llm.generate([{"prompt_token_ids": p} for p in together], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [wants[tuple(p)] for p in together]
    tight = LLM(str(path), device="cpu", dtype="float32", block_size=4,
                max_num_batched_tokens=8, state_snapshot_slots=1, **llm_kwargs)
    for prompts in ([p for p, _ in rounds], together):
        outs = tight.generate([{"prompt_token_ids": p} for p in prompts], params,
                              use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [wants[tuple(p)] for p in prompts]
    tight_snaps = tight.engine.scheduler.snapshots
    assert tight_snaps is not None and tight_snaps.num_evicted > 0
    _assert_no_block_evicted(tight)
    tight.engine.shutdown()
    _check_snapshots_of_one_step(path, base, params, **llm_kwargs)
    _assert_no_block_evicted(llm)
    return llm


def _check_snapshots_of_one_step(path: str | Path, base: list[int], params: SamplingParams,
                                 **llm_kwargs: Any) -> None:
    """Admissions of one step (64 tokens a step) and the snapshot slots that step writes:
    one saves the junction after 8 that another of the same step, sharing those 8 tokens and
    a batch row ahead of it, could resume from (it must not: the slot is not written yet, on
    the GPU a race); with one slot, one evicts the slot another of the step writes (both
    would store into it, published under the second's hash). Greedy tokens HF's."""
    from mrv2.testing import hf_greedy

    first = base[:8] + [60, 61, 62, 63, 64]  # caches 3 blocks, its only snapshot after 12
    saver = base[:8] + [70, 71, 72, 73, 74]  # hits 2 blocks, no snapshot: saves after 8
    reader = base[:8] + [80, 81, 82, 83, 84, 85]  # the same step, longer: batched first
    wide = LLM(str(path), device="cpu", dtype="float32", block_size=4,
               max_num_batched_tokens=64, **llm_kwargs)
    wide.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
    outs = wide.generate([{"prompt_token_ids": p} for p in (saver, reader)], params,
                         use_tqdm=False)
    n = params.max_tokens or 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, n)
                                                      for p in (saver, reader)]
    _assert_no_block_evicted(wide)
    wide.engine.shutdown()
    other = [5 + (13 * i) % 89 for i in range(14)]  # saves after 12 as base[:13] does
    single = LLM(str(path), device="cpu", dtype="float32", block_size=4,
                 max_num_batched_tokens=64, state_snapshot_slots=1, **llm_kwargs)
    single.generate([{"prompt_token_ids": p} for p in (base[:13], other)], params,
                    use_tqdm=False)
    again = single.generate([{"prompt_token_ids": other}], params, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == hf_greedy(path, other, n)
    _assert_no_block_evicted(single)
    single.engine.shutdown()


def _assert_no_block_evicted(llm: LLM) -> None:
    """No cached KV block of ``llm`` was evicted: its cache (:data:`STATE_TEST_BLOCKS` blocks)
    changed none of the prefix hits the checks expect."""
    evicted = llm.engine.block_manager.num_evictions
    assert evicted == 0, f"{evicted} cached KV blocks evicted: the cache is too small"


def check_state_speculation(path: str | Path, max_tokens: int = 20,
                            **llm_kwargs: Any) -> dict[str, Any]:
    """A model with per-request state (linear attention, Mamba) under speculative decoding
    (n-gram drafts, 3 a step): greedy tokens equal HF ``generate`` for prompts that repeat
    themselves (so drafts come, and the random model keeps some and rejects others: asserted
    from the engine's counts), several requests at once, prompts split across steps (chunks
    of 8 tokens), block size 4; under prefix caching the same prompts once more, each resuming
    from a state snapshot. Returns the engine's stats. The engine holds
    :data:`STATE_TEST_BLOCKS` KV blocks unless ``llm_kwargs`` size the cache."""
    from mrv2.testing import hf_greedy

    llm_kwargs = _small_kv_cache(llm_kwargs)
    motif = [[5, 9, 13, 17, 21], [40, 3, 40, 3, 40, 3, 7], [60 + i % 4 for i in range(11)]]
    prompts = [m * 3 for m in motif] + [[11, 12, 13, 14] * 2 + [11, 12]]
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=8, speculative_config={
                  "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                  "prompt_lookup_min": 1}, **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    want = [hf_greedy(path, p, max_tokens) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want
    if llm.engine.prefix_caching:  # again: each request resumes from a state snapshot
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                             use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == want
        assert all(o.num_cached_tokens > 0 for o in again), [o.num_cached_tokens
                                                             for o in again]
    stats = dict(llm.engine.stats())
    drafted, kept = stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]
    assert 0 < kept < drafted, (kept, drafted)  # drafts both kept and rejected
    _assert_no_block_evicted(llm)
    llm.engine.shutdown()
    return stats
