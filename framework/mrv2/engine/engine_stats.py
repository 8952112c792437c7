"""The speculation and LoRA parts of :meth:`~mrv2.engine.engine.LLMEngine.stats`."""

from __future__ import annotations

from typing import Any

from mrv2.config import EngineConfig
from mrv2.engine.scheduler import Scheduler

__all__ = ["lora_stats", "spec_stats"]


def spec_stats(drafted: list[int], accepted: list[int]) -> dict[str, Any]:
    """Speculation's counts from the two histograms of request-steps (``drafted[d]``: with
    ``d`` drafts verified; ``accepted[a]``: with ``a`` kept): drafts verified and accepted,
    overall and per draft position, the acceptance rates and the mean accepted length."""
    k = len(drafted) - 1
    # a request-step with d drafts verified one at each position j < d (kept: j < a)
    per_pos = [sum(drafted[j + 1:]) for j in range(k)]
    kept = [sum(accepted[j + 1:]) for j in range(k)]
    num_drafts, num_accepted, steps = sum(per_pos), sum(kept), sum(drafted)
    return {
        "spec_num_draft_tokens": num_drafts,
        "spec_num_accepted_tokens": num_accepted,
        "spec_acceptance_rate": num_accepted / num_drafts if num_drafts else 0.0,
        "spec_num_steps": steps,
        "spec_mean_accepted_length": 1 + num_accepted / steps if steps else 0.0,
        "spec_num_drafts_per_pos": per_pos,
        "spec_num_accepted_per_pos": kept,
        "spec_acceptance_rate_per_pos": [a / d if d else 0.0
                                         for a, d in zip(kept, per_pos, strict=True)],
    }


def lora_stats(config: EngineConfig, scheduler: Scheduler) -> dict[str, Any]:
    """With ``enable_lora``: ``max_lora`` and the adapters (names, sorted) of the running
    and of the waiting requests, as vLLM's ``lora_requests_info`` reports them."""
    if not config.lora.enable_lora:
        return {}
    running, waiting = scheduler.lora_names()
    return {"max_lora": config.lora.max_loras, "lora_running": running,
            "lora_waiting": waiting}
