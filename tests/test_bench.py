"""Benchmark plumbing on the CPU: the workload, the bundled config, the byte floor's inputs."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2.bench.measure import (
    StepLog,
    breakdown,
    busy_fraction,
    embedding_bytes_per_token,
    floor_seconds,
    instrument,
    kv_bytes_per_token,
    linear_flops,
    resolve_model,
    roofline_seconds,
    time_host_parts,
    weight_bytes,
)
from mrv2.bench.throughput import run_engine, workload
from mrv2.config import EngineConfig
from mrv2.engine.engine import LLMEngine
from mrv2.testing import make_tiny_checkpoint


def test_public_workload_totals() -> None:
    prompts, max_tokens = workload(256)
    assert sum(max_tokens) == 133_966
    assert sum(map(len, prompts)) == 142_827
    assert all(100 <= len(p) <= 1024 and max(p) <= 10000 for p in prompts)


def test_bundled_config_resolves() -> None:
    path = Path(resolve_model("Qwen3-0.6B"))
    assert (path / "config.json").is_file()
    with pytest.raises(ValueError, match="bundled config"):
        resolve_model("NoSuchModel-1B")


def test_counts_and_floor_inputs(tmp_path: Path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(ckpt), device="cpu",
                                                load_format="dummy", block_size=4))
    log = instrument(engine)
    produced, seconds = run_engine(engine, [[1, 2, 3], [4, 5]], [4, 6], temperature=0.6)
    assert produced == 10 and seconds > 0
    # step 1 prefills both (seq lens 3 + 2); the rest decode one token each
    assert log.steps[0] == (2, 5, 5)
    assert log.steps[1] == (2, 2, 7)
    # every parameter but the untied embedding table, of which a step reads a row a token
    table = engine.runner.model.get_submodule("model.embed_tokens").weight
    assert weight_bytes(engine.runner) == sum(
        p.numel() * 4 for p in engine.runner.model.parameters()) - table.numel() * 4
    # 2 layers x (k + v) x 2 kv heads x head_dim x 4 bytes
    head_dim = engine.runner.hf_config.head_dim
    assert kv_bytes_per_token(engine.runner) == 2 * 2 * 2 * head_dim * 4
    # no graphs on the CPU: one eager mixed (prefill) step, then eager decode steps
    assert log.kinds == ["mixed_eager"] + ["decode_eager"] * (len(log.steps) - 1)


@pytest.mark.parametrize("tied", [True, False])
def test_floor_reads_an_untied_embedding_table_a_row_per_token(tmp_path: Path,
                                                                tied: bool) -> None:
    """A tied table is the LM head's weight, read whole every step (counted once); an untied
    one is only looked up: a row per token of the step, not the whole table."""
    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", tie_word_embeddings=tied)
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(ckpt), device="cpu",
                                                load_format="dummy", block_size=4))
    runner = engine.runner
    hidden, vocab = runner.hf_config.hidden_size, runner.hf_config.vocab_size
    every = sum(p.numel() * 4 for p in runner.model.parameters())
    assert weight_bytes(runner) == every - (0 if tied else vocab * hidden * 4)
    assert embedding_bytes_per_token(runner) == (0 if tied else hidden * 4)
    log = StepLog(steps=[(2, 100, 100), (2, 2, 102)])
    kv = kv_bytes_per_token(runner)
    rows = 0 if tied else 102 * hidden * 4
    assert floor_seconds(log, runner, 1.0) == 2 * weight_bytes(runner) + 202 * kv + rows
    engine.shutdown()


def test_roofline_takes_the_longer_of_bytes_and_flops(tmp_path: Path) -> None:
    """Per step, max(bytes / bandwidth, linear FLOPs / rate): a wide prefill step is
    compute-bound, a decode step byte-bound; the FLOPs count every matrix but the embedding
    per token and the LM head per logits row."""
    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(ckpt), device="cpu",
                                                load_format="dummy", block_size=4))
    runner = engine.runner
    cfg = runner.hf_config
    named = dict(runner.model.named_parameters())
    matrices = sum(p.numel() for name, p in named.items()
                   if p.dim() >= 2 and "embed" not in name and "lm_head" not in name)
    per_token, per_row = linear_flops(runner)
    assert per_token == 2 * matrices > 0
    assert per_row == 2 * cfg.vocab_size * cfg.hidden_size
    log = StepLog(steps=[(4, 4000, 4000), (4, 4, 4004)])  # a prefill, then a decode step
    weights, kv = weight_bytes(runner), kv_bytes_per_token(runner)
    bandwidth, rate = 1e9, 1e9
    prefill_flops = 4000 * per_token + 4 * per_row
    assert prefill_flops / rate > (weights + 4000 * kv) / bandwidth  # compute-bound
    decode_bytes = weights + 4 * embedding_bytes_per_token(runner) + 4004 * kv
    assert decode_bytes / bandwidth > (4 * per_token + 4 * per_row) / rate  # byte-bound
    got = roofline_seconds(log, runner, bandwidth, rate)
    assert got == pytest.approx(prefill_flops / rate + decode_bytes / bandwidth)
    assert got > floor_seconds(log, runner, bandwidth)
    engine.shutdown()


def test_breakdown_by_step_kind_with_emulated_graphs(tmp_path: Path) -> None:
    """Steps that replay a (CPU stand-in) graph count as ``decode_graph`` or, the prompts'
    step, ``mixed_graph``; the kinds' steps, tokens and wall seconds add up to the run's."""
    from mrv2.bench.throughput import format_breakdown
    from mrv2.testing import emulate_cuda_graphs

    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(ckpt), device="cpu",
                                                load_format="dummy", block_size=4))
    emulate_cuda_graphs(engine.runner)
    log = instrument(engine)
    run_engine(engine, [[1, 2, 3], [4, 5]], [4, 6], temperature=0.6)
    end = time.perf_counter()
    kinds = breakdown(log, end)
    assert set(kinds) == {"mixed_graph", "decode_graph"}
    assert kinds["mixed_graph"]["steps"] == 1 and kinds["mixed_graph"]["tokens"] == 5
    assert sum(k["steps"] for k in kinds.values()) == len(log.steps)
    assert sum(k["tokens"] for k in kinds.values()) == sum(t for _, t, _ in log.steps)
    assert sum(k["wall_s"] for k in kinds.values()) == pytest.approx(end - log.wall[0],
                                                                    abs=1e-3)
    table = format_breakdown({"default": {"by_step_kind": kinds}})
    assert "decode_graph" in table.splitlines()[1] + table.splitlines()[2]


class _Event:
    """A stand-in CUDA event recorded at ``ms``."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, other: _Event) -> float:
        return other.ms - self.ms


