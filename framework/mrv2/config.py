"""Engine configuration: pydantic models, one section per concern.

Every section validates at construction: a bad value raises ``pydantic.ValidationError`` naming
the field and what is allowed. ``EngineConfig.from_kwargs`` takes vLLM's flat EngineArgs names
(``max_model_len=...``), ``EngineConfig.from_file`` a YAML or JSON file of the same flat names or
of sections, and :mod:`mrv2.config_cli` turns them into CLI flags.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from mrv2 import config_compat

DType = Literal["auto", "float32", "bfloat16", "float16"]
#: vLLM's other names of a dtype (``--dtype half``), stored as the names above.
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
#: ``logprobs_mode`` values mrv2 computes (vLLM's processed_* modes are refused).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits")
#: ``tokenizer_mode`` values mrv2 loads ('hf' is vLLM's other name of 'auto').
TOKENIZER_MODES = ("auto", "hf", "slow")
#: ``model_impl`` values mrv2 runs (its own implementations; vLLM's 'vllm' names them too).
MODEL_IMPLS = ("auto", "vllm")


def positive_number_from_env(name: str, kind: type[int] | type[float], what: str
                             ) -> int | float | None:
    """Environment variable ``name`` as a positive finite ``kind`` (None when unset or
    empty); ValueError naming the variable and ``what`` is expected otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = kind(raw)
    except ValueError:
        value = 0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{name}={raw!r}: expected a positive {what}")
    return value


def read_chat_template(value: str) -> str:
    """``--chat-template``'s value as template text: a file's contents when ``value`` names
    one, else ``value`` itself when it looks like a template (it has ``{``). ValueError on a
    missing file or a template Jinja cannot parse (checked as transformers compiles chat
    templates, where that is importable)."""
    text = value
    if "{" not in value and "\n" not in value:  # a path, not a template
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"chat_template={value!r}: no such file; give the path of a Jinja "
                             "file or the template itself")
        text = path.read_text(encoding="utf-8")
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # (another transformers: the first chat request reports it)
        return text
    import jinja2

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat_template is not a valid Jinja template (line {error.lineno}: "
                         f"{error.message})") from None
    return text


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


def _one_of(field: str, value: str, allowed: tuple[str, ...], known: tuple[str, ...],
            why: str) -> str:
    """``value`` where ``allowed`` holds it, else ValueError naming ``field`` and the allowed
    values (and ``why`` for vLLM's values mrv2 does not take, ``known``)."""
    if value not in allowed:
        reason = f" is not supported: {why}" if value in known else ""
        raise ValueError(f"{field}={value!r}{reason}; allowed: "
                         + ", ".join(map(repr, allowed)))
    return value


