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
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from mrv2 import config_compat
from mrv2.config_sections import (
    DeviceConfig,
    LoRAConfig,
    ParallelConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
    _one_of,
    _Section,
)

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