def test_busy_fraction_leaves_out_the_steps_between_decode_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps busy 1 ms in each 1 ms, with a 100 ms prefill step among the middle half
    of them: the decode steps are fully busy (the prefill's time is not theirs)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    steps, events, t = [], [], 0.0
    for i in range(9):
        long = i == 4
        steps.append((4, 400, 1000) if long else (4, 4, 1000))
        events.append((_Event(t), _Event(t + (100.0 if long else 1.0))))
        t += 100.0 if long else 1.0
    log = StepLog(steps=steps, events=events)
    assert busy_fraction(log) == pytest.approx(1.0)
    events[6] = (_Event(events[6][0].ms + 0.5), events[6][1])  # 0.5 ms idle before step 6
    assert busy_fraction(log) == pytest.approx(3.5 / 4)


def test_host_parts_add_up_and_restore() -> None:
    """Each wrapped call adds its host time under its name (a nested part counts in both);
    restoring puts the very originals back."""

    class Owner:
        def outer(self) -> int:
            time.sleep(0.002)
            return self.inner() + 1

        def inner(self) -> int:
            time.sleep(0.001)
            return 1

    owner = Owner()
    inner, outer = owner.inner, owner.outer
    phases: dict[str, float] = {}
    restore = time_host_parts({"outer": (owner, "outer"), "inner": (owner, "inner")}, phases)
    assert owner.outer() == 2 and owner.outer() == 2
    assert phases["outer"] >= 0.006 and 0.002 <= phases["inner"] < phases["outer"]
    restore()
    assert owner.inner == inner and owner.outer == outer


def test_cli_parses_bench() -> None:
    from mrv2.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "throughput", "--num-requests", "8",
                                      "--variants", "async_off"])
    assert isinstance(args, argparse.Namespace) and args.num_requests == 8
    assert args.variants == ["async_off"]


