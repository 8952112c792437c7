"""Host time of admitting a step's new requests: the runner's batched path
(``Runner._add_requests``: one staged put per table and sampler column block) against the
same requests staged one at a time (``stage_new_row`` and ``Sampler.add_request`` each),
interleaved in one process, then packing the staged arrays for the upload.

Any machine (the host work is the same on a GPU machine; absolute times are this CPU's):
``python scripts/bench_admission.py [--requests 16 64 256] [--prompt-len 128]``. A tiny
random Qwen3 model on the CPU; requests with temperature 0.6 (no penalty rows).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from mrv2 import LLM, SamplingParams
from mrv2.contract.requests import NewRequest
from mrv2.contract.staged_edits import StagedEdits
from mrv2.testing import make_tiny_checkpoint


def one_at_a_time(runner: Any, requests: list[NewRequest], staged: StagedEdits) -> None:
    """What the runner did per request before the batched path."""
    from mrv2.contract.state_table import RowInfo

    for r in requests:
        n = len(r.token_ids)
        row = runner.table.allocate(RowInfo(r.req_id, r.num_computed_tokens, n, n))
        runner.builder.stage_new_row(row, r.token_ids, r.block_ids, r.num_computed_tokens,
                                     staged)
        runner.sampler.add_request(r, row, staged)
        runner.model_state.add_request(r, row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    path = make_tiny_checkpoint(Path(tempfile.mkdtemp()), "Qwen3ForCausalLM")
    top = max(args.requests)
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_seqs=top, block_size=16,
              max_model_len=256, enforce_eager=True)
    runner: Any = llm.engine.runner
    params = SamplingParams(temperature=0.6, max_tokens=8)
    blocks = -(-args.prompt_len // 16)
    print(f"{'requests':>8} {'one at a time ms':>17} {'batched ms':>11} {'pack ms (1 / b)':>16}")
    for count in args.requests:
        requests = [NewRequest(str(i), [(7 * i + j) % 200 for j in range(args.prompt_len)],
                               params, i, list(range(i * blocks, (i + 1) * blocks)))
                    for i in range(count)]
        best = {"one": float("inf"), "batched": float("inf")}
        pack = {"one": float("inf"), "batched": float("inf")}
        for _ in range(args.rounds):
            for name in ("one", "batched"):
                staged = StagedEdits()
                begin = time.perf_counter()
                if name == "one":
                    one_at_a_time(runner, requests, staged)
                else:
                    runner._add_requests(requests, staged)
                mid = time.perf_counter()
                staged.arrays()
                end = time.perf_counter()
                best[name] = min(best[name], (mid - begin) * 1e3)
                pack[name] = min(pack[name], (end - mid) * 1e3)
                runner.remove_requests([r.req_id for r in requests])
        print(f"{count:8d} {best['one']:17.3f} {best['batched']:11.3f} "
              f"{pack['one']:7.3f} / {pack['batched']:.3f}")


if __name__ == "__main__":
    main()