class ModelConfig(_Section):
    """What to load and how: checkpoint directory, dtype, context length, seed."""

    model: str | None = Field(
        default=None, description="HF checkpoint directory; None means the default model"
    )
    tokenizer: str | None = Field(default=None, description="tokenizer directory (default: model)")
    dtype: DType = Field(
        default="auto", description="weights and activations dtype (also vLLM's 'half' = "
        "float16 and 'float' = float32)")
    max_model_len: int | None = Field(
        default=None,
        description="longest sequence (prompt + output); default from config; 'auto' or -1 "
        "(vLLM's): the longest that fits in the KV cache, at most the model's (resolved at "
        "start-up, logged)",
    )
    seed: int = Field(default=0, ge=0, description="seed of unseeded requests and dummy weights")
    load_format: Literal["auto", "safetensors", "dummy"] = Field(
        default="auto", description="'dummy' draws random weights (benchmarks)"
    )
    quantization: Literal["fp8", "gptq", "awq", "gptq_marlin", "awq_marlin",
                          "compressed-tensors", "mxfp4"] | None = Field(
        default=None,
        description="'fp8': quantize the linear layers' weights to block-scaled FP8 (128 x 128 "
        "blocks) at load time; 'gptq' / 'awq' / 'compressed-tensors' (or vLLM's 'gptq_marlin' "
        "/ 'awq_marlin'): the checkpoint's integer weights, or random 4-bit ones with "
        "load_format='dummy'; 'mxfp4': the routed experts' MXFP4 weights (gpt-oss); a "
        "quantized checkpoint (quantization_config) needs no flag",
    )
    generation_config: str = Field(
        default="auto",
        description="sampling defaults for what a request leaves unset: 'auto' (the model's "
        "generation_config.json: temperature, top_k, top_p, min_p, repetition_penalty, "
        "max_new_tokens, as vLLM), 'none' or 'vllm' (the engine's own), or a directory "
        "holding a generation_config.json",
    )
    override_generation_config: dict[str, Any] = Field(
        default_factory=dict,
        description="generation config fields to set on top of it, as JSON: "
        "'{\"temperature\": 0.5}'",
    )
    hf_overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="config.json fields to change, as JSON: '{\"num_hidden_layers\": 40}' runs "
        "a model's first 40 layers (with --load-format dummy: a checkpoint must match)",
    )
    runner: Literal["auto", "generate", "pooling"] = Field(
        default="auto",
        description="'pooling': an embedding model (vLLM's --runner pooling): only embedding "
        "requests, and a checkpoint without an LM head loads (Qwen3-Embedding-8B); 'auto' "
        "and 'generate': text generation (embedding requests too)",
    )
    chat_template: str | None = Field(
        default=None,
        description="a Jinja chat template, or the path of a file holding one, used instead of "
        "the tokenizer's (chat completions, LLM.chat, /tokenize); checked before anything loads",
    )

    disable_sliding_window: bool = Field(
        default=False,
        description="vLLM's: a model with a sliding window (Mistral, the local layers of "
        "Gemma 2/3/4, gpt-oss, OLMo 3, Qwen2 with use_sliding_window...) attends over all "
        "keys on every layer, and max_model_len is at most the window (its default; a longer "
        "one is refused); no effect on a model without one",
    )
    max_logprobs: int = Field(
        default=20, ge=-1,
        description="most logprobs / prompt_logprobs one request may ask for (vLLM's; -1: "
        "the whole vocabulary); a request asking more is refused naming the field",
    )
    logprobs_mode: str = Field(
        default="raw_logprobs",
        description="what logprobs report (vLLM's): 'raw_logprobs' (log-softmax of the "
        "model's logits) or 'raw_logits' (the logits themselves); prompt logprobs are "
        "log-probabilities either way. 'processed_logprobs' / 'processed_logits' (after "
        "penalties, temperature, top-k/top-p) are refused",
    )
    tokenizer_mode: str = Field(
        default="auto",
        description="'auto' (or vLLM's 'hf': the fast tokenizer where there is one) or "
        "'slow' (use_fast=False, as vLLM: the Python tokenizer where transformers has one "
        "for the checkpoint); vLLM's 'mistral' and 'custom' are refused",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="let the tokenizer's own code (tokenizer_config.json's auto_map) load; "
        "mrv2 runs its own model code, never the checkpoint's",
    )
    revision: str | None = Field(
        default=None,
        description="vLLM's hub revision, accepted for its scripts: mrv2 loads a local "
        "directory, which has no revision (vLLM ignores it for a local path too)",
    )
    skip_tokenizer_init: bool = Field(
        default=False,
        description="load no tokenizer (vLLM's): prompts must be token ids, outputs carry "
        "token ids and empty text; stop strings, bad words, chat and text prompts are refused",
    )
    enable_prompt_embeds: bool = Field(default=False, description="take prompts given as "
        "embeddings (vLLM's; 'prompt_embeds'), from trusted clients: the server loads them")
    tokenizer_revision: str | None = Field(
        default=None, description="as revision, for the tokenizer (no effect on a directory)")
    code_revision: str | None = Field(
        default=None, description="as revision, for the model's code (no effect: mrv2 runs "
        "its own model code)")
    model_impl: str = Field(
        default="auto",
        description="vLLM's choice of model implementation: 'auto' and 'vllm' run mrv2's own "
        "(the only ones it has); 'transformers' and 'terratorch' are refused",
    )
    disable_cascade_attn: bool = Field(
        default=False,
        description="vLLM's flag, accepted for its scripts: mrv2 has no cascade attention, so "
        "it changes nothing",
    )
    download_dir: str | None = Field(
        default=None,
        description="vLLM's directory for hub downloads, accepted for its scripts: mrv2 "
        "downloads nothing (it loads the --model directory), so it has no effect",
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: Any) -> Any:
        return _DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value

    @field_validator("max_model_len", mode="before")
    @classmethod
    def _auto_max_model_len(cls, value: Any) -> Any:
        return AUTO_MAX_MODEL_LEN if _is_auto_length(value) else value

    @field_validator("max_model_len")
    @classmethod
    def _positive_or_auto(cls, value: int | None) -> int | None:
        if value is not None and value < 1 and value != AUTO_MAX_MODEL_LEN:
            raise ValueError("expected a length >= 1, or 'auto' / -1 (the longest that fits "
                             "in the KV cache)")
        return value

    @property
    def auto_max_model_len(self) -> bool:
        """``max_model_len`` is ``"auto"`` / -1: the runner takes the longest length, at most
        the model's, one request of which its KV cache holds."""
        return self.max_model_len == AUTO_MAX_MODEL_LEN

    @property
    def fixed_max_model_len(self) -> int | None:
        """``max_model_len`` where the caller gave a length; None where the model's context
        length bounds it (unset, or ``"auto"``: the engine's ``max_model_len``, known once
        the KV cache is sized, is at most that)."""
        return None if self.auto_max_model_len else self.max_model_len

    @field_validator("logprobs_mode")
    @classmethod
    def _supported_logprobs_mode(cls, value: str) -> str:
        return _one_of("logprobs_mode", value, LOGPROBS_MODES, (
            "processed_logprobs", "processed_logits"),
            "mrv2 computes logprobs from the raw logits only")

    @field_validator("tokenizer_mode")
    @classmethod
    def _supported_tokenizer_mode(cls, value: str) -> str:
        return _one_of("tokenizer_mode", value, TOKENIZER_MODES, ("mistral", "custom"),
                       "mrv2 loads Hugging Face tokenizers only")

    @field_validator("model_impl")
    @classmethod
    def _own_model_impl(cls, value: str) -> str:
        return _one_of("model_impl", value, MODEL_IMPLS, ("transformers", "terratorch"),
                       "mrv2 runs its own model implementations only")

    @field_validator("chat_template")
    @classmethod
    def _read_chat_template(cls, value: str | None) -> str | None:
        return None if value is None else read_chat_template(value)


