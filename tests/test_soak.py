"""The soak tools on the CPU: ``bench serve --mix`` checks answers right, and ``scripts/soak.py``
runs a short mixed load against a tiny ``mrv2 serve`` with every check passing."""

from __future__ import annotations

import csv
import gzip
import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from mrv2.bench.serve import Spec, StreamCheck, check_response, draw_spec
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

ROOT = Path(__file__).resolve().parents[1]


def _soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak", ROOT / "scripts" / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module
    spec.loader.exec_module(module)
    return module


def _answer(n: int, tokens: list[int], reasons: list[str], chat: bool,
            logprobs: bool) -> dict[str, Any]:
    choices = []
    for i in range(n):
        choice: dict[str, Any] = {"index": i, "finish_reason": reasons[i], "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": "x" * tokens[i]}
            if logprobs:
                choice["logprobs"] = {"content": [{"token": "x"}] * tokens[i]}
        else:
            choice["text"] = "x" * tokens[i]
            if logprobs:
                choice["logprobs"] = {"tokens": ["x"] * tokens[i]}
        choices.append(choice)
    return {"choices": choices, "usage": {"completion_tokens": sum(tokens)}}


@pytest.mark.parametrize("chat", [False, True])
def test_check_response(chat: bool) -> None:
    spec = Spec(chat=chat, stream=False, prompt="p", max_tokens=5, n=2, logprobs=True)
    good = _answer(2, [5, 2], ["length", "stop"], chat, True)
    assert check_response(spec, good) == ([], ["length", "stop"], 7)

    def problems(data: dict[str, Any]) -> list[str]:
        return check_response(spec, data)[0]

    assert problems(_answer(2, [5, 2], ["length", "abort"], chat, True))  # a bad reason
    assert problems(_answer(2, [4, 2], ["length", "stop"], chat, True))  # length, too short
    assert problems(_answer(2, [5, 2], ["length", "stop"], chat, False))  # logprobs missing
    one = _answer(2, [5, 2], ["length", "stop"], chat, True)
    one["choices"] = one["choices"][:1] * 2  # index 0 twice, 1 missing
    assert problems(one)
    wrong_usage = _answer(2, [5, 2], ["length", "stop"], chat, True)
    wrong_usage["usage"]["completion_tokens"] = 8
    assert problems(wrong_usage)
    plain = Spec(chat=chat, stream=False, prompt="p", max_tokens=5, n=2)
    bounds = _answer(2, [5, 2], ["length", "length"], chat, False)  # 7 < 2 x 5: too few
    assert check_response(plain, bounds)[0]
    assert not check_response(plain, _answer(2, [5, 5], ["length", "length"], chat, False))[0]


def _sse(chunks: list[dict[str, Any]], done: bool = True) -> list[str]:
    lines = [f"data: {json.dumps(c)}" for c in chunks]
    return lines + ["data: [DONE]"] * done


def test_stream_check() -> None:
    spec = Spec(chat=True, stream=True, prompt="p", max_tokens=3, n=2, logprobs=True)
    role = {"choices": [{"index": i, "delta": {"role": "assistant", "content": ""}}
                        for i in range(2)]}
    tok = {"content": [{"token": "x"}]}

    def chunk(i: int, reason: str | None = None) -> dict[str, Any]:
        return {"choices": [{"index": i, "delta": {"content": "x"}, "logprobs": tok,
                             "finish_reason": reason}]}

    body = [role, chunk(0), chunk(1, "stop"), chunk(0), chunk(0, "length"),
            {"choices": [], "usage": {"completion_tokens": 4}}]
    check = StreamCheck(spec)
    contents = [check.add_line(line) for line in _sse(body)]
    assert contents == [False, True, True, True, True, False, False]
    assert check.finish() == ([], ["length", "stop"], 4)

    check = StreamCheck(spec)
    for line in _sse(body, done=False):
        check.add_line(line)
    assert any("[DONE]" in p for p in check.finish()[0])

    check = StreamCheck(spec)
    for line in _sse([role, chunk(0), chunk(1, "stop"), chunk(1), chunk(0, "length"),
                      {"choices": [], "usage": {"completion_tokens": 4}}]):
        check.add_line(line)
    assert any("after its finish_reason" in p for p in check.finish()[0])

    check = StreamCheck(spec)
    check.add_line('data: {"error": {"message": "boom"}}')
    assert "boom" in check.error


def test_draw_spec_is_seeded_and_mixed() -> None:
    specs = [draw_spec(random.Random(3), i, 8, 64, True, 0.5) for i in range(3)]
    assert specs == [draw_spec(random.Random(3), i, 8, 64, True, 0.5) for i in range(3)]
    rng = random.Random(0)
    many = [draw_spec(rng, i, 8, 64, True, 0.2) for i in range(400)]
    assert {s.chat for s in many} == {True, False} and {s.stream for s in many} == {True, False}
    assert {s.n for s in many} == {1, 2, 4} and any(s.logprobs for s in many)
    assert any(s.stop for s in many) and all(16 <= s.max_tokens <= 64 for s in many)
    assert any(s.cancel_after_chunks for s in many) and any(s.cancel_after_s for s in many)
    plain = draw_spec(random.Random(0), 7, 4, 16, False, 0.5)
    assert plain.body("m")["ignore_eos"] and plain.stream and plain.cancel_after_s is None


