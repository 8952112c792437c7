#!/usr/bin/env python
"""Soak under load: serve a model with ``mrv2 serve``, drive it at saturation with a mixed load
(``mrv2 bench serve --mix --duration``), watch ``/metrics``, then check the server's health.

    python scripts/soak.py --model Qwen3-0.6B --duration 600 --max-concurrency 128 \\
        --out soak-h200 [-- extra mrv2 serve arguments]

Checks (PASS/FAIL/SKIP; exit status 1 on any FAIL): no 5xx and no engine failures; every
request the client did not cancel completed and was valid; the server went idle (nothing
running, waiting or pending) with every KV block free; the server's aborts and finished
choices agree with the client's cancels; host RSS and GPU memory flat (median of the first
window after warm-up against the last window of the load).

Writes to ``--out``: ``server.log``, ``soak.json`` (summary, checks, the metric series),
``memory.csv`` (written as it goes) and ``requests.jsonl.gz`` (one line per request). A model
without tokenizer files (the bundled ``Qwen3-0.6B`` config) gets a synthetic byte-level BPE
tokenizer covering its whole vocabulary, with a chat template, so chat and stop strings work
on random weights.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import gzip
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

METRICS = {
    "rss": "process_resident_memory_bytes",
    "gpu_allocated": "mrv2_gpu_memory_allocated_bytes",
    "gpu_reserved": "mrv2_gpu_memory_reserved_bytes",
    "running": "mrv2_num_requests_running",
    "waiting": "mrv2_num_requests_waiting",
    "pending": "mrv2_num_requests_pending",
    "free_blocks": "mrv2_kv_cache_free_blocks",
    "blocks": "mrv2_kv_cache_blocks",
    "aborted": "mrv2_request_aborted_total",
    "failed": "mrv2_request_failed_total",
    "success": "mrv2_request_success_total",
}
CSV_FIELDS = ("t", "phase", "rss", "gpu_allocated", "gpu_reserved", "running", "waiting",
              "free_blocks", "blocks", "aborted")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_MB = 1 << 20


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {sample name: value summed over labels}."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values


def _proc_rss(pid: int) -> float | None:
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return float(pages * os.sysconf("SC_PAGE_SIZE"))


class Sampler(threading.Thread):
    """Scrapes ``/metrics`` every ``interval`` seconds into :attr:`samples`."""

    def __init__(self, url: str, interval: float, pid: int, headers: dict[str, str],
                 csv_path: Path, print_every: float) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.url, self.interval, self.pid, self.headers = url, interval, pid, headers
        self.csv = csv_path.open("w", newline="")
        self.writer = csv.DictWriter(self.csv, CSV_FIELDS, extrasaction="ignore")
        self.writer.writeheader()
        self.print_every, self.printed = print_every, -math.inf
        self.t0 = time.monotonic()
        self.phase = "before"
        self.samples: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._done = threading.Event()

    def sample(self) -> dict[str, Any] | None:
        try:
            response = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10)
            response.raise_for_status()
            values = parse_metrics(response.text)
        except (httpx.HTTPError, ValueError) as error:
            self.errors.append(f"{time.monotonic() - self.t0:.1f}s: {error!r}"[:200])
            return None
        row: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 3), "phase": self.phase,
                               "wall": time.time()}
        row.update({key: values.get(name) for key, name in METRICS.items()})
        row["rss_proc"] = _proc_rss(self.pid)
        if row["rss"] is None:  # no process collector: read /proc ourselves
            row["rss"] = row["rss_proc"]
        self.samples.append(row)
        self.writer.writerow(row)
        self.csv.flush()
        if row["t"] - self.printed >= self.print_every:
            self.printed = row["t"]
            print(f"soak: {row['t']:7.1f} s {row['phase']:>6}  RSS {_mb(row['rss'])} MB  GPU "
                  f"{_mb(row['gpu_allocated'])}/{_mb(row['gpu_reserved'])} MB  running "
                  f"{_int(row['running'])} waiting {_int(row['waiting'])}  free blocks "
                  f"{_int(row['free_blocks'])}/{_int(row['blocks'])}", flush=True)
        return row

    def run(self) -> None:
        while True:
            self.sample()
            if self._done.wait(self.interval):
                return

    def stop(self) -> None:
        """End the periodic scrapes (:meth:`sample` still works)."""
        self._done.set()
        self.join(30)


# -- the server ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_vocab_tokenizer(path: Path, vocab_size: int, bos: int | None, eos: int) -> Path:
    """A byte-level BPE tokenizer with exactly ``vocab_size`` ids (every id decodes: bytes,
    then lowercase words of 2-4 letters, with and without a leading space) and a ChatML
    template; ``eos`` is ``<|im_end|>``, ``bos`` ``<|endoftext|>`` and ``eos - 1`` (if free)
    ``<|im_start|>``, as in Qwen's vocabulary."""
    import itertools
    import random
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = {eos: "<|im_end|>"}
    if bos is not None and bos != eos:
        specials[bos] = "<|endoftext|>"
    start = next(i for i in (eos - 1, *range(vocab_size - 1, -1, -1))
                 if i >= 0 and i not in specials)
    specials[start] = "<|im_start|>"
    need = vocab_size - len(alphabet) - len(specials)
    if need < 0 or max(specials) >= vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too small for a synthetic tokenizer or "
                         f"below a special id ({sorted(specials)})")
    letters = string.ascii_lowercase
    words = ["".join(w) for k in (2, 3) for w in itertools.product(letters, repeat=k)]
    words += ["Ġ" + w for w in list(letters) + words]  # each word's prefix comes first
    if need > len(words):
        fours = ["".join(w) for w in itertools.product(letters, repeat=4)]
        words += sorted(random.Random(0).sample(fours, need - len(words)))
    vocab: dict[str, int] = {}
    merges: list[tuple[str, str]] = []
    tokens = iter(alphabet + words)
    for i in range(vocab_size):
        token = specials.get(i) or next(tokens)  # words[:need], each after its prefix
        vocab[token] = i
        if i not in specials and len(token) > 1:
            merges.append((token[:-1], token[-1]))
    raw = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(list(specials.values()))
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=specials[eos],
                                 bos_token=specials.get(bos) if bos is not None else None)
    hf.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf.save_pretrained(str(path))
    return path