class MultiModalConfig(_Section):
    """Media in prompts (multimodal models)."""

    limit_mm_per_prompt: int = Field(
        default=4, ge=0, le=64,
        description="images (and as many audio clips, videos) one prompt may carry at most; "
        "also vLLM's JSON form '{\"image\": 2}' (one count for every modality)"
    )
    allow_remote_media: bool = Field(
        default=False,
        description="fetch http(s) image URLs (off: data: URIs and in-memory images only)",
    )

    mm_processor_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments for the model's Hugging Face image processor, as JSON "
        "('{\"max_pixels\": 1003520}'); refused at start-up where the processor takes no "
        "such argument",
    )
    allowed_local_media_path: str | None = Field(
        default=None,
        description="a directory whose files requests may name as file:// image URLs (off: "
        "no local files are read)",
    )

    @field_validator("allowed_local_media_path")
    @classmethod
    def _existing_directory(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        path = Path(value).expanduser()
        if not path.is_dir():
            raise ValueError(f"allowed_local_media_path={value!r} is not a directory")
        return str(path.resolve())

    @field_validator("limit_mm_per_prompt", mode="before")
    @classmethod
    def _per_modality(cls, value: Any) -> Any:
        """vLLM's mapping of counts per modality to mrv2's one count (every modality's)."""
        if not isinstance(value, dict):
            return value
        counts = list(value.values())
        unknown = sorted(map(str, set(value) - {"image", "audio", "video"}))
        if unknown or not counts or any(
                not isinstance(c, int) or c != counts[0] for c in counts):
            raise ValueError(
                "expected a count, or a JSON object of the same count for each modality "
                f"(image, audio, video), such as {{\"image\": 2}}: mrv2 has one limit for "
                f"them all; got {value}")
        return counts[0]


class CacheConfig(_Section):
    """Paged KV cache: block size, how many blocks, prefix caching."""

    block_size: Literal[1, 2, 4, 8, 16, 32, 64, 128] = Field(
        default=16, description="tokens per KV block"
    )
    num_gpu_blocks_override: int | None = Field(
        default=None, ge=1, description="KV block count (on whatever device)"
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0, description="fraction of device memory mrv2 may use"
    )
    cpu_kv_cache_gb: float = Field(
        default=2.0, gt=0.0, allow_inf_nan=False,
        description="KV cache size on the CPU device, in GiB"
    )
    kv_cache_memory_bytes: int | None = Field(
        default=None, ge=1,
        description="KV cache size in bytes (vLLM's; also 8G, 512M...), on any device, instead "
        "of gpu_memory_utilization's fraction (or cpu_kv_cache_gb)",
    )
    swap_space: float = Field(
        default=0.0, ge=0.0,
        description="vLLM's CPU swap space in GiB, accepted and unused: mrv2 preempts by "
        "recomputing, as vLLM's V1 engine does, and never swaps the KV cache out",
    )
    cpu_offload_gb: float = Field(
        default=0.0, ge=0.0,
        description="vLLM's weight offload to CPU memory in GiB: mrv2 keeps every weight on "
        "the device; 0 is accepted, more is refused",
    )
    calculate_kv_scales: bool = Field(
        default=False,
        description="vLLM's computed fp8 KV scales: mrv2's fp8 KV cache uses a scale of 1.0; "
        "off is accepted, on is refused",
    )
    enable_prefix_caching: bool = Field(
        default=True, description="reuse the KV of full blocks shared with earlier requests"
    )
    state_snapshot_slots: int | None = Field(
        default=None, ge=0,
        description="a model with per-request recurrent state (linear attention, Mamba): how "
        "many snapshots of that state at block boundaries prefix caching keeps (each costs "
        "one request's state in memory); None: min(64, max_num_seqs); 0: prefix caching off "
        "for such a model",
    )
    # vLLM's names. "fp8" = "fp8_e4m3": a per-tensor scale of 1.0 (vLLM's without calibrated
    # scales); half the bytes a token of "auto" (bf16), so twice the tokens fit and a decode
    # step reads half the KV bytes.
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        default="auto",
        description="KV cache element type: 'auto' (the model's dtype) or 'fp8' / 'fp8_e4m3' "
        "(float8 e4m3, values saturated to +-448)",
    )

    @field_validator("cpu_offload_gb")
    @classmethod
    def _nothing_offloaded(cls, value: float) -> float:
        if value > 0:
            raise ValueError(f"cpu_offload_gb={value:g} is not supported: mrv2 keeps every "
                             "weight on the device; allowed: 0")
        return value

    @field_validator("calculate_kv_scales")
    @classmethod
    def _no_kv_scales(cls, value: bool) -> bool:
        if value:
            raise ValueError("calculate_kv_scales=True is not supported: mrv2's fp8 KV cache "
                             "uses a scale of 1.0; allowed: False")
        return value


