"""The engine configuration's smaller sections (:mod:`mrv2.config` holds the model, cache,
scheduler and multimodal ones and :class:`~mrv2.config.EngineConfig`, and re-exports these):
parallelism, LoRA, speculative decoding, the device, structured outputs. Each validates at
construction, a bad value naming the field and what is allowed."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

__all__ = ["DeviceConfig", "LoRAConfig", "ParallelConfig", "SpeculativeConfig",
           "StructuredOutputsConfig"]

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