def test_hf_subset_times_a_warmed_up_engine(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The HF ratio's mrv2 side runs the warm-up requests first, as HF's side and every
    variant do: its timed run pays no kernel compilation."""
    from mrv2.bench import throughput

    calls: list[list[int]] = []
    original = throughput.run_engine

    def recorded(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int],
                 temperature: float) -> tuple[int, float]:
        calls.append(max_tokens)
        return original(engine, prompts, max_tokens, temperature)

    monkeypatch.setattr(throughput, "run_engine", recorded)
    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", vocab_size=10_001,
                                max_position_embeddings=2048, num_hidden_layers=1)
    config = EngineConfig.from_kwargs(model=str(ckpt), device="cpu", load_format="dummy",
                                      max_model_len=2048)
    tok_s = throughput.mrv2_tok_s(config, [[1, 2, 3], [4, 5]], [3, 5], temperature=0.6)
    assert calls == [[8] * 4, [3, 5]] and tok_s > 0


@pytest.mark.parametrize(("argv", "flag"), [
    (["latency", "--new-tokens", "1"], "--new-tokens"),
    (["latency", "--batch-sizes", "1", "0"], "--batch-sizes"),
    (["latency", "--repeats", "0"], "--repeats"),
    (["throughput", "--num-requests", "0"], "--num-requests"),
    (["serve", "--rates", "4", "0"], "--rates"),
    (["serve", "--rates", "-1"], "--rates"),
])
def test_cli_refuses_bench_arguments_that_cannot_measure(
        argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A TPOT of one token, no requests or a rate of 0 would divide by zero after loading
    the model: refused at parsing, naming the flag and the bound."""
    from mrv2.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", *argv])
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and ("at least" in err or "above 0" in err), err


def test_throughput_bench_runs_with_shared_prefix_and_small_cache(tmp_path: Path) -> None:
    from mrv2.bench.throughput import bench
    from mrv2.entrypoints.cli import build_parser

    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", vocab_size=10_001,
                                max_position_embeddings=4096, num_hidden_layers=1)
    args = build_parser().parse_args([
        "bench", "throughput", "--model", str(ckpt), "--num-requests", "2", "--dtype",
        "float32", "--max-num-seqs", "1", "--shared-prefix", "64", "--kv-fraction", "0.9",
        "--variants", "prefix_off",
    ])
    results = bench(args)
    assert results["default"]["output_tokens"] == results["output_tokens_expected"]
    assert results["default"]["prefix_hit_rate"] > 0  # request 2 reuses request 1's prefix
    assert results["prefix_off"]["prefix_hit_rate"] == 0
    assert results["num_gpu_blocks"] > 0


def test_sampler_bench_times_every_mode(tmp_path: Path) -> None:
    from mrv2.bench.sampler import MODES, bench
    from mrv2.entrypoints.cli import build_parser

    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", vocab_size=1001,
                                num_hidden_layers=1)
    args = build_parser().parse_args(["bench", "sampler", "--model", str(ckpt), "--batch", "4",
                                      "--repeats", "3", "--dtype", "float32"])
    results = bench(args)
    assert results["vocab"] == 1001
    assert all(results[mode]["us"] > 0 for mode in MODES)