class SchedulerConfig(_Section):
    """Continuous batching: batch width, token budget, chunked prefill, async scheduling."""

    max_num_seqs: int = Field(default=256, ge=1, description="requests in one step at most")
    # 8192: on the H200 (BENCHMARKS.md, 2026-12-01) 16384 gained 0.3% (Qwen3-8B) / 1.2%
    # (0.6B) of throughput, one run each, while a mixed step then stalls every running decode
    # for 341 ms instead of ~190 ms (8B); 4096 lost 0.8% / 4%.
    max_num_batched_tokens: int = Field(
        default=8192, ge=1, description="tokens in one step at most (the token budget); "
        "with chunked prefill off at least max_model_len (the default is raised to it)"
    )
    enable_chunked_prefill: bool = Field(default=True, description="split long prompts")
    async_scheduling: bool = Field(
        default=True, description="schedule step N+1 while step N runs"
    )
    max_waiting: int = Field(default=100_000, ge=1, description="bound of the waiting queue")
    stream_interval: int = Field(
        default=1, ge=1,
        description="a streamed request's output every this many tokens (its first token and "
        "its end at once): fewer, larger chunks for less host work a token under load",
    )
    long_prefill_token_threshold: int = Field(
        default=0, ge=0,
        description="the most tokens of one request a step computes (vLLM's; 0: no cap but "
        "the token budget): a long prompt's prefill takes steps of at most this many tokens, "
        "leaving the rest of the budget to other requests (also with chunked prefill off, "
        "as in vLLM)",
    )
    max_num_partial_prefills: int = Field(
        default=1, ge=1,
        description="vLLM's concurrent partial prefills, which its V1 engine refuses too: 1 "
        "is accepted, more is refused (long_prefill_token_threshold caps a prompt's chunks)",
    )
    max_long_partial_prefills: int = Field(
        default=1, ge=1, description="as max_num_partial_prefills: 1 is accepted, more is "
        "refused")
    policy: Literal["fcfs", "priority"] = Field(
        default="fcfs",
        description="'fcfs' or 'priority' (vLLM's --scheduling-policy): waiting requests "
        "by (priority, arrival), lower first; preemption takes the largest. Under 'fcfs' a "
        "request's priority must be 0",
    )

    @field_validator("max_num_partial_prefills", "max_long_partial_prefills")
    @classmethod
    def _no_concurrent_partial_prefills(cls, value: int, info: ValidationInfo) -> int:
        if value > 1:
            raise ValueError(
                f"{info.field_name}={value} is not supported: concurrent partial prefill "
                "(vLLM's V1 engine refuses it too); allowed: 1. long_prefill_token_threshold "
                "caps the tokens one prompt takes a step")
        return value

    def fit_token_budget(self, max_model_len: int) -> None:
        """vLLM's rule with chunked prefill off, where a prompt runs in one step: the default
        ``max_num_batched_tokens`` is raised to ``max_model_len`` (else every longer prompt
        would be refused), and a budget the caller set below it refuses to start. The
        runner calls it once ``max_model_len`` is known, before sizing its buffers."""
        if self.enable_chunked_prefill or self.max_num_batched_tokens >= max_model_len:
            return
        if "max_num_batched_tokens" in self.model_fields_set:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({max_model_len}) with chunked prefill off: every prompt "
                "longer than it would be refused. Raise max_num_batched_tokens, lower "
                "max_model_len, or enable chunked prefill")
        self.max_num_batched_tokens = max_model_len
        # (still the default's: a config used again for a longer model is raised again)
        self.model_fields_set.discard("max_num_batched_tokens")