def _tokenizer_args(model_dir: Path, extra: list[str]) -> list[str]:
    """``--tokenizer DIR`` for a model directory without tokenizer files (else nothing); the
    synthetic tokenizer lives in the temp dir (kept for the next run)."""
    if "--tokenizer" in extra or any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        return []
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config) if "vocab_size" not in config else config
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    vocab, bos = int(config["vocab_size"]), config.get("bos_token_id")
    eos = int(eos if eos is not None else vocab - 1)
    path = Path(tempfile.gettempdir()) / f"mrv2-soak-tokenizer-{vocab}-{bos}-{eos}"
    if not (path / "tokenizer.json").is_file():
        print(f"soak: {model_dir} has no tokenizer: writing a synthetic one to {path}")
        make_vocab_tokenizer(path, vocab, bos, eos)
    return ["--tokenizer", str(path)]


def start_server(args: argparse.Namespace, extra: list[str], out: Path
                 ) -> tuple[subprocess.Popen[bytes], str, Any]:
    from mrv2.bench.measure import resolve_model

    model_dir = Path(resolve_model(args.model))
    port = _free_port()
    cmd = [sys.executable, "-m", "mrv2.entrypoints.cli", "serve", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--load-format", args.load_format,
           "--served-model-name", Path(args.model).name,
           *_tokenizer_args(model_dir, extra), *extra]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    log = (out / "server.log").open("wb")
    print("soak: " + " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}) before it was up; see "
                               f"{out / 'server.log'}:\n{_tail(out / 'server.log')}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(proc, log)
    raise RuntimeError(f"the server was not up after {args.startup_timeout} s")


def stop_server(proc: subprocess.Popen[bytes], log: Any, timeout: float = 30.0) -> int:
    """SIGINT, then SIGKILL after ``timeout`` seconds; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()
    return int(proc.returncode)


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def access_log_statuses(path: Path) -> dict[str, int]:
    """Status codes of the server's access log (uvicorn: ``"POST /v1/... HTTP/1.1" 200``)."""
    pattern = re.compile(r'"[A-Z]+ /v1/\S* HTTP/[\d.]+" (\d{3})')
    return dict(Counter(m.group(1) for m in pattern.finditer(path.read_text(errors="replace"))))


# -- checks ----------------------------------------------------------------------------------


def flatness(samples: list[dict[str, Any]], key: str, warmup_frac: float,
             window_frac: float) -> dict[str, Any] | None:
    """Median of ``key`` over the first window after warm-up against the last window of the
    load phase, and the least-squares slope after warm-up (per minute); None without data."""
    points = [(s["t"], float(s[key])) for s in samples
              if s["phase"] == "load" and s.get(key) is not None]
    if len(points) < 2:
        return None
    t0, t1 = points[0][0], points[-1][0]
    begin = t0 + warmup_frac * (t1 - t0)
    first = [v for t, v in points if begin <= t <= begin + window_frac * (t1 - t0)]
    last = [v for t, v in points if t >= t1 - window_frac * (t1 - t0)]
    steady = [(t, v) for t, v in points if t >= begin]
    if not first or not last or len(steady) < 2:
        return None
    a, b = statistics.median(first), statistics.median(last)
    mean_t = statistics.fmean(t for t, _ in steady)
    mean_v = statistics.fmean(v for _, v in steady)
    var = sum((t - mean_t) ** 2 for t, _ in steady)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in steady) / var if var else 0.0
    return {"first": a, "last": b, "growth": b - a, "growth_pct": 100 * (b - a) / a if a else 0.0,
            "slope_per_min": slope * 60, "min": min(v for _, v in steady),
            "max": max(v for _, v in steady), "samples": [len(first), len(last)]}