def test_latency_bench_with_ngram_variant(tmp_path: Path) -> None:
    from mrv2.bench.latency import bench
    from mrv2.entrypoints.cli import build_parser

    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", vocab_size=10_001,
                                max_position_embeddings=512, num_hidden_layers=1)
    args = build_parser().parse_args([
        "bench", "latency", "--model", str(ckpt), "--dtype", "float32", "--batch-sizes", "1",
        "2", "--prompt-len", "8", "--new-tokens", "12", "--max-model-len", "64",
        "--variants", "ngram", "synthetic_0.9", "self_draft_2",
    ])
    results = bench(args)
    assert [r["batch"] for r in results["default"]] == [1, 2]
    rows, spec = results["ngram"][:-1], results["ngram"][-1]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["host_execute_ms"] > 0 for r in rows)
    assert spec["spec_num_draft_tokens"] > 0
    assert len(spec["spec_acceptance_rate_per_pos"]) == 3
    assert spec["spec_mean_accepted_length"] >= 1.0
    synthetic = results["synthetic_0.9"][-1]
    assert synthetic["spec_num_draft_tokens"] > 0 and synthetic["spec_acceptance_rate"] > 0.5
    self_draft = results["self_draft_2"][-1]
    assert self_draft["spec_num_draft_tokens"] > 0 and self_draft["spec_acceptance_rate"] == 1.0


def test_latency_bench_lora_variants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """lora_idle / lora_1 / lora_4: random adapters shaped from the config, on no request,
    every request, and spread over four."""
    from mrv2.bench.latency import bench
    from mrv2.engine.engine import LLMEngine
    from mrv2.entrypoints.cli import build_parser

    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", vocab_size=10_001, head_dim=16,
                                max_position_embeddings=512, num_hidden_layers=1)
    used: list[int | None] = []
    add = LLMEngine.add_request

    def spy(self: LLMEngine, *args: Any, **kwargs: Any) -> str:
        lora = kwargs.get("lora_request")
        used.append(lora.lora_int_id if lora is not None else None)
        return add(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    args = build_parser().parse_args([
        "bench", "latency", "--model", str(ckpt), "--dtype", "float32", "--batch-sizes", "4",
        "--prompt-len", "8", "--new-tokens", "4", "--max-model-len", "64", "--lora-rank", "8",
        "--variants", "lora_idle", "lora_1", "lora_4",
    ])
    results = bench(args)
    assert all(results[v][0]["tpot_ms"] > 0 for v in ("lora_idle", "lora_1", "lora_4"))
    runs = [used[i:i + 4] for i in range(0, len(used), 4)]  # warm-up and run per variant
    assert runs[2:] == [[None] * 4] * 2 + [[1] * 4] * 2 + [[1, 2, 3, 4]] * 2


def test_latency_bench_sampling_params(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    """``--sampling-params`` gives the requests those keywords (here top-k / top-p sampling);
    a bad object fails at parsing, naming the flag."""
    from mrv2.bench.latency import bench
    from mrv2.entrypoints.cli import build_parser

    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", vocab_size=10_001,
                                max_position_embeddings=512, num_hidden_layers=1)
    argv = ["bench", "latency", "--model", str(ckpt), "--dtype", "float32", "--batch-sizes",
            "2", "--prompt-len", "8", "--new-tokens", "6", "--max-model-len", "64", "--no-hf",
            "--repeats", "1", "--sampling-params"]
    args = build_parser().parse_args(
        [*argv, '{"temperature": 0.6, "top_k": 20, "top_p": 0.95, "seed": 0}'])
    assert args.sampling_params == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "seed": 0}
    rows = bench(args)["default"]
    assert [r["batch"] for r in rows] == [2] and rows[0]["tpot_ms"] > 0
    for bad, says in (('{"top_p": 0}', "top_p"), ("[1]", "JSON object"),
                      ('{"max_tokens": 3}', "max_tokens")):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*argv, bad])
        assert says in capsys.readouterr().err