class ParallelConfig(_Section):
    """Parallelism: tensor parallelism over ``tensor_parallel_size`` processes (a GPU each; on
    the CPU, gloo). On one host the engine starts them; across hosts ``torchrun`` does."""

    tensor_parallel_size: int = Field(
        default=1, ge=1, le=64,
        description="ranks to split the model over (one process and one GPU each)")
    enable_expert_parallel: bool = Field(
        default=False,
        description="split mixture-of-experts layers by whole experts across the ranks "
        "(each rank holds num_experts / tensor_parallel_size of them) instead of splitting "
        "every expert's columns; attention stays tensor-parallel")
    pipeline_parallel_size: int = Field(
        default=1, ge=1,
        description="vLLM's pipeline parallelism (-pp): mrv2 splits a model by tensor "
        "parallelism only (tensor_parallel_size); 1 is accepted, more is refused")
    data_parallel_size: int = Field(
        default=1, ge=1,
        description="vLLM's data parallelism (-dp): mrv2 runs one replica (split by "
        "tensor_parallel_size); 1 is accepted, more is refused: start one server per replica")
    disable_custom_all_reduce: bool = Field(
        default=False,
        description="vLLM's flag, accepted for its scripts: mrv2 has no custom all-reduce "
        "(NCCL's always), so it changes nothing")


    @field_validator("pipeline_parallel_size", "data_parallel_size")
    @classmethod
    def _tensor_parallel_only(cls, value: int, info: ValidationInfo) -> int:
        if value > 1:
            raise ValueError(
                f"{info.field_name}={value} is not supported: mrv2 does tensor parallelism "
                "only (tensor_parallel_size / -tp); allowed: 1")
        return value


class LoRAConfig(_Section):
    """Serving LoRA adapters (vLLM's names): requests name an adapter (``LoRARequest``, or an
    adapter's name in ``mrv2 serve``'s ``model`` field) and run through it, beside requests
    of the base model and of other adapters in the same steps."""

    enable_lora: bool = Field(default=False, description="serve LoRA adapters")
    max_loras: int = Field(
        default=1, ge=1, le=64,
        description="adapters on the device at once (requests of others wait their turn)")
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = Field(
        default=16, description="the largest adapter rank served (device memory per adapter "
        "slot grows with it)")
    max_cpu_loras: int | None = Field(
        default=None, ge=1,
        description="adapters kept read in host memory (default: max_loras)")

    @model_validator(mode="after")
    def _cpu_holds_the_device_slots(self) -> LoRAConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")
        return self