def _int(value: float | None) -> int | None:
    return None if value is None else round(value)


def _check(name: str, ok: bool | None, detail: str) -> dict[str, Any]:
    return {"name": name, "status": "SKIP" if ok is None else "PASS" if ok else "FAIL",
            "detail": detail}


def run_checks(s: dict[str, Any], before: dict[str, Any], after: dict[str, Any],
               flat: dict[str, dict[str, Any] | None], statuses: dict[str, int],
               args: argparse.Namespace) -> list[dict[str, Any]]:
    def delta(key: str) -> int | None:
        if after.get(key) is None:
            return None
        return round(after[key] - (before.get(key) or 0.0))

    checks = []
    server_5xx = sum(c for code, c in statuses.items() if code.startswith("5"))
    engine_failed = delta("failed")
    checks.append(_check(
        "no 5xx", s["failed_5xx"] == 0 and server_5xx == 0 and not engine_failed,
        f"client {s['failed_5xx']}, access log {server_5xx}, engine failures {engine_failed}; "
        f"{s['errors_5xx'][:2]}"))
    checks.append(_check(
        "every non-cancelled request completed and valid", s["failed"] == 0 and s["completed"] > 0,
        f"{s['completed']} completed, {s['cancelled']} cancelled, {s['failed']} failed "
        f"({s['invalid']} invalid); {s['errors_other'][:2]}"))

    def verdict(ok: bool, *values: Any) -> bool | None:
        """FAIL without a final scrape; SKIP when only this metric is missing."""
        if not after:
            return False
        return None if any(v is None for v in values) else ok

    busy = {k: _int(after.get(k)) for k in ("running", "waiting", "pending")}
    checks.append(_check("server idle after the load", verdict(
        busy["running"] == busy["waiting"] == 0 and busy["pending"] in (None, 0),
        busy["running"], busy["waiting"]), str(busy) if after else "no /metrics after the load"))
    free, total = _int(after.get("free_blocks")), _int(after.get("blocks"))
    checks.append(_check("every KV block free", verdict(free == total and bool(total), free,
                                                        total), f"{free} free of {total}"))
    aborted, success = delta("aborted"), delta("success")
    checks.append(_check("aborts <= client cancels", verdict(
        aborted is not None and aborted <= s["cancelled"], aborted),
        f"{aborted} aborted, {s['cancelled']} cancelled by the client"))
    lo, hi = s["completed_choices"], s["completed_choices"] + s["cancelled_choices"]
    checks.append(_check("finished choices add up", verdict(
        success is not None and lo <= success <= hi, success),
        f"server finished {success}, client completed {lo} (+ up to "
        f"{hi - lo} of cancelled requests)"))
    limits = {"rss": args.max_rss_growth_mb, "gpu_allocated": args.max_gpu_growth_mb,
              "gpu_reserved": args.max_gpu_growth_mb}
    for key, limit in limits.items():
        f = flat.get(key)
        checks.append(_check(
            f"{key} flat (growth <= {limit} MB)", None if f is None
            else f["growth"] <= limit * _MB,
            "no samples" if f is None else
            f"{f['first'] / _MB:.1f} -> {f['last'] / _MB:.1f} MB "
            f"({f['growth'] / _MB:+.1f} MB, {f['growth_pct']:+.2f}%), "
            f"slope {f['slope_per_min'] / _MB:+.2f} MB/min"))
    return checks