def test_latency_bench_on_cpu_compares_with_hf(tmp_path: Path) -> None:
    """``--device cpu``: mrv2 and HF generate on the same prompts, both timed (plumbing only:
    the numbers are not checked, only that they are there and positive). A vocabulary
    below the prompts' 10,001 ids: HF's prompts are drawn below it too, as mrv2's."""
    from mrv2.bench.latency import bench
    from mrv2.entrypoints.cli import build_parser

    ckpt = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=300,
                                max_position_embeddings=128, num_hidden_layers=1)
    args = build_parser().parse_args([
        "bench", "latency", "--device", "cpu", "--model", str(ckpt), "--batch-sizes", "1", "2",
        "--prompt-len", "6", "--new-tokens", "5", "--max-model-len", "64", "--repeats", "2",
    ])
    results = bench(args)
    assert results["device"] == "cpu" and results["threads"] == torch.get_num_threads()
    assert results["dtype"] == "float32" and results["load_format"] == "auto"
    rows = results["default"]
    assert [r["batch"] for r in rows] == [1, 2]
    for row in rows:
        for key in ("ttft_ms", "tpot_ms", "hf_ttft_ms", "hf_tpot_ms", "speedup_vs_hf"):
            assert row[key] > 0, key


def test_latency_ttft_waits_for_the_whole_batch_and_tpot_is_decode_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts that take several steps (a token budget of one prompt): TTFT runs until the
    last request's first token, and TPOT over the last one's remaining tokens is one step a
    token, not the later prompts' steps spread over the decode (a clock of one per step)."""
    from types import SimpleNamespace

    from mrv2.bench import latency

    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM")
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=str(ckpt), device="cpu", load_format="dummy", block_size=4, max_model_len=64,
        max_num_batched_tokens=8, async_scheduling=False))
    clock = [0.0]
    step = engine.step

    def counted() -> Any:
        clock[0] += 1.0
        return step()

    monkeypatch.setattr(engine, "step", counted)
    monkeypatch.setattr(latency, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    row = latency.measure(engine, 4, 8, 5)
    # 8 tokens a step, the decodes' first: the last prompt's last chunk is in step 5; the
    # old numbers were the first request's TTFT (1 step) and 2 steps a token
    assert row["ttft_ms"] == 5000.0
    assert row["tpot_ms"] == 1000.0
    engine.shutdown()


def test_latency_bench_cpu_defaults() -> None:
    from mrv2.bench.latency import CPU_DEFAULTS
    from mrv2.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "latency", "--device", "cpu"])
    assert args.model is None and args.batch_sizes is None  # filled per device by bench()
    assert CPU_DEFAULTS["model"] == "SmolLM2-135M-Instruct"
    assert CPU_DEFAULTS["dtype"] == "float32" and CPU_DEFAULTS["batch_sizes"] == [1, 8]