class SpeculativeConfig(_Section):
    """Speculative decoding (vLLM's ``speculative_config`` names): which registered speculator
    and how many draft tokens; n-gram's lookup window."""

    method: str | None = Field(default=None, description="registered speculator name")
    model: str | None = Field(
        default=None, description="draft_model: the draft checkpoint directory (the target's "
        "vocabulary); eagle, eagle3: the EAGLE head's directory"
    )
    num_speculative_tokens: int = Field(default=0, ge=0, le=16)
    prompt_lookup_max: int | None = Field(
        default=None, ge=1, description="ngram: longest n-gram matched (default 4)"
    )
    prompt_lookup_min: int | None = Field(
        default=None, ge=1, description="ngram: shortest n-gram matched (default min(2, max))"
    )
    rejection_sample_method: Literal["strict", "probabilistic", "synthetic"] = Field(
        default="strict",
        description="how drafts are verified: 'strict' keeps a draft while it equals the "
        "target's own sample at its position (seeded output identical with speculation off); "
        "'probabilistic' accepts with min(1, p/q) and resamples from max(p - q, 0) (same "
        "distribution, more drafts accepted at temperature > 0); 'synthetic' (benchmarks "
        "only: the output is NOT the model's) keeps each draft with probability "
        "synthetic_acceptance_rate",
    )
    synthetic_acceptance_rate: float | None = Field(
        default=None, ge=0.0, le=1.0,
        description="synthetic: the probability of keeping each draft (benchmarks only)",
    )

    @model_validator(mode="after")
    def _tokens_need_method(self) -> SpeculativeConfig:
        if self.num_speculative_tokens and self.method is None:
            raise ValueError("num_speculative_tokens > 0 needs a speculative method")
        if self.method is not None and self.num_speculative_tokens < 1:
            raise ValueError(
                f"speculative method {self.method!r} needs num_speculative_tokens >= 1"
            )
        synthetic = self.rejection_sample_method == "synthetic"
        if synthetic != (self.synthetic_acceptance_rate is not None):
            raise ValueError(
                "synthetic_acceptance_rate goes with rejection_sample_method='synthetic' (and "
                "that method needs it), got rejection_sample_method="
                f"{self.rejection_sample_method!r}, synthetic_acceptance_rate="
                f"{self.synthetic_acceptance_rate!r}"
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is not None and high is not None and low > high:
            raise ValueError(
                f"prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})"
            )
        return self


class DeviceConfig(_Section):
    """Where the engine runs and whether CUDA graphs are used."""

    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="compute device")
    enforce_eager: bool = Field(default=False, description="never capture CUDA graphs")
    enable_sleep_mode: bool = Field(
        default=False,
        description="vLLM's flag, accepted so its settings carry over; it changes nothing: "
                    "every mrv2 engine can sleep (LLM.sleep / wake_up), none needs a special "
                    "allocator for it",
    )
    warmup: bool = Field(
        default=True,
        description="on CUDA, run a few short requests (greedy, sampled, top-k/top-p, "
                    "logprobs) through the whole step path at start-up, so the first real "
                    "request does not wait for kernels to compile",
    )
    max_mixed_graph_tokens: int | None = Field(
        default=None, ge=0,
        description="steps with prompt tokens of up to this many tokens replay CUDA graphs "
                    "(padded to a captured token count); 0: they run eager; default: the "
                    "token budget (at most 8192 with chunked prefill off), 512 with a "
                    "speculator",
    )
    attention_backend: str | None = Field(
        default=None, description="registered attention backend (default: per device)"
    )
    cuda_graph_sizes: list[int] | None = Field(
        default=None,
        description="decode CUDA graphs' batch sizes (vLLM's): one value N: 1, 2, 4, then every "
        "8 up to N (default 512; every 16 past 256); several: those sizes. At most "
        "max_num_seqs; larger decode batches run eager",
    )
    cudagraph_capture_sizes: list[int] | None = Field(
        default=None,
        description="vLLM's exact decode CUDA graph batch sizes (one value: that size only); "
        "instead of cuda_graph_sizes. Those up to max_num_seqs are captured",
    )
    max_seq_len_to_capture: int | None = Field(
        default=None, ge=1,
        description="vLLM's context bound of CUDA graphs, accepted for its scripts: mrv2's "
        "graphs serve every length up to max_model_len, so it changes nothing",
    )

    @field_validator("cuda_graph_sizes", "cudagraph_capture_sizes")
    @classmethod
    def _positive_sizes(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(size < 1 for size in value)):
            raise ValueError(f"expected one or more batch sizes >= 1, got {value}")
        return value


