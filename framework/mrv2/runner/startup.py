"""What a runner's start-up did and how long each part took, logged as each part ends.

An operator starting ``mrv2 serve`` reads here what vLLM's start-up prints: how long the
weights took and what they weigh, how big the KV cache is in tokens and how many requests of
``max_model_len`` fit in it at once, how long the CUDA graphs took and what they hold. The
``mrv2`` command logs them at INFO (:func:`mrv2.logs.configure_logging`); a library user gets
them through the ``mrv2`` logger, and every number is on :attr:`Runner.startup` too.

The parts: ``config`` (reading ``config.json``), ``load``, ``kv_cache``, ``graphs``; the engine
adds ``warm-up`` and ``other`` (the rest: the tokenizer, the tables, the sampler). ``config``
is mostly an import: on transformers 5 a model's config class imports transformers' modeling
machinery (through its docstring decorator), which imports ``torch.distributed``'s FSDP and, when
installed, scikit-learn: ~7 of a warm 19 s start-up of a 0.6B model on the H200 machine
(``scripts/probe_startup.py``, BENCHMARKS.md 2026-12-04). Every engine that reads
transformers' configs pays it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from mrv2.contract.kv_cache import AttentionChunk
from mrv2.runner.kv_tables import blocks_per_request

logger = logging.getLogger("mrv2.runner")

_GIB = 1 << 30


class StartupReport:
    """Seconds of each start-up part (``seconds[name]``) and what each part found
    (``facts``); logs a line per part unless ``quiet`` (the tensor-parallel ranks past 0)."""

    def __init__(self, quiet: bool = False) -> None:
        self.seconds: dict[str, float] = {}
        self.facts: dict[str, Any] = {}
        self.quiet = quiet

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time the body as part ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - start

    def log(self, message: str, *args: Any) -> None:
        if not self.quiet:
            logger.info(message, *args)

    def weights(self, architecture: str, model: torch.nn.Module, ranks: int) -> None:
        """After the weights are loaded: the architecture, their bytes, the seconds."""
        tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        self.facts["weight_bytes"] = size
        self.log("%s loaded in %.1f s: %.2f GiB of weights and buffers%s", architecture,
                 self.seconds.get("load", 0.0), size / _GIB,
                 f" on each of {ranks} ranks" if ranks > 1 else "")

    def kv_cache(self, num_blocks: int, block_size: int, bytes_per_block: int,
                 kv_dtype: str, max_model_len: int, peak_bytes: int,
                 windows: tuple[int | None, ...] = (None,)) -> None:
        """After the KV cache is allocated: its size in tokens and bytes, and how many
        requests of ``max_model_len`` tokens it holds at once (``windows``: each block
        table's sliding window, :mod:`mrv2.runner.kv_tables`; a sliding table holds a
        request's window only)."""
        tokens = num_blocks * block_size
        fit = num_blocks / blocks_per_request(windows, block_size, max_model_len)
        self.facts.update(kv_tokens=tokens, kv_bytes=num_blocks * bytes_per_block,
                          max_concurrency=fit, kv_table_windows=list(windows))
        peak = (f"; the profiling forward's activation peak {peak_bytes / _GIB:.2f} GiB"
                if peak_bytes > 0 else "")  # (measured on CUDA only)
        encoder = int(self.facts.get("encoder_peak_bytes", 0))
        if peak and encoder > 0:
            peak += (f" (the encoder's {encoder / _GIB:.2f} GiB counted, "
                     f"{int(self.facts['encoder_kept_bytes']) / _GIB:.2f} GiB reserved for its "
                     "cache)")
        tables = ""
        if len(windows) > 1 or windows[0] is not None:
            sliding = sorted({int(w) for w in windows
                              if w is not None and not isinstance(w, AttentionChunk)})
            chunks = sorted({int(w) for w in windows if isinstance(w, AttentionChunk)})
            kinds = ([f"sliding windows {', '.join(map(str, sliding))}"] if sliding else []) + (
                [f"chunks of {', '.join(map(str, chunks))}"] if chunks else [])
            tables = (f" in {len(windows)} block tables ({'; '.join(kinds)}: blocks out of "
                      "sight freed)")
        self.log("KV cache: %s tokens (%s blocks of %d, %.2f GiB, %s)%s; %.1f requests of "
                 "max_model_len %d fit at once%s (%.1f s)", f"{tokens:,}", f"{num_blocks:,}",
                 block_size, num_blocks * bytes_per_block / _GIB, kv_dtype, tables,
                 fit, max_model_len, peak, self.seconds.get("kv_cache", 0.0))

    def auto_max_model_len(self, chosen: int, bound: int, num_blocks: int, block_size: int,
                           bytes_per_block: int) -> None:
        """After ``max_model_len="auto"`` took ``chosen`` (at most ``bound``, the model's
        context length) from a pool of ``num_blocks``: vLLM's "Auto-fit max_model_len"
        line."""
        self.facts.update(max_model_len=chosen, auto_max_model_len_bound=bound)
        if chosen >= bound:
            self.log("max_model_len auto: %d, the model's context length, fits in the KV "
                     "cache", chosen)
        else:
            self.log("max_model_len auto: %d, reduced from the model's %d: the longest "
                     "request the KV cache (%s blocks of %d tokens, %.2f GiB) holds", chosen,
                     bound, f"{num_blocks:,}", block_size, num_blocks * bytes_per_block / _GIB)

    def graphs(self, graphs: Any, pool_bytes: int, sets: int = 1) -> None:
        """After the CUDA graphs are captured: how many of each kind (in each of ``sets``
        sets: 2 with and without LoRA adapters' kernels), their memory."""
        counts = {"decode": len(graphs.graphs), "mixed": len(graphs.mixed_graphs),
                  "sampling tails": len(graphs.tail_graphs),
                  "drafting": len(graphs.draft_graphs)}
        self.facts.update(graph_counts=counts, graph_pool_bytes=pool_bytes, graph_sets=sets)
        self.log("CUDA graphs captured in %.1f s: %s%s; %.2f GiB of device memory",
                 self.seconds.get("graphs", 0.0),
                 ", ".join(f"{n} {kind}" for kind, n in counts.items() if n),
                 " (each twice: with and without the LoRA adapters' kernels)" if sets == 2 else "",
                 pool_bytes / _GIB)


def device_bytes_in_use(device: torch.device) -> int:
    """Bytes of device memory in use by anyone (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)