def test_tp_channel_bench_reports_every_step_kind(tmp_path: Path) -> None:
    """``mrv2 bench tp-channel`` through the CLI: a reader process per worker receives every
    published step; the table's rows and the JSON file agree."""
    import json

    from mrv2.entrypoints.cli import build_parser

    out = tmp_path / "tp_channel.json"
    args = build_parser().parse_args(["bench", "tp-channel", "--readers", "1", "--steps", "5",
                                      "--spin-ms", "1", "--json", str(out)])
    assert args.func(args) == 0
    rows = json.loads(out.read_text())
    assert [r["step"] for r in rows] == ["decode b1", "decode b64", "decode b256",
                                         "prefill 8x1000"]
    for r in rows:
        assert r["readers"] == 1 and r["bytes"] > 0
        assert r["publish_us"] > 0 and 0 < r["latency_us_p50"] <= r["latency_us_p99"]
    assert rows[2]["bytes"] > rows[0]["bytes"]  # 256 requests' step is bigger than one's


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the interpreter's own, per program
def test_attention_bench_tiny_checks_and_times_every_case(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``python -m mrv2_kernels.bench_attention --tiny`` (the interpreter): the reference checks
    pass and every decode case, the prefill and the mixed step (both grids, same bits) print a
    time."""
    from mrv2_kernels import bench_attention

    assert bench_attention.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert out.count(" ok") == 5 and "MISMATCH" not in out
    shapes = bench_attention.TINY
    rows = [line for line in out.splitlines() if line.split()[:1] in
            [[str(b)] for b in shapes.batches]]
    assert len(rows) == len(shapes.batches) * len(shapes.contexts)
    assert "prefill tiny 2 x 20 causal" in out.split("summary:")[1]
    assert "mixed step tiny: 3 prompts" in out.split("summary:")[1] and "flat grid" in out


def test_bench_serve_gives_each_rate_its_own_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A later rate must not meet an earlier rate's prompts in the server's prefix cache: the
    prompts are drawn from the seed a rate gets, so each rate gets its own."""
    from mrv2.bench import serve
    from mrv2.entrypoints.cli import main

    seeds: list[int] = []

    async def fake_rate(url: str, model: str, rate: float, num_requests: int, prompt_len: int,
                        max_tokens: int, api_key: str | None, seed: int,
                        samples: bool = False) -> dict[str, object]:
        seeds.append(seed)
        row: dict[str, object] = {"rate": rate, "completed": num_requests, "failed": 0,
                                  "request_throughput": 1.0, "output_throughput": 1.0,
                                  "errors": []}
        for name in ("ttft", "tpot", "itl"):
            row.update({f"{name}_p{q}_ms": 1.0 for q in (50, 90, 99)})
        return row

    monkeypatch.setattr(serve, "run_rate", fake_rate)
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--model", "m", "--rates",
                 "4", "16", "inf", "--num-requests", "3", "--seed", "5"]) == 0
    assert seeds == [5, 6, 7]


