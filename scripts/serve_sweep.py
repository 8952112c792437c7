"""A served model under a request-rate sweep, in several server configurations (issue 19's
GLM-4.7 experiment, and any other model).

    python scripts/serve_sweep.py --model GLM-4.7-FP8 --out sweep \\
        --server-args "--tensor-parallel-size 4 --max-model-len 4096" \\
        --variants mtp_off mtp_on async_off mtp_on_async_off

For each variant it starts ``mrv2 serve`` (random weights: ``--load-format dummy``; a model
without tokenizer files gets soak.py's synthetic one), waits for ``/health``, runs
``mrv2 bench serve`` at ``--rates`` with prompts of about ``--prompt-tokens`` tokens and
``--max-tokens`` outputs (ignore-eos) after an unmeasured warm-up pass (``--warmup-requests`` at
rate inf, other prompts: kernels compile on their first shapes, which a smoke run on two GPUs
showed as 55-123 ms inter-token stalls in the first measured rate), stops the server and prints
one table: TPOT p50/p90,
TTFT p50 and output tok/s per variant and rate. Variants:

- ``mtp_off``: the plain server; ``mtp_on``: MTP speculation, one draft token, with
  SYNTHETIC acceptance ``--acceptance`` (default 0.9, what GLM-4.7's MTP layer reaches on one
  draft token): random weights accept almost nothing, so each draft is kept with that
  probability whatever the model says — the output is not the model's;
- ``async_off`` / ``mtp_on_async_off``: the same with async scheduling off;
- ``ngram_on``: n-gram speculation, three draft tokens, the same synthetic acceptance;
- a name ending ``mixed_graphs_N`` (``mixed_graphs_0``, ``ngram_on_mixed_graphs_0``): the
  server with ``--max-mixed-graph-tokens N`` (0: steps with prompt tokens run eager);
- any of these followed by ``+VAR=VALUE`` (one or more): the server's environment gets the
  setting, e.g. ``plain+MRV2_ATTN_ONE_TOKEN_APART=0`` or ``plain+MRV2_MIXED_GRAPHS_MEASURED=1``
  (an A/B of an environment switch, as ``scripts/ab_env.sh`` for the offline benches).

Writes ``<variant>/server.log``, ``<variant>/serve.json`` and ``sweep.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import soak  # noqa: E402  (the server start/stop and the synthetic tokenizer)


def variant_env(name: str) -> tuple[str, dict[str, str]]:
    """A variant's name without its ``+VAR=VALUE`` suffixes, and those settings."""
    base, *settings = name.split("+")
    env = {}
    for setting in settings:
        var, sep, value = setting.partition("=")
        if not sep or not var:
            raise SystemExit(f"variant {name!r}: {setting!r} is not VAR=VALUE")
        env[var] = value
    return base, env


def variant_args(name: str, acceptance: float) -> list[str]:
    """The extra ``mrv2 serve`` flags of a variant (its ``+VAR=VALUE`` suffixes aside)."""
    name = variant_env(name)[0]
    args: list[str] = []
    if name.startswith("mtp_on"):
        spec = {"method": "mtp", "num_speculative_tokens": 1,
                "rejection_sample_method": "synthetic",
                "synthetic_acceptance_rate": acceptance}
        args += ["--speculative-config", json.dumps(spec)]
    if name.endswith("async_off"):
        args += ["--no-async-scheduling"]
    if name.startswith("ngram_on"):
        spec = {"method": "ngram", "num_speculative_tokens": 3,
                "rejection_sample_method": "synthetic",
                "synthetic_acceptance_rate": acceptance}
        args += ["--speculative-config", json.dumps(spec)]
    cap = re.search(r"mixed_graphs_(\d+)$", name)
    if cap:  # ..._mixed_graphs_N: --max-mixed-graph-tokens N
        args += ["--max-mixed-graph-tokens", cap.group(1)]
    return args


def words_for(tokens: int, server_args: list[str], model_dir: Path) -> int:
    """How many of bench serve's prompt words make about ``tokens`` tokens."""
    from transformers import AutoTokenizer

    from mrv2.bench.serve import PLAIN_WORDS

    tok_args = soak._tokenizer_args(model_dir, server_args)
    tokenizer = AutoTokenizer.from_pretrained(tok_args[1] if tok_args else str(model_dir))
    sample = " ".join(PLAIN_WORDS[i % len(PLAIN_WORDS)] for i in range(600))
    per_word = len(tokenizer(sample)["input_ids"]) / 600
    return max(1, round(tokens / per_word))


def main() -> int:
    """Run every variant and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="GLM-4.7-FP8", help="bundled config or checkpoint dir")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--server-args", default="", help="extra mrv2 serve flags (one string)")
    p.add_argument("--variants", nargs="+", default=["mtp_off", "mtp_on"])
    p.add_argument("--acceptance", type=float, default=0.9)
    p.add_argument("--rates", nargs="+", default=["1", "4", "16", "inf"])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--warmup-requests", type=int, default=32,
                   help="unmeasured requests at rate inf before the sweep (0: none)")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--startup-timeout", type=float, default=1800)
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from mrv2.bench.measure import resolve_model

    model_dir = Path(resolve_model(args.model))
    server_args = shlex.split(args.server_args)
    words = words_for(args.prompt_tokens, server_args, model_dir)
    results: dict[str, Any] = {"model": args.model, "server_args": args.server_args,
                               "prompt_words": words, "variants": {}}
    for name in args.variants:
        out = args.out / name.replace("+", "_").replace("=", "")
        out.mkdir(parents=True, exist_ok=True)
        env = variant_env(name)[1]
        saved = {var: os.environ.get(var) for var in env}
        os.environ.update(env)  # the server inherits it
        try:
            proc, url, log = soak.start_server(args, [*server_args,
                                                      *variant_args(name, args.acceptance)], out)
        finally:
            for var, value in saved.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
        bench = [sys.executable, "-m", "mrv2.entrypoints.cli", "bench", "serve", "--url", url,
                 "--prompt-len", str(words), "--max-tokens", str(args.max_tokens)]
        try:
            if args.warmup_requests:  # other prompts (seed): no prefix-cache hits later
                subprocess.run([*bench, "--rates", "inf", "--seed", "1000", "--num-requests",
                                str(args.warmup_requests)], check=True,
                               stdout=subprocess.DEVNULL)
            subprocess.run([*bench, "--rates", *args.rates, "--num-requests",
                            str(args.num_requests), "--json", str(out / "serve.json")],
                           check=True)
        finally:
            soak.stop_server(proc, log)
        results["variants"][name] = json.loads((out / "serve.json").read_text())
    (args.out / "sweep.json").write_text(json.dumps(results, indent=1))
    print(f"\n{'variant':<20}{'rate':>6}{'TPOT p50':>10}{'TPOT p90':>10}{'TTFT p50':>10}"
          f"{'out tok/s':>11}")
    for name, data in results["variants"].items():
        for row in data:
            print(f"{name:<20}{row['rate']!s:>6}{row.get('tpot_p50_ms', float('nan')):>10.2f}"
                  f"{row.get('tpot_p90_ms', float('nan')):>10.2f}"
                  f"{row.get('ttft_p50_ms', float('nan')):>10.1f}"
                  f"{row.get('output_throughput', float('nan')):>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
