"""The ``mrv2`` command: generate, serve, bench, plugins, prepare-default-model."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from mrv2.config import format_validation_error
from mrv2.config_cli import add_cli_args, config_from_cli
from mrv2.config_compat import expand_dotted_args
from mrv2.entrypoints.http_options import add_http_args
from mrv2.entrypoints.reasoning import check_reasoning_parser
from mrv2.entrypoints.serve_options import add_serve_args
from mrv2.entrypoints.serve_plugins import add_plugin_args, preload_tool_parser_plugins
from mrv2.entrypoints.tool_calls import PARSERS
from mrv2.logs import configure_logging

logger = logging.getLogger(__name__)


def _generate(args: argparse.Namespace) -> int:
    from mrv2.contract.params import SamplingParams
    from mrv2.engine.llm import LLM

    config = config_from_cli(args, args.model)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.sampling_seed, ignore_eos=args.ignore_eos,
    )
    llm = LLM(config=config)
    tokenizer = llm.get_tokenizer()
    prompts = args.prompt or ["What is the capital of France?"]
    for prompt in prompts:
        if not args.raw and tokenizer is not None and tokenizer.chat_template:
            output = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
        else:
            output = llm.generate(prompt, params, use_tqdm=False)[0]
        print(output.outputs[0].text.strip())
    return 0


_SERVE_DEPS = ("fastapi", "uvicorn", "prometheus_client")


def _serve(args: argparse.Namespace) -> int:
    import importlib.util

    missing = [m for m in _SERVE_DEPS if importlib.util.find_spec(m) is None]
    if missing:
        print(f"mrv2 serve needs {', '.join(missing)}, which this Python lacks. Install the "
              "server extras: pip install 'mrv2[serve]' (from a checkout: "
              ".venv/bin/pip install -e '.[serve]')", file=sys.stderr)
        return 2
    from mrv2.engine.engine import LLMEngine
    from mrv2.entrypoints.server_run import listen_socket, run_server
    from mrv2.executor.tensor_parallel import launched_by_torchrun

    model = args.model_dir or args.model
    config = config_from_cli(args, model)
    from mrv2.engine.gc_pauses import gen0_threshold
    from mrv2.entrypoints.http_options import HTTPOptions
    from mrv2.entrypoints.lora_modules import parse_lora_modules
    from mrv2.entrypoints.serve_options import ServeOptions
    from mrv2.entrypoints.serve_plugins import (
        engine_process_choice,
        load_middleware,
        load_reasoning_parser_plugin,
    )
    from mrv2.entrypoints.stats_logger import log_stats_interval

    try:  # the environment's settings and the HTTP flags refused before the engine starts
        gen0_threshold()
        if not args.disable_log_stats:
            log_stats_interval()
        http = HTTPOptions.from_args(args)
        http.check()
        options = ServeOptions.from_args(args)
        engine_process = engine_process_choice(args)
        structured = config.structured_outputs  # (its reasoning_parser[_plugin] too)
        plugin = structured.server_reasoning_parser_plugin(args.reasoning_parser_plugin)
        if plugin is not None:  # (before the name is checked: it may be the plugin's)
            load_reasoning_parser_plugin(plugin)
        reasoning_parser = check_reasoning_parser(
            structured.server_reasoning_parser(args.reasoning_parser))
        middleware = load_middleware(args.middleware)
        for flag, value in (("--max-pending", args.max_pending), ("--max-n", args.max_n)):
            if value < 1:
                raise ValueError(f"{flag}={value}: expected >= 1")
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port={args.port}: expected 0 to 65535")
    except ValueError as error:
        print(f"mrv2 serve: {error}", file=sys.stderr)
        return 2

    try:
        loras = parse_lora_modules(args.lora_modules or [])
    except ValueError as error:
        print(f"mrv2 serve: {error}", file=sys.stderr)
        return 2
    if loras and not config.lora.enable_lora:
        print("mrv2 serve: --lora-modules needs --enable-lora", file=sys.stderr)
        return 2
    if args.enable_auto_tool_choice and args.tool_call_parser is None:  # vLLM's rule
        print("mrv2 serve: --enable-auto-tool-choice requires --tool-call-parser "
              "(e.g. --enable-auto-tool-choice --tool-call-parser hermes)", file=sys.stderr)
        return 2
    tool_call_parser = args.tool_call_parser if args.enable_auto_tool_choice else None
    if args.tool_call_parser is not None and tool_call_parser is None:
        logger.info("--tool-call-parser without --enable-auto-tool-choice: tool_choice \"auto\" "
                    "is refused, as vLLM's; a forced tool_choice needs no parser")
    if args.max_log_len is not None:
        logger.info("--max-log-len: mrv2 never logs prompts (accepted for vLLM's scripts; "
                    "no effect)")
    if args.log_requests is not None:
        logger.info("--%s-log-requests: mrv2 never logs request contents (accepted for vLLM's "
                    "scripts; no effect)", "enable" if args.log_requests else "disable")
    if options.collect_detailed_traces:
        logger.info("--collect-detailed-traces %s: accepted; mrv2 times no model forward per "
                    "request, so the llm_request spans carry the same attributes as without "
                    "it", ",".join(options.collect_detailed_traces))
    api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None
    sock = None  # the server's socket, bound before anything loads (torchrun: rank 0's)
    if not launched_by_torchrun() or os.environ.get("RANK", "0") == "0":
        try:
            sock = listen_socket(args.host, args.port)
        except OSError as error:
            print(f"mrv2 serve: cannot listen on {args.host}:{args.port}: "
                  f"{error.strerror or error}", file=sys.stderr)
            return 2

    own_process = engine_process
    if own_process is None:  # the default: a process of its own, but not under torchrun
        own_process = not launched_by_torchrun()
    elif own_process and launched_by_torchrun():
        print("mrv2 serve: --engine-process runs the engine in a child of this process; "
              "under torchrun every rank is started by torchrun: leave the flag out",
              file=sys.stderr)
        if sock is not None:
            sock.close()
        return 2
    try:
        if own_process:
            from mrv2.entrypoints.engine_process import RemoteEngine

            engine: LLMEngine | RemoteEngine = RemoteEngine(config, args.max_pending)
        else:
            engine = LLMEngine(config)
    except BaseException:
        if sock is not None:
            sock.close()
        raise
    return run_server(engine, args.host, args.port, args.served_model_name, api_key,
                      args.max_pending, args.max_n, log_stats=not args.disable_log_stats,
                      uvicorn_log_level=args.uvicorn_log_level,
                      access_log=not args.disable_uvicorn_access_log, sock=sock,
                      reasoning_parser=reasoning_parser,
                      tool_call_parser=tool_call_parser, http=http,
                      enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                      lora_modules=loras,
                      trust_request_chat_template=args.trust_request_chat_template,
                      options=options, middleware=middleware)


def _plugins(args: argparse.Namespace) -> int:
    from mrv2.plugins import get_plugin_manager

    manager = get_plugin_manager()
    for info in manager.list_plugins():
        version = f" {info.version}" if info.version else ""
        print(f"{info.name}{version}  [{info.source}]")
        print(f"    hooks: {', '.join(info.hooks)}")
    registries = manager.registries
    print("architectures:")
    for entry in registries.models.values():
        print(f"    {entry.architecture}  ({entry.plugin}: {entry.model})")
    print("attention backends: " + ", ".join(registries.attention_backends))
    print("speculators: " + (", ".join(registries.speculators) or "none"))
    print("logits processors: " + (", ".join(registries.logits_processors) or "none"))
    if registries.failed_plugins:
        print("failed to load:")
        for name, why in registries.failed_plugins.items():
            print(f"    {name}: {why}")
    return 0


def _prepare_default(args: argparse.Namespace) -> int:
    from mrv2.model_loader.default_model import ensure_default_model

    print(ensure_default_model(force=args.force))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="mrv2", description="mrv2 inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompt", nargs="*", help="prompt text (default: a sample question)")
    gen.add_argument("--model", default=None, help="HF checkpoint dir (default: SmolLM2-135M)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of the request")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_cli_args(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    serve.add_argument("model_dir", nargs="?", default=None,
                       help="HF checkpoint dir (default: SmolLM2-135M)")
    serve.add_argument("--model", default=None, help="same as MODEL_DIR")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require Authorization: Bearer KEY on every route but /health, "
                       "/metrics, /version, /tokenize, /detokenize, /load and "
                       "/tokenizer_info (default: the "
                       "VLLM_API_KEY environment variable, as vLLM's)")
    serve.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                       default=None, help="vLLM's flag, accepted for its launch scripts: "
                       "mrv2 never logs request contents (no effect)")
    serve.add_argument("--enable-log-requests", dest="log_requests", action="store_true",
                       default=None, help="vLLM's flag, accepted for its launch scripts: "
                       "mrv2 never logs request contents (no effect)")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="the model's name in the API (several: aliases requests may "
                       "use; answers carry the first). Default: the model's path")
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories) served under their own model "
                       "names: NAME=PATH or JSON {\"name\": ..., \"path\": ...} (needs "
                       "--enable-lora)")
    serve.add_argument("--max-pending", type=int, default=1024,
                       help="sequences in flight (a request counts its n) before 503")
    serve.add_argument("--max-n", type=int, default=64,
                       help="largest n a request may ask for (400 above; capped by --max-pending)")
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="run the engine in a process of its own, as vLLM's engine core "
                       "(the default, except under torchrun, where every rank is a process "
                       "torchrun started): the server's event loop and the engine do not "
                       "share one GIL; --no-engine-process runs it on a thread of the "
                       "server's process")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="no stats line (throughput, requests, KV cache, prefix cache hits) "
                       "every MRV2_LOG_STATS_INTERVAL seconds (default 10) while the engine "
                       "has work")
    serve.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help="chat answers carry the model's <think> text as "
                       "reasoning_content (qwen3: the output opens the block; deepseek_r1: "
                       "the prompt does; minimax_m2: MiniMax-M2's, as deepseek_r1; "
                       "minimax_m2_append_think: MiniMax-M2's block left in the content, its "
                       "<think> put back; openai_gptoss: gpt-oss's harmony analysis channel; "
                       "deepseek_v3 / glm45 / glm47 / holo2 / exaone4 / nemotron_v3: as "
                       "deepseek_r1 where the request's chat_template_kwargs turn thinking "
                       "on; ernie45: "
                       "ERNIE-4.5 Thinking's; seed_oss: <seed:think>; mistral: Magistral's "
                       "[THINK]; gemma4: Gemma 4's <|channel>thought; granite: Granite's "
                       "'Here is my thought process:' text; kimi_k2: as deepseek_r1, a "
                       "tool-call section also ends the thinking, chat_template_kwargs "
                       "thinking: false turns it off; olmo3 / step3: as deepseek_r1; "
                       "step3p5: as deepseek_r1, the newlines around </think> dropped; "
                       "hunyuan_a13b: Hunyuan-A13B's <think> / <answer>; mimo: as qwen3; "
                       "or a name a --reasoning-parser-plugin file registers)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="chat requests may offer tools (tool_choice \"auto\"); the "
                       "model's calls come back as tool_calls (needs --tool-call-parser)")
    serve.add_argument("--tool-call-parser", default=None, choices=tuple(PARSERS),
                       help="how the model writes its calls (vLLM's names): hermes (Qwen2.5, "
                       "Qwen3), qwen3_coder / qwen3_xml (Qwen3-Coder), glm45 (GLM-4.5/4.6), "
                       "glm47 (GLM-4.7), minimax_m2 (MiniMax-M2), deepseek_v3 (DeepSeek-V3), "
                       "deepseek_v31 (DeepSeek-V3.1), deepseek_v32 (DeepSeek-V3.2), kimi_k2 "
                       "(Kimi-K2), llama3_json / llama4_json (Llama 3.x, 4), "
                       "pythonic / llama4_pythonic (Llama 3.2, 4), mistral (Mistral, "
                       "Ministral, Magistral, Devstral: [TOOL_CALLS]), openai (gpt-oss's "
                       "harmony format), or a name a --tool-parser-plugin file registers")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's log level (default info)")
    serve.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="no uvicorn line per HTTP request (host time at high request "
                       "rates)")
    serve.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage carries prompt_tokens_details.cached_tokens (the prompt "
                       "tokens the prefix cache held)")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="render a chat request's own chat_template (else refused with "
                       "a 400), as vLLM's flag")
    add_http_args(serve)
    add_serve_args(serve)
    add_plugin_args(serve)
    add_cli_args(serve)
    serve.set_defaults(func=_serve)

    plugins = sub.add_parser("plugins", help="list loaded plugins and what they registered")
    plugins.set_defaults(func=_plugins)

    bench = sub.add_parser("bench", help="benchmarks: throughput, latency, pooling...")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from mrv2.bench import detokenize, latency, multimodal, pooling, sampler, throughput, tp_channel
    from mrv2.bench import outputs as bench_outputs
    from mrv2.bench import serve as bench_serve
    from mrv2.bench import sleep as bench_sleep

    throughput.add_parser(bench_sub)
    latency.add_parser(bench_sub)
    multimodal.add_parser(bench_sub)
    sampler.add_parser(bench_sub)
    detokenize.add_parser(bench_sub)
    bench_outputs.add_parser(bench_sub)
    tp_channel.add_parser(bench_sub)
    bench_serve.add_parser(bench_sub)
    pooling.add_parser(bench_sub)
    bench_sleep.add_parser(bench_sub)

    prep = sub.add_parser(
        "prepare-default-model", help="convert the bundled SmolLM2 GGUF once, print its dir"
    )
    prep.add_argument("--force", action="store_true", help="convert again")
    prep.set_defaults(func=_prepare_default)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mrv2`` console script."""
    try:  # (before the parser: --tool-call-parser takes the names the file registers)
        preload_tool_parser_plugins(sys.argv[1:] if argv is None else argv)
    except ValueError as error:
        print(f"mrv2 serve: {error}", file=sys.stderr)
        return 2
    parser = build_parser()  # (vLLM's -cc.key=value forms: -O.key=value, -O's whole value)
    args = parser.parse_args(expand_dotted_args(list(sys.argv[1:] if argv is None else argv)))
    try:
        configure_logging()
        return int(args.func(args))
    except ValidationError as error:
        print(f"mrv2: {format_validation_error(error)}", file=sys.stderr)
    except (ValueError, FileNotFoundError, RuntimeError, ImportError) as error:
        print(f"mrv2: error: {error}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
