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
- a name holding ``engine_process``: ``--engine-process`` (the engine in a child process);
- a name holding ``stream_interval_K`` (``stream_interval_4``): ``--stream-interval K``;
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
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import httpx  # noqa: E402
import soak  # noqa: E402  (the server start/stop and the synthetic tokenizer)

from mrv2.bench.serve import latency_percentiles  # noqa: E402


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
    if "engine_process" in name:  # ...engine_process...: the engine in its own process
        args += ["--engine-process"]  # (the default)
    if "engine_thread" in name:  # ...engine_thread...: on a thread of the server's process
        args += ["--no-engine-process"]
    interval = re.search(r"stream_interval_(\d+)", name)
    if interval:  # ...stream_interval_K...: --stream-interval K
        args += ["--stream-interval", interval.group(1)]
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


def server_means(url: str) -> dict[str, float]:
    """The server's own TPOT and TTFT histograms (``/metrics``): sums and counts."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        gc_pause = re.match(r"mrv2_gc_pause_seconds_total\S* (\S+)", line)
        if gc_pause:  # the server's process and the engine's, summed
            found["gc_s"] = found.get("gc_s", 0.0) + float(gc_pause.group(1))
        m = re.match(r"mrv2_time_(per_output_token|to_first_token)_seconds_(sum|count)\S* (\S+)",
                     line)
        if m:
            key = f"{'tpot' if m.group(1) == 'per_output_token' else 'ttft'}_{m.group(2)}"
            found[key] = found.get(key, 0.0) + float(m.group(3))
    return found


def merge_clients(rows: list[dict[str, Any]], rate: float) -> dict[str, Any]:
    """One row of ``bench serve`` client rows sent together: counts summed, tok/s over the
    longest client's time, latency percentiles of all clients' requests together (from their
    ``samples_ms``; one client: its own)."""
    merged: dict[str, Any] = {"rate": rate, "clients": len(rows), "per_client": rows}
    duration = max(r["duration_s"] for r in rows)
    tokens = sum(r["output_throughput"] * r["duration_s"] for r in rows)
    merged.update(completed=sum(r["completed"] for r in rows),
                  failed=sum(r["failed"] for r in rows), duration_s=duration,
                  output_throughput=tokens / duration,
                  request_throughput=sum(r["completed"] for r in rows) / duration)
    merged["client_cpu_fraction"] = max(r.get("client_cpu_fraction", 0.0) for r in rows)
    if len(rows) == 1:
        merged.update({k: v for k, v in rows[0].items() if k.endswith("_ms")})
        return merged
    samples: dict[str, list[float]] = {}
    for row in rows:
        for name, values in row["samples_ms"].items():
            samples.setdefault(name, []).extend(values)
    merged.update(latency_percentiles(samples))
    for row in rows:  # (the merged percentiles say it all; the lists would bloat the JSON)
        row.pop("samples_ms", None)
    return merged


def measure_rate(bench: list[str], url: str, rate: float, k: int, args: argparse.Namespace,
                 out: Path) -> dict[str, Any]:
    """One rate's requests from ``args.clients`` processes that start sending together; one
    row (the clients' rows merged), with the server's mean TPOT and TTFT over the rate."""
    clients = args.clients
    before = server_means(url)
    start_at = time.time() + (8.0 if clients > 1 else 0.0)  # (imports take seconds)
    procs, paths = [], []
    for c in range(clients):
        path = out / f"serve_{k}_{c}.json"
        share = args.num_requests // clients + (c < args.num_requests % clients)
        cmd = [*bench, "--rates", str(rate / clients), "--num-requests", str(share),
               "--seed", str(10 + 100 * k + c), "--json", str(path)]
        if clients > 1:
            cmd += ["--start-at", f"{start_at:.3f}", "--json-samples"]
        procs.append(subprocess.Popen(cmd))
        paths.append(path)
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"bench serve exited {proc.returncode}")
    rows = [json.loads(p.read_text())[0] for p in paths]
    after = server_means(url)
    merged = merge_clients(rows, rate)
    for name in ("tpot", "ttft"):
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        total = after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)
        merged[f"server_{name}_mean_ms"] = 1000 * total / count if count else float("nan")
    merged["gc_pause_ms"] = 1000 * (after.get("gc_s", 0.0) - before.get("gc_s", 0.0))
    return merged


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
    p.add_argument("--clients", type=int, default=1,
                   help="client processes sharing each rate's requests (one Python client "
                   "reads a few tens of thousands of chunks a second at most)")
    args = p.parse_args()
    from mrv2.bench.measure import resolve_model

    model_dir = Path(resolve_model(args.model))
    server_args = shlex.split(args.server_args)
    words = words_for(args.prompt_tokens, server_args, model_dir)
    results: dict[str, Any] = {"model": args.model, "server_args": args.server_args,
                               "prompt_words": words, "variants": {}}
    for name in args.variants:
        out = args.out / re.sub(r"[^A-Za-z0-9_.-]", "", name.replace("+", "_"))
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
            rows = [measure_rate(bench, url, float(rate), k, args, out)
                    for k, rate in enumerate(args.rates)]
        finally:
            soak.stop_server(proc, log)
        (out / "serve.json").write_text(json.dumps(rows, indent=1))
        results["variants"][name] = rows
    (args.out / "sweep.json").write_text(json.dumps(results, indent=1))
    nan = float("nan")
    print(f"\n{'variant':<34}{'rate':>6}{'TPOT p50':>10}{'TPOT p90':>10}{'TTFT p50':>10}"
          f"{'out tok/s':>11}{'server TPOT':>12}{'server TTFT':>12}{'client CPU':>11}"
          f"{'GC ms':>8}")
    for name, data in results["variants"].items():
        for row in data:
            print(f"{name:<34}{row['rate']!s:>6}{row.get('tpot_p50_ms', nan):>10.2f}"
                  f"{row.get('tpot_p90_ms', nan):>10.2f}{row.get('ttft_p50_ms', nan):>10.1f}"
                  f"{row.get('output_throughput', nan):>11.1f}"
                  f"{row.get('server_tpot_mean_ms', nan):>12.2f}"
                  f"{row.get('server_ttft_mean_ms', nan):>12.1f}"
                  f"{row.get('client_cpu_fraction', nan):>11.0%}"
                  f"{row.get('gc_pause_ms', nan):>8.1f}")
    if args.clients > 1:
        print(f"({args.clients} client processes: tok/s summed over the longest client's "
              "time; the percentiles are of all clients' requests together)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
