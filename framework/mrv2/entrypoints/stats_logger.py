"""``mrv2 serve``'s periodic stats line, as vLLM's server logs one.

Every :data:`LOG_STATS_INTERVAL_ENV_VAR` seconds (default 10) while the engine has work, the
server logs the prompt and generation throughput over the interval, the requests running and
waiting, the KV cache's use, the prefix cache's hit rate over the interval's lookups and, with
speculation, the drafts accepted::

    engine: prompt 3,412.5 tok/s, generation 1,204.1 tok/s; running 12 reqs, waiting 0 reqs;
    KV cache 23.4% used; prefix cache hit rate 41.0%

It reads the engine's counters from the snapshot the server already keeps for ``/metrics``
(:attr:`ServerMetrics.stats <mrv2.entrypoints.metrics.ServerMetrics.stats>`), so it never
touches the engine. An idle engine gets one line (its zeros) and then none until work comes
back. ``mrv2 serve --disable-log-stats`` turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from mrv2.config import positive_number_from_env

logger = logging.getLogger(__name__)

#: Seconds between two stats lines of ``mrv2 serve`` (a positive number; default 10).
LOG_STATS_INTERVAL_ENV_VAR = "MRV2_LOG_STATS_INTERVAL"
DEFAULT_LOG_STATS_INTERVAL_S = 10.0

# The cumulative counters of LLMEngine.stats() a line takes the interval's difference of.
_COUNTERS = ("num_prompt_tokens", "num_generation_tokens", "prefix_cache_queries",
             "prefix_cache_hits", "spec_num_draft_tokens", "spec_num_accepted_tokens",
             "spec_num_steps", "num_preemptions")


def log_stats_interval() -> float:
    """The interval from :data:`LOG_STATS_INTERVAL_ENV_VAR`; ValueError naming the variable
    on anything but a positive number of seconds."""
    value = positive_number_from_env(LOG_STATS_INTERVAL_ENV_VAR, float, "number of seconds")
    return DEFAULT_LOG_STATS_INTERVAL_S if value is None else float(value)


class StatsLogger:
    """Turns successive engine stats snapshots (``read()``: :meth:`LLMEngine.stats` keys)
    into stats lines; :meth:`line` gives the line of the interval since the last call."""

    def __init__(self, read: Callable[[], dict[str, Any]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read, self._clock = read, clock
        self._last_time = clock()
        self._last = self._counters(read())
        self._was_active = False  # (an engine idle since the start says nothing)

    @staticmethod
    def _counters(stats: dict[str, Any]) -> dict[str, float]:
        return {key: float(stats.get(key, 0) or 0) for key in _COUNTERS}

    def line(self) -> str | None:
        """The line of the interval since the last call, or None while the engine stays idle
        (nothing ran in this interval nor in the one before)."""
        now, stats = self._clock(), self._read()
        counters = self._counters(stats)
        delta = {key: counters[key] - self._last[key] for key in _COUNTERS}
        seconds = max(now - self._last_time, 1e-9)
        self._last, self._last_time = counters, now
        running, waiting = int(stats.get("num_running", 0)), int(stats.get("num_waiting", 0))
        active = bool(running or waiting or delta["num_prompt_tokens"]
                      or delta["num_generation_tokens"])
        if not active and not self._was_active:
            return None
        self._was_active = active
        queries = delta["prefix_cache_queries"]
        hit_rate = delta["prefix_cache_hits"] / queries if queries > 0 else 0.0
        parts = [
            f"prompt {delta['num_prompt_tokens'] / seconds:,.1f} tok/s, generation "
            f"{delta['num_generation_tokens'] / seconds:,.1f} tok/s",
            f"running {running} reqs, waiting {waiting} reqs",
            f"KV cache {100 * float(stats.get('kv_usage', 0.0)):.1f}% used",
            f"prefix cache hit rate {100 * hit_rate:.1f}%",
        ]
        if delta["num_preemptions"]:
            parts.append(f"{int(delta['num_preemptions'])} preempted")
        if delta["spec_num_steps"]:
            drafts, accepted = delta["spec_num_draft_tokens"], delta["spec_num_accepted_tokens"]
            parts.append(
                f"speculation: mean accepted length "
                f"{1 + accepted / delta['spec_num_steps']:.2f}, {int(accepted):,} of "
                f"{int(drafts):,} drafts accepted ({100 * accepted / max(drafts, 1):.1f}%)")
        return "engine: " + "; ".join(parts)


async def log_stats_forever(stats: StatsLogger, interval: float) -> None:
    """Log :meth:`StatsLogger.line` every ``interval`` seconds until cancelled."""
    while True:
        await asyncio.sleep(interval)
        line = stats.line()
        if line is not None:
            logger.info("%s", line)