def test_synthetic_tokenizer_covers_the_vocab(tmp_path: Path) -> None:
    from mrv2.engine.tokenizer import Tokenizer

    path = _soak().make_vocab_tokenizer(tmp_path, 1000, bos=998, eos=999)
    tok = Tokenizer(path)
    assert tok.vocab_size == 1000 and tok.eos_token_id == 999 and tok.bos_token_id == 998
    text = "hello world the capital of France is Paris 42"
    assert tok.decode(tok.encode(text)) == text
    assert all(tok.decode([i]) for i in range(997))  # every ordinary id has text
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == 997 and 999 in ids  # <|im_start|> ... <|im_end|>


def test_flatness() -> None:
    soak = _soak()
    flat = [{"t": float(t), "phase": "load", "rss": 100.0} for t in range(100)]
    f = soak.flatness(flat, "rss", 0.1, 0.2)
    assert f["growth"] == 0 and f["slope_per_min"] == 0
    leak = [{"t": float(t), "phase": "load", "rss": 100.0 + t} for t in range(100)]
    leak.append({"t": 100.0, "phase": "idle", "rss": 0.0})  # not part of the load
    f = soak.flatness(leak, "rss", 0.1, 0.2)
    assert f["growth"] == pytest.approx(90 - 20) and f["slope_per_min"] == pytest.approx(60)
    assert soak.flatness(flat, "gpu_allocated", 0.1, 0.2) is None


def test_soak_passes_on_a_tiny_server(tmp_path: Path) -> None:
    model = tmp_path / "tiny"
    make_tiny_checkpoint(model, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(model)
    out = tmp_path / "out"
    code = _soak().main([
        "--model", str(model), "--duration", "6", "--max-concurrency", "4", "--prompt-len", "4",
        "--max-tokens", "24", "--sample-interval", "0.5", "--cancel-prob", "0.2",
        "--out", str(out), "--",
        "--device", "cpu", "--dtype", "float32", "--max-model-len", "128", "--block-size", "4",
        "--num-gpu-blocks-override", "256", "--max-num-seqs", "16", "--seed", "0",
    ])
    result = json.loads((out / "soak.json").read_text())
    failed = [c for c in result["checks"] if c["status"] != "PASS"]
    assert code == 0 and result["passed"] and not failed, failed
    summary = result["summary"]
    assert summary["completed"] > 10 and summary["failed"] == 0
    assert summary["sent"] == summary["completed"] + summary["cancelled"]
    series = result["series"]
    assert len(series) > 5 and all(s["rss"] and s["blocks"] == 256 for s in series)
    assert {s["phase"] for s in series} == {"before", "load", "idle"}
    with (out / "memory.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(series)
    with gzip.open(out / "requests.jsonl.gz", "rt") as f:
        assert sum(1 for _ in f) == summary["sent"]
    assert "Uvicorn running" in (out / "server.log").read_text()


def test_serve_sweep_merges_clients_percentiles_from_their_samples() -> None:
    """scripts/serve_sweep.py --clients N: the percentiles of all clients' requests together
    (from each client's samples_ms), not the median of each client's own (which hid a slow
    client's tail: here a p90 of 1.0 ms against 100 ms)."""
    _soak()  # (serve_sweep imports it)
    spec = importlib.util.spec_from_file_location("serve_sweep",
                                                  ROOT / "scripts" / "serve_sweep.py")
    assert spec is not None and spec.loader is not None
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    from mrv2.bench.serve import percentile

    rng = random.Random(0)
    fast = [rng.uniform(0.5, 1.0) for _ in range(40)]
    slow = [rng.uniform(90.0, 110.0) for _ in range(40)]
    rows = [{"rate": 2.0, "completed": 40, "failed": 0, "duration_s": d,
             "output_throughput": 100.0, "client_cpu_fraction": 0.1,
             "tpot_p90_ms": percentile(v, 90), "samples_ms": {"ttft": v, "tpot": v, "itl": v}}
            for v, d in ((fast, 10.0), (fast, 8.0), (slow, 9.0))]
    merged = sweep.merge_clients(rows, 6.0)
    everything = fast + fast + slow
    for name in ("ttft", "tpot", "itl"):
        for q in (50, 90, 99):
            assert merged[f"{name}_p{q}_ms"] == pytest.approx(percentile(everything, q))
    assert merged["tpot_p90_ms"] > 90.0  # (the clients' median p90: about 1.0)
    assert merged["completed"] == 120 and merged["duration_s"] == 10.0
    assert merged["output_throughput"] == pytest.approx(100.0 * 27.0 / 10.0)
    assert all("samples_ms" not in row for row in merged["per_client"])
    one = sweep.merge_clients([{**rows[2], "samples_ms": {}}], 2.0)
    assert one["tpot_p90_ms"] == rows[2]["tpot_p90_ms"]