class StructuredOutputsConfig(_Section):
    """vLLM's ``structured_outputs_config`` (``--structured-outputs-config '{...}'``): the
    engine's defaults of structured outputs. mrv2's grammar engine is llguidance (vLLM's
    ``guidance`` backend) whatever ``backend`` says: ``auto`` and ``guidance`` are it;
    ``xgrammar`` and ``outlines`` (whose JSON objects take no property the schema does not
    list) are llguidance with ``disable_additional_properties``; ``lm-format-enforcer`` is
    llguidance as it is (a JSON schema, regex, choice or grammar means the same there; a
    grammar may be Lark or the GBNF / EBNF xgrammar reads). Unknown keys are refused."""

    backend: Literal["auto", "guidance", "xgrammar", "outlines", "lm-format-enforcer"] = Field(
        default="auto", description="vLLM's grammar backend: mrv2 always uses llguidance")
    disable_fallback: bool = Field(
        default=False, description="accepted: llguidance has no other backend to fall back to "
        "(a constraint it cannot compile is refused either way)")
    disable_any_whitespace: bool = Field(
        default=False, description="every request's JSON compact (no whitespace between "
        "tokens), as if it set disable_any_whitespace")
    disable_additional_properties: bool = Field(
        default=False, description="every request's object schemas that list their properties "
        "and say nothing of others take no others (additionalProperties: false)")
    reasoning_parser: str = Field(
        default="", description="the server's --reasoning-parser (one of them may be given, "
        "or both the same)")
    reasoning_parser_plugin: str = Field(
        default="", description="the server's --reasoning-parser-plugin: a Python file "
        "registering reasoning parsers (one of them may be given, or both the same)")
    enable_in_reasoning: bool = Field(
        default=False, description="hold the thinking block to the grammar too (by default "
        "the grammar holds only what follows it)")

    def backend_note(self) -> str | None:
        """What the engine logs at start-up where ``backend`` names another grammar engine
        than llguidance, else None. Logged by the engine once (its own process's), not on
        validation: a config is validated again on every field assigned and when passed on
        as a :class:`StructuredOutputsConfig`."""
        if self.backend in ("auto", "guidance"):
            return None
        return (f"structured_outputs_config.backend={self.backend!r}: mrv2 uses llguidance "
                "(vLLM's 'guidance')" + (", object schemas closed as that backend's"
                                          if self.closes_objects else ""))

    @property
    def closes_objects(self) -> bool:
        """Object schemas are closed by default: ``disable_additional_properties``, or a
        backend whose objects take only the properties they list (xgrammar, outlines)."""
        return self.disable_additional_properties or self.backend in ("xgrammar", "outlines")

    def server_reasoning_parser(self, flag: str | None) -> str | None:
        """The server's reasoning parser: ``flag`` (``--reasoning-parser``) or this config's
        ``reasoning_parser``; ValueError where both are given and differ."""
        mine = self.reasoning_parser or None
        if flag is not None and mine is not None and flag != mine:
            raise ValueError(f"--reasoning-parser {flag} and structured_outputs_config."
                             f"reasoning_parser={mine!r} disagree: give one of them")
        return flag or mine

    def server_reasoning_parser_plugin(self, flag: str | None) -> str | None:
        """The server's reasoning parser plugin file: ``flag``
        (``--reasoning-parser-plugin``) or this config's ``reasoning_parser_plugin``;
        ValueError where both are given and differ."""
        mine = self.reasoning_parser_plugin or None
        if flag is not None and mine is not None and flag != mine:
            raise ValueError(f"--reasoning-parser-plugin {flag} and structured_outputs_config."
                             f"reasoning_parser_plugin={mine!r} disagree: give one of them")
        return flag or mine

    @staticmethod
    def from_json(value: Any) -> dict[str, Any]:
        """vLLM's ``structured_outputs_config`` value (a mapping, its JSON text: the CLI's,
        or a :class:`StructuredOutputsConfig`) as a mapping; ValueError otherwise."""
        if isinstance(value, StructuredOutputsConfig):
            return value.model_dump(exclude_unset=True)
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"structured_outputs_config is not valid JSON: {error}"
                                 ) from None
        if not isinstance(value, dict):
            raise ValueError("structured_outputs_config must be a mapping such as "
                             f"{{\"backend\": \"guidance\"}}; got {value!r}")
        return value


