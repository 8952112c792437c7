"""Every Triton kernel variant a real workload compiled, with what limits its residency on an
SM: registers, shared memory or threads; spills and register cliffs flagged. Run on a GPU.

Why: an 8-warp program at 139 registers a thread fits one to an SM where 128 fit two; that
cliff halved Qwen3-8B's prefill attention on an H100 (BENCHMARKS.md 2026-12-07) and no test
or profile named it. ``scripts/kernel_registers.py`` checks the attention prefill plans on any
machine; this audits whatever the engine launched (decode and mixed steps, CUDA graph sizes,
sampler, MoE, norms), as compiled for the GPU at hand.

    python scripts/kernel_audit.py --models Qwen3-8B Qwen3-0.6B Qwen3-30B-A3B:4

``NAME:L`` cuts a bundled config to ``L`` layers (the kernels are the same; loading is
faster). Weights are random (``load_format="dummy"``). A row is flagged ``spill`` (local
memory traffic), or ``cliff R->P`` where capping the registers at ``R`` (within
:data:`CLIFF_FRACTION` of today's) would fit ``P`` programs an SM instead of fewer, with
registers the binding limit.
"""

from __future__ import annotations

import argparse
import gc
import warnings
from dataclasses import dataclass
from typing import Any

#: Hopper's per-SM limits (the H100 and H200 share them): registers, threads, programs
#: (thread blocks), shared memory usable by programs and the 1 KiB each program reserves.
SM_REGISTERS = 65536
SM_THREADS = 2048
SM_PROGRAMS = 32
SM_SHARED = 228 * 1024
SHARED_RESERVED = 1024
#: Registers are granted a warp at a time, in units of 256 (8 a thread).
REGISTER_UNIT = 8
#: A cap this far under the registers used is one a kernel usually takes without spilling.
CLIFF_FRACTION = 0.88


@dataclass(frozen=True)
class Residency:
    """Programs of one kernel variant that fit an SM, by each limit, and the binding one."""

    by_registers: int
    by_shared: int
    by_threads: int
    limit: str
    cliff: tuple[int, int] | None  # (register cap, programs an SM with it)

    @property
    def programs(self) -> int:
        return min(self.by_registers, self.by_shared, self.by_threads, SM_PROGRAMS)