def test_outputs_bench_times_both_kinds_and_gives_the_same_answers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``mrv2 bench outputs``: each kind's four quarters, the table, the JSON; the runs it
    times are real (every request decodes all its tokens, in both kinds)."""
    import json

    from mrv2.bench import outputs as bench_outputs
    from mrv2.contract.params import RequestOutputKind
    from mrv2.entrypoints.cli import main

    out = tmp_path / "outputs.json"
    assert main(["bench", "outputs", "--requests", "3", "--tokens", "16", "--logprobs",
                 "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["kinds"]) == {"CUMULATIVE", "DELTA"}
    for kind in results["kinds"].values():
        assert [q["mean_tokens"] > 0 for q in kind["quarters"]] == [True] * 4
        assert 0 < kind["total_output_s"] < kind["total_step_s"]
    assert "us/request" in capsys.readouterr().out
    engine = bench_outputs.build_engine(2, 8)
    for kind in bench_outputs.KINDS:
        rows = bench_outputs.run_kind(engine, kind, 2, 8, False)
        assert [r[0] for r in rows] == list(range(1, 9))
    from mrv2.engine.sampling_outputs import TrackedRequest

    assert TrackedRequest.output.__qualname__ == "TrackedRequest.output"  # the timer is gone
    assert RequestOutputKind.DELTA in bench_outputs.KINDS


def test_pooling_bench_embeds_and_classifies_every_prompt(tmp_path: Path) -> None:
    """``mrv2 bench pooling``: each task pools every prompt in its own engine (the
    checkpoint read as a one-label classifier for ``classify``)."""
    from mrv2.bench.pooling import bench, workload
    from mrv2.entrypoints.cli import build_parser

    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", vocab_size=10_001,
                                max_position_embeddings=512, num_hidden_layers=1)
    args = build_parser().parse_args([
        "bench", "pooling", "--model", str(ckpt), "--dtype", "float32", "--device", "cpu",
        "--num-prompts", "12", "--min-len", "4", "--max-len", "40", "--max-model-len", "64",
        "--max-num-batched-tokens", "64",
    ])
    results = bench(args)
    assert results["prompt_tokens"] == sum(map(len, workload(12, 4, 40, 0)))
    for task in ("embed", "classify"):
        assert results[task]["prompts_per_s"] > 0 and results[task]["prompt_tok_s"] > 0


def test_sleep_bench_times_each_part_and_wakes_to_the_same_tokens(tmp_path: Path) -> None:
    """``mrv2 bench sleep``: two level-1 rounds give back tokens equal to the first ones,
    then a level-2 round; each part timed."""
    from mrv2.bench.sleep import bench
    from mrv2.entrypoints.cli import build_parser

    ckpt = make_tiny_checkpoint(tmp_path, "Qwen3ForCausalLM", vocab_size=5_100,
                                max_position_embeddings=512, num_hidden_layers=1)
    args = build_parser().parse_args([
        "bench", "sleep", "--model", str(ckpt), "--load-format", "auto", "--dtype", "float32",
        "--device", "cpu", "--max-model-len", "64", "--new-tokens", "4"])
    results = bench(args)
    rounds = results["rounds"]
    assert [r["level"] for r in rounds] == [1, 1, 2]
    assert all(r["tokens_match"] for r in rounds[:2]) and "tokens_match" not in rounds[2]
    assert all(r["sleep_s"] >= 0 and r["wake_kv_cache_s"] >= 0 for r in rounds)


#: The released models' parameter counts (their model cards; GLM-4.7's 355B counts its MTP
#: layer, not built here), against which each bundled config's model is checked.
PUBLISHED_BILLIONS = {
    "DeepSeek-V2-Lite": 15.7, "ERNIE-4.5-21B-A3B": 21.8, "GLM-4.5-Air-FP8": 106.0,
    "GLM-4.7-FP8": 355.0,
    "Qwen2.5-7B": 7.61, "Qwen2.5-VL-7B": 8.29, "Qwen3-0.6B": 0.6, "Qwen3-30B-A3B": 30.5,
    "Qwen3-32B": 32.8, "Qwen3-8B": 8.2, "Qwen3-VL-8B": 8.77, "Qwen3-Next-80B-A3B": 80.0,
    "gpt-oss-20b": 21.0,
    "gpt-oss-120b": 117.0, "gemma-3-4b-it": 4.3,
}


def test_every_bundled_config_builds_the_released_model() -> None:
    """Each config under ``mrv2/bench/configs`` builds (on the meta device, through its
    registered plugin) a model of the released model's size, within 2%."""
    from mrv2.bench.measure import CONFIGS
    from mrv2.model_loader.build import load_hf_config
    from mrv2.plugins import get_plugin_manager
    from mrv2.registry import import_object

    registries = get_plugin_manager().registries
    names = sorted(d.name for d in CONFIGS.iterdir() if (d / "config.json").exists())
    assert names == sorted(PUBLISHED_BILLIONS)  # a new config needs its published size here
    for name in names:
        config = load_hf_config(CONFIGS / name)
        model_cls = import_object(registries.resolve_model(list(config.architectures)).model)
        with torch.device("meta"):
            model = model_cls(config)
        billions = sum(p.numel() for p in model.parameters()) / 1e9
        assert abs(billions / PUBLISHED_BILLIONS[name] - 1) < 0.02, (name, billions)


def test_kernel_increments_add_up_with_overlap_and_idle() -> None:
    """PDL-style overlap (b starts before a ends), a kernel inside the work before it (c: no
    increment), idle time before d; increments and idle add up to the span."""
    from mrv2.bench.measure import kernel_increments

    intervals = [("b", 4.0, 9.0), ("a", 0.0, 5.0), ("c", 6.0, 8.0), ("d", 12.0, 13.5),
                 ("a", 13.0, 16.0)]
    incs, idle, span = kernel_increments(intervals)
    assert incs == {"a": (2, 5.0 + 2.5), "b": (1, 4.0), "c": (1, 0.0), "d": (1, 1.5)}
    assert idle == 3.0 and span == 16.0
    assert sum(total for _, total in incs.values()) + idle == span
    assert kernel_increments([]) == ({}, 0.0, 0.0)