class EngineConfig(_Section):
    """The whole engine configuration."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    multimodal: MultiModalConfig = Field(default_factory=MultiModalConfig)
    lora: LoRAConfig = Field(default_factory=LoRAConfig)
    structured_outputs: StructuredOutputsConfig = Field(
        default_factory=StructuredOutputsConfig)
    logits_processors: list[str] = Field(
        default_factory=list, description="registered logits processors to apply, by name"
    )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from vLLM-style flat keywords (``dtype="bfloat16", max_model_len=512``).

        Section dicts (``cache={"block_size": 16}``) are accepted too. Unknown names raise a
        ``ValueError`` listing the known ones.
        """
        kwargs = config_compat.translate(kwargs)  # vLLM's compilation_config, -O, names
        sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        top: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key == "speculative_config":  # vLLM's name: a dict, or JSON text (the CLI's)
                key, value = "speculative", _speculative_dict(value)
            elif key == "structured_outputs_config":  # vLLM's name: a dict, or JSON text
                key, value = "structured_outputs", StructuredOutputsConfig.from_json(value)
            if key in _SECTIONS and isinstance(value, dict):
                sections[key].update(value)
            elif key in _FLAT_TO_SECTION:
                sections[_FLAT_TO_SECTION[key]][key] = value
            elif key in cls.model_fields and key not in _SECTIONS:
                top[key] = value
            else:
                known = ", ".join(sorted({*_FLAT_TO_SECTION, *_SECTIONS, "logits_processors",
                                          "speculative_config", "structured_outputs_config",
                                          *config_compat.COMPAT_ARGUMENTS,
                                          *config_compat.RENAMED_ARGUMENTS}))
                raise ValueError(f"unknown engine argument {key!r}; known arguments: {known}")
        data: dict[str, Any] = {**top, **{k: v for k, v in sections.items() if v}}
        return cls.model_validate(data)

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> EngineConfig:
        """Load a YAML (``.yaml``/``.yml``) or JSON file of flat names or sections."""
        path = Path(path)
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            try:
                data = yaml.safe_load(text) or {}
            except yaml.YAMLError as error:
                raise ValueError(f"{path}: not valid YAML ({error})") from None
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: not valid JSON ({error})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of engine arguments, got {type(data)}")
        return cls.from_kwargs(**{**data, **overrides})


_SECTIONS: dict[str, type[_Section]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "speculative": SpeculativeConfig,
    "device": DeviceConfig,
    "multimodal": MultiModalConfig,
    "lora": LoRAConfig,
}
#: Fields set only inside their section's dict (``speculative_config={"model": DIR}``, as in
#: vLLM): a flat ``model`` is the target's checkpoint.
_NOT_FLAT = {("speculative", "model")}

_FLAT_TO_SECTION: dict[str, str] = {
    field: section for section, model in _SECTIONS.items() for field in model.model_fields
    if (section, field) not in _NOT_FLAT
}


#: ``max_model_len``'s value for vLLM's ``"auto"`` / ``-1`` (as vLLM stores it): the longest
#: length that fits in the KV cache, at most the model's.
AUTO_MAX_MODEL_LEN = -1


def _is_auto_length(value: Any) -> bool:
    """vLLM's ``max_model_len`` ``"auto"`` or ``-1``."""
    if isinstance(value, str):
        return value.strip().lower() in ("auto", "-1")
    return isinstance(value, int) and not isinstance(value, bool) and value == -1



def _speculative_dict(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"speculative_config is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(
            "speculative_config must be a mapping such as {\"method\": \"ngram\", "
            f"\"num_speculative_tokens\": 3}}; got {value!r}"
        )
    return value


def format_validation_error(error: ValidationError) -> str:
    """One line per problem: ``field: message (got value)``."""
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"])
        lines.append(f"{where}: {item['msg']} (got {item.get('input')!r})")
    return "invalid engine configuration:\n  " + "\n  ".join(lines)