def _rounded(registers: int) -> int:
    return -(-max(registers, 1) // REGISTER_UNIT) * REGISTER_UNIT


def residency(registers: int, warps: int, shared: int) -> Residency:
    """How many programs of ``warps`` warps using ``registers`` a thread and ``shared`` bytes
    fit one SM, and whether a register cap within :data:`CLIFF_FRACTION` would fit more."""
    threads = 32 * warps
    by_registers = SM_REGISTERS // (_rounded(registers) * threads)
    by_shared = SM_SHARED // (shared + SHARED_RESERVED)
    by_threads = SM_THREADS // threads
    others = min(by_shared, by_threads, SM_PROGRAMS)
    limit = "registers" if by_registers < others else (
        "shared" if by_shared <= min(by_threads, SM_PROGRAMS) else "threads")
    cliff = None
    if limit == "registers":
        more = by_registers + 1
        cap = SM_REGISTERS // (threads * more) // REGISTER_UNIT * REGISTER_UNIT
        if cap >= CLIFF_FRACTION * registers and more <= others:
            cliff = (cap, more)
    return Residency(by_registers, by_shared, by_threads, limit, cliff)


def compiled_kernels() -> list[dict[str, Any]]:
    """Every compiled variant of every live ``@triton.jit`` function on this process's GPUs:
    name, the constexprs that differ between its variants, warps, stages, registers, spills,
    shared bytes (a variant never launched reports no registers and is left out)."""
    from triton.runtime.jit import JITFunction

    rows: list[dict[str, Any]] = []
    with warnings.catch_warnings():  # (isinstance wakes deprecated lazy module attributes)
        warnings.simplefilter("ignore")
        fns = [o for o in gc.get_objects() if isinstance(o, JITFunction)]
    for fn in fns:
        variants: list[Any] = []
        constants: list[dict[str, Any]] = []
        for caches in fn.device_caches.values():
            specs = _specializations(caches[1])
            for key, kernel in caches[0].items():
                if getattr(kernel, "n_regs", None) is not None:
                    variants.append(kernel)
                    constants.append(_constexprs(fn, kernel, specs.get(key)))
        varying = {n for c in constants for n, v in c.items()
                   if any(o.get(n) != v for o in constants)}
        for kernel, consts in zip(variants, constants, strict=True):
            meta = kernel.metadata
            rows.append({
                "kernel": fn.__name__, "warps": meta.num_warps, "stages": meta.num_stages,
                "registers": kernel.n_regs, "spills": kernel.n_spills, "shared": meta.shared,
                "maxnreg": getattr(meta, "maxnreg", None),
                "constexprs": {n: consts[n] for n in sorted(varying)}})
    return rows


def _specializations(key_cache: Any) -> dict[str, tuple[Any, ...]]:
    """A device's kernel cache key -> the launch's specialization (one ``(kind, value)`` pair a
    parameter, ``("constexpr", value)`` for a constexpr), read off Triton's key cache, whose
    keys are ``(specialization, options)``: compiled kernels keep no constexprs of their own."""
    out: dict[str, tuple[Any, ...]] = {}
    for key, cache_key in (key_cache.items() if isinstance(key_cache, dict) else ()):
        if isinstance(key, tuple) and key and isinstance(key[0], tuple):
            out[cache_key] = key[0]
    return out


def _constexprs(fn: Any, kernel: Any, spec: tuple[Any, ...] | None) -> dict[str, Any]:
    """A variant's constexprs by name: from its launch's specialization, else from the
    kernel's source object where a Triton version keeps one."""
    names = list(getattr(fn, "arg_names", []))
    out: dict[str, Any] = {}
    if spec is not None:
        for name, entry in zip(names, spec, strict=False):
            if isinstance(entry, tuple) and len(entry) == 2 and entry[0] == "constexpr":
                out[name] = entry[1]
        return out
    values = getattr(getattr(kernel, "src", None), "constexprs", None) or {}
    for path, value in values.items():
        index = path[0] if isinstance(path, tuple) else path
        if isinstance(index, int) and index < len(names):
            out[names[index]] = value
    return out


def run_workload(model: str, prompt_len: int, batches: list[int]) -> None:
    """One engine on ``model`` (``NAME[:LAYERS]``, random weights): prompts of several
    lengths (prefill and mixed steps), then decode batches of each size (CUDA graphs)."""
    import json
    from pathlib import Path

    import torch

    from mrv2 import LLM, SamplingParams
    from mrv2.bench.measure import release_engine_memory, resolve_model

    name, _, layers = model.partition(":")
    model_dir = resolve_model(name)
    overrides: dict[str, Any] = {}
    if layers:
        overrides["num_hidden_layers"] = int(layers)
        kinds = json.loads((Path(model_dir) / "config.json").read_text()).get("layer_types")
        if kinds:  # (kept as long as the layers)
            overrides["layer_types"] = kinds[: int(layers)]
    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16",
              max_model_len=prompt_len + 64, max_num_seqs=max(batches),
              gpu_memory_utilization=0.85, hf_overrides=overrides)
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        lengths = [prompt_len if i % 4 == 0 else 1 + (37 * i) % 200 for i in range(batch)]
        prompts = [{"prompt_token_ids": torch.randint(10, 10_000, (n,), generator=gen).tolist()}
                   for n in lengths]
        llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24,
                                             ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    del llm
    release_engine_memory()


def table(rows: list[dict[str, Any]]) -> list[str]:
    """One line a variant, the flagged ones first."""
    lines = []
    for r in rows:
        res = residency(r["registers"], r["warps"], r["shared"])
        flags = []
        if r["spills"]:
            flags.append(f"spill {r['spills']} B")
        if res.cliff:
            flags.append(f"cliff {res.cliff[0]}->{res.cliff[1]}")
        consts = " ".join(f"{k}={v}" for k, v in r["constexprs"].items())
        cap = "" if r["maxnreg"] is None else f" (cap {r['maxnreg']})"
        lines.append((not flags, r["kernel"],
                      f"{'; '.join(flags) or '-':<22} {r['kernel']:<34} w{r['warps']} "
                      f"s{r['stages']} regs {r['registers']:>3}"
                      f"{cap} "
                      f"shared {r['shared'] // 1024:>3} KiB: {res.programs}/SM by {res.limit}"
                      f"  {consts[:110]}"))
    return [line for *_, line in sorted(lines, key=lambda x: (x[0], x[1]))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["Qwen3-8B", "Qwen3-0.6B"])
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    args = p.parse_args()
    seen: set[tuple[Any, ...]] = set()
    total = flagged = 0
    for model in args.models:  # (each model's table printed at once: a cut run keeps them)
        run_workload(model, args.prompt_len, args.batches)
        rows = []
        for r in compiled_kernels():
            key = (r["kernel"], r["warps"], r["stages"], r["registers"], r["shared"],
                   tuple(sorted(r["constexprs"].items())))
            if key not in seen:
                seen.add(key)
                rows.append(r)
        lines = table(rows)
        print(f"== {model}: {len(rows)} new variants", flush=True)
        for line in lines:
            print(line, flush=True)
        total += len(rows)
        flagged += sum(not line.startswith("-") for line in lines)
    print(f"{total} variants, {flagged} flagged")

if __name__ == "__main__":
    main()