# -- the run ---------------------------------------------------------------------------------


def _wait_idle(sampler: Sampler, timeout: float) -> dict[str, Any]:
    deadline, last = time.monotonic() + timeout, None
    while True:
        row = sampler.sample()
        last = row or last
        if row is not None and all(row.get(k) in (None, 0) for k in
                                   ("running", "waiting", "pending")) and (
                row.get("blocks") is None or row.get("free_blocks") == row.get("blocks")):
            return row
        if time.monotonic() > deadline:
            return last or {}
        time.sleep(0.5)


def _write(out: Path, result: dict[str, Any], records: list[Any]) -> None:
    (out / "soak.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    with gzip.open(out / "requests.jsonl.gz", "wt") as f:
        for record in records:
            f.write(json.dumps(record.as_dict()) + "\n")


def _mb(value: Any) -> str:
    return "-" if value is None else f"{value / _MB:.1f}"


def _print(result: dict[str, Any]) -> None:
    s, series = result["summary"], result["series"]
    print(f"\nsoak: {s['sent']} sent, {s['completed']} completed, {s['cancelled']} cancelled, "
          f"{s['failed']} failed ({s['failed_5xx']} 5xx) in {s['duration_s']:.0f} s; "
          f"{s['output_tokens']} tokens, {s['request_throughput']:.1f} req/s, "
          f"{s['output_throughput']:.0f} tok/s; finish reasons {s['finish_reasons']}; "
          f"client CPU {s['client_cpu_frac']:.0%}")
    print(f"\n{'t s':>8} {'phase':>6} {'RSS MB':>9} {'GPU alloc MB':>13} {'GPU resv MB':>12} "
          f"{'run':>5} {'wait':>5} {'free/blocks':>13}")
    step = max(1, math.ceil(len(series) / 12))
    for row in series[::step] + ([series[-1]] if (len(series) - 1) % step else []):
        blocks = f"{row.get('free_blocks')}/{row.get('blocks')}".replace(".0", "")
        print(f"{row['t']:>8.1f} {row['phase']:>6} {_mb(row.get('rss')):>9} "
              f"{_mb(row.get('gpu_allocated')):>13} {_mb(row.get('gpu_reserved')):>12} "
              f"{row.get('running') or 0:>5.0f} {row.get('waiting') or 0:>5.0f} {blocks:>13}")
    print()
    for check in result["checks"]:
        print(f"{check['status']:<5} {check['name']:<48} {check['detail']}")
    print(f"\nsoak: {'PASS' if result['passed'] else 'FAIL'} (details in {result['out']})")


def soak(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """Run the whole soak; the result that ``soak.json`` holds."""
    from mrv2.bench.serve import run_load

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    started = time.monotonic()
    proc, url, log = start_server(args, extra, out)
    startup_s = time.monotonic() - started
    try:
        sampler = Sampler(url, args.sample_interval, proc.pid, headers, out / "memory.csv",
                          args.print_every)
        before = sampler.sample() or {}
        sampler.phase = "load"
        sampler.start()
        cpu, wall = time.process_time(), time.monotonic()
        summary, records = asyncio.run(run_load(
            url, Path(args.model).name, duration=args.duration,
            max_concurrency=args.max_concurrency, mix=True, cancel_prob=args.cancel_prob,
            prompt_len=args.prompt_len, max_tokens=args.max_tokens, api_key=args.api_key,
            seed=args.seed, should_stop=lambda: proc.poll() is not None))
        # near 1: the client (one Python thread) may be what limits the load
        summary["client_cpu_frac"] = (time.process_time() - cpu) / (time.monotonic() - wall)
        sampler.stop()
        sampler.phase = "idle"
        after = _wait_idle(sampler, args.idle_timeout)
        sampler.csv.close()
    finally:
        exit_code = stop_server(proc, log)
    flat = {key: flatness(sampler.samples, key, args.warmup_frac, args.window_frac)
            for key in ("rss", "gpu_allocated", "gpu_reserved")}
    statuses = access_log_statuses(out / "server.log")
    checks = run_checks(summary, before, after, flat, statuses, args)
    checks.append(_check("server stopped cleanly on SIGINT", exit_code == 0,
                         f"exit status {exit_code}"))
    result = {
        "args": {**vars(args), "serve_args": extra}, "out": str(out),
        "passed": all(c["status"] != "FAIL" for c in checks), "checks": checks,
        "summary": summary, "server": {"before": before, "after": after,
                                       "access_log_statuses": statuses,
                                       "exit_code": exit_code, "startup_s": startup_s,
                                       "scrape_errors": sampler.errors[:20]},
        "flatness": flat, "series": sampler.samples,
    }
    _write(out, result, records)
    _print(result)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="%(prog)s [options] [-- mrv2 serve arguments]")
    p.add_argument("--model", default="Qwen3-0.6B",
                   help="checkpoint dir or bundled config name (mrv2.bench.measure)")
    p.add_argument("--load-format", default="dummy", help="'dummy': random weights")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--max-concurrency", type=int, default=128, help="requests in flight")
    p.add_argument("--out", default="soak-out", help="directory of the results")
    p.add_argument("--prompt-len", type=int, default=64, help="mean words per prompt")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="largest max_tokens (each request draws from [max/4, max])")
    p.add_argument("--cancel-prob", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--sample-interval", type=float, default=2.0, help="seconds between scrapes")
    p.add_argument("--warmup-frac", type=float, default=0.1,
                   help="fraction of the load skipped before the first memory window")
    p.add_argument("--window-frac", type=float, default=0.2,
                   help="fraction of the load in each memory window")
    p.add_argument("--max-rss-growth-mb", type=float, default=50.0)
    p.add_argument("--max-gpu-growth-mb", type=float, default=64.0,
                   help="for allocated and reserved GPU memory")
    p.add_argument("--print-every", type=float, default=30.0,
                   help="seconds between progress lines")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="seconds for the server to go idle after the load")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = build_parser().parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    return 0 if soak(args, extra)["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
