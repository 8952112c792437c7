"""Build a model from an HF checkpoint directory through the plugin registry."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from mrv2.config import EngineConfig
from mrv2.layers.fp8 import Fp8Config
from mrv2.layers.int_quant_config import IntQuantConfig
from mrv2.layers.weights import clear_fresh
from mrv2.registry import ModelEntry, Registries

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CausalLM(Protocol):
    """The contract every registered model class meets (see CONTRIBUTING.md, "Add a model")."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids and positions -> ``[T, hidden]`` hidden states (plus whatever
        else the model's ``ModelState.prepare_inputs`` passes: ``inputs_embeds [T, hidden]``
        when multimodal embeddings are spliced in, then ``embed_input_ids`` is needed too)."""
        ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]``."""
        ...

    def load_weights(self, weights: Any) -> set[str]:
        """Load HF-named ``(name, tensor)`` pairs; returns the parameter names loaded."""
        ...


def load_hf_config(model_dir: str | Path, overrides: dict[str, Any] | None = None) -> Any:
    """The checkpoint's ``config.json`` as a transformers config (no hub access), with
    ``overrides`` set on it (a dict value for a sub-config, such as ``text_config``, sets its
    fields).

    Falls back to a plain ``PretrainedConfig`` for model types transformers does not know, so
    private models need no transformers class.
    """
    config = _read_hf_config(model_dir)
    _override(config, overrides or {})
    return config


#: The RoPE dict's names (transformers 5's, and ``rope_scaling``, its alias), and the fields
#: of it that were attributes of their own before transformers 5 (an override of the scaling
#: alone keeps them).
_ROPE_FIELDS = ("rope_parameters", "rope_scaling")
_ROPE_KEPT = ("rope_theta", "partial_rotary_factor")


def _override(config: Any, overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and hasattr(current, "to_dict"):
            _override(current, value)
        elif key in _ROPE_FIELDS and isinstance(value, dict) and isinstance(current, dict):
            # ('{"rope_scaling": {"rope_type": "yarn", ...}}', as vLLM's users write it: the
            # checkpoint's rope_theta, which transformers 5 holds in that dict, stays)
            kept = {k: current[k] for k in _ROPE_KEPT if k in current and k not in value}
            _set(config, key, {**value, **kept})
        else:
            _set(config, key, value)


def _set(config: Any, key: str, value: Any) -> None:
    """``config.key = value``; what transformers' config refuses (a field's type: its strict
    dataclass error, no ValueError) as a ValueError naming the override."""
    try:
        setattr(config, key, value)
    except Exception as error:  # noqa: BLE001 (huggingface_hub's StrictDataclassError...)
        raise ValueError(f"hf_overrides: {key}={value!r} is refused by "
                         f"{type(config).__name__}: {error}") from None


def _read_hf_config(model_dir: str | Path) -> Any:
    path = Path(model_dir)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"no config.json in {str(path)!r}: the model must be an HF checkpoint directory "
            "(config.json, *.safetensors, tokenizer.json)"
        )
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError):
        return transformers.PretrainedConfig(**json.loads(config_file.read_text()))


def text_config_of(hf_config: Any) -> Any:
    """The language model's config: a composite (vision-language) config's ``text_config``
    (``get_text_config()``), else the config itself."""
    get = getattr(hf_config, "get_text_config", None)
    text = get() if callable(get) else None
    return text if text is not None else hf_config


def vl_text_config(config: Any, architecture: str | None = None) -> Any:
    """The text decoder's config of a composite vision-language ``config`` (its
    ``text_config``) with ``tie_word_embeddings`` set from the top level, where HF ties the LM
    head by it (set on the text config in place, so every reader agrees). ``architecture``:
    a ValueError naming it where the config has no text config."""
    text = text_config_of(config)
    if architecture is not None and text is config:
        raise ValueError(f"config.json of {architecture} has no text_config")
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is not None:
        text.tie_word_embeddings = bool(tied)
    return text


#: A vision-language checkpoint's text-decoder prefixes and the names a decoder loads them as:
#: transformers' in-memory names, then the published layout (and 5.17's ``save_pretrained``).
VL_TEXT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)


def vl_text_name(name: str) -> str:
    """A vision-language checkpoint's text tensor name as its decoder's
    (:data:`VL_TEXT_PREFIXES`); other names unchanged."""
    for prefix, replacement in VL_TEXT_PREFIXES:
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    return name


def resolve_dtype(requested: str, hf_config: Any, device: torch.device) -> torch.dtype:
    """``auto``: float32 on the CPU; on CUDA the checkpoint's dtype, bfloat16 for float32 ones."""
    if requested != "auto":
        return _DTYPES[requested]
    if device.type == "cpu":
        return torch.float32
    saved = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = _DTYPES.get(saved)
    if saved in (torch.bfloat16, torch.float16):
        return saved
    return torch.bfloat16


def check_shardable(model_dir: str, hf_config: Any, registries: Registries, size: int,
                    expert_parallel: bool = False) -> None:
    """Build the registered model class on the meta device as rank 0 of ``size`` would (no
    memory, no weights), so that its layers' divisibility rules (heads, KV heads, MLP width,
    experts over ``tensor_parallel_size``) raise their ``ValueError`` before any worker process
    starts. Any other failure is left to the real build, which reports it. A split refused
    names the ``tensor_parallel_size`` values the model does split into (of 1..64)."""
    from mrv2.distributed.parallel_state import as_rank, expert_parallel_build

    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures:
        raise ValueError(f"{model_dir}/config.json names no 'architectures'")
    model_cls = registries.resolve_model(architectures).load()

    def build(n: int) -> None:
        try:
            with as_rank(0, n), torch.device("meta"), expert_parallel_build(expert_parallel):
                model_cls(hf_config)
        except ValueError:
            raise
        except Exception:  # noqa: BLE001, S110 (a constructor that needs real data: later)
            pass

    def splits(n: int) -> bool:
        try:
            build(n)
        except ValueError:
            return False
        return True

    try:
        build(size)
    except ValueError as error:
        if size == 1 or not splits(1):  # (not the split's fault)
            raise
        heads = getattr(text_config_of(hf_config), "num_attention_heads", None)
        candidates = [n for n in range(2, 65) if n != size
                      and (not isinstance(heads, int) or heads % n == 0)]
        allowed = [1] + [n for n in candidates if splits(n)]
        raise ValueError(f"{error} (this model splits into tensor_parallel_size "
                         f"{', '.join(map(str, allowed))})") from None


def build_model(
    config: EngineConfig,
    model_dir: str,
    hf_config: Any,
    registries: Registries,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[nn.Module, ModelEntry]:
    """Instantiate the registered model class on ``device`` and load (or draw) its weights."""
    from mrv2.distributed.parallel_state import expert_parallel_build
    from mrv2.layers.embedding import PoolingLogits
    from mrv2.layers.fp8 import fp8_config_of, log_fp8_memory
    from mrv2.layers.int_model import fill_int_defaults, log_int_memory
    from mrv2.layers.int_quant_config import int_quant_config_of
    from mrv2.model_loader.classification import add_score_head, is_classifier, score_from_tokens
    from mrv2.model_loader.loader import check_kv_cache_scales

    architectures = list(getattr(hf_config, "architectures", None) or [])
    if not architectures:
        raise ValueError(f"{model_dir}/config.json names no 'architectures'")
    classifier = is_classifier(architectures)
    entry = registries.resolve_model(architectures)  # (a classifier: its causal LM's)
    model_cls = entry.load()
    dummy = config.model.load_format == "dummy"
    if not dummy:  # (before anything is built: a setting the checkpoint's scales refuse)
        check_kv_cache_scales(model_dir, config.cache.kv_cache_dtype)
    fp8 = fp8_config_of(hf_config, config.model.quantization)
    int_quant = int_quant_config_of(hf_config, config.model.quantization)
    if int_quant is not None and not int_quant.from_checkpoint and not dummy:
        raise ValueError(f"quantization={config.model.quantization!r} needs a checkpoint "
                         "quantized so (config.json quantization_config), or "
                         "load_format='dummy' for random weights; mrv2 does not quantize to "
                         "integers at load (quantization='fp8' does quantize)")
    # A quantized model is built on the meta device and allocated once its layers are: its
    # model-dtype weights may not fit (GLM-4.5-Air: 212 GB in bf16, 111 GB in fp8).
    on_meta = (fp8 is not None and (dummy or fp8.from_checkpoint)) or int_quant is not None
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with (torch.device("meta" if on_meta else device),
              expert_parallel_build(config.parallel.enable_expert_parallel)):
            model = model_cls(hf_config)
            if classifier:  # the causal LM, plus its score head
                add_score_head(model, int(text_config_of(hf_config).hidden_size), hf_config)
            if ((classifier or config.model.runner == "pooling")
                    and config.speculative.method is None and hasattr(model, "lm_head")):
                # pooling only: no LM head (before any weight is loaded or drawn into it)
                model.lm_head = PoolingLogits(int(text_config_of(hf_config).vocab_size))
    finally:
        torch.set_default_dtype(previous)
    if fp8 is not None:
        apply_checkpoint_fp8(model, fp8, model_dir, dummy, dtype)
    if int_quant is not None:
        apply_checkpoint_int_quant(model, int_quant, model_dir, dummy, dtype)
    if on_meta:
        # every parameter is then loaded or drawn; leaving the meta device makes new
        # Parameter objects, so their loaders (a sharded layer's slicing) and whether a
        # checkpoint may leave them out are put back
        kept = ("weight_loader", "optional")
        attrs = {n: {a: getattr(p, a) for a in kept if hasattr(p, a)}
                 for n, p in model.named_parameters()}
        to_empty_keeping_ties(model, device)
        for name, param in model.named_parameters():
            for attr, value in attrs.get(name, {}).items():
                if not hasattr(param, attr):
                    setattr(param, attr, value)
        if int_quant is not None:
            fill_int_defaults(model)  # (what a checkpoint may leave out)
    load_or_draw_weights(model, config, model_dir)
    if classifier and not dummy:
        score_from_tokens(model, hf_config, model_dir)  # (a head made of LM-head rows)
    model.to(device=device, dtype=dtype)
    model.eval()
    process_weights_after_loading(model)
    if fp8 is not None:
        log_fp8_memory(model, dtype)
    if int_quant is not None:
        log_int_memory(model, dtype)
    return model, entry


def to_empty_keeping_ties(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device=device)`` with every parameter that several modules shared
    still shared: ``to_empty`` makes a new tensor per module, which unties a tied LM head from
    its embedding (a tied fp8 checkpoint then failed to load, its ``lm_head.weight`` missing;
    with random weights the head was drawn apart from the embedding)."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((module, attr))
    model.to_empty(device=device)
    for shared in slots.values():
        owner, attr = shared[0]
        for module, other in shared[1:]:
            module._parameters[other] = owner._parameters[attr]


def apply_checkpoint_fp8(model: nn.Module, fp8: Fp8Config, model_dir: str, dummy: bool,
                         dtype: torch.dtype) -> None:
    """Make ``model``'s layers FP8 before its weights load (:func:`mrv2.layers.fp8.apply_fp8`):
    those the checkpoint in ``model_dir`` holds fp8 scales for, or all with random weights or
    ``quantization="fp8"``. For a main model and for modules built beside it (MTP layers)."""
    from mrv2.layers.fp8 import apply_fp8
    from mrv2.model_loader.loader import checkpoint_names

    names: list[str] = []
    if fp8.from_checkpoint and not dummy:
        names = fp8_layer_names(model, checkpoint_names(model_dir))
    apply_fp8(model, fp8, dummy, names, dtype)


def apply_checkpoint_int_quant(model: nn.Module, quant: IntQuantConfig, model_dir: str,
                               dummy: bool, dtype: torch.dtype) -> None:
    """Make ``model``'s linear layers integer-weight before its weights load
    (:func:`mrv2.layers.int_model.apply_int_quant`): those the checkpoint in ``model_dir``
    holds a ``qweight`` for, or all with random weights."""
    from mrv2.layers.int_model import apply_int_quant, int_layer_names
    from mrv2.model_loader.loader import checkpoint_names

    names = (None if dummy or quant.experts_only
             else int_layer_names(model, checkpoint_names(model_dir)))
    apply_int_quant(model, quant, names, dtype)


def load_or_draw_weights(model: nn.Module, config: EngineConfig, model_dir: str) -> None:
    """Load ``model``'s weights from the checkpoint in ``model_dir``, or draw them (fp8 layers
    included) with ``load_format="dummy"``."""
    from mrv2.layers.fp8 import draw_fp8_weights
    from mrv2.layers.int_model import draw_int_weights
    from mrv2.model_loader.classification import score_head
    from mrv2.model_loader.loader import init_dummy_weights, iter_safetensors, load_model_weights

    if config.model.load_format == "dummy":
        init_dummy_weights(model, seed=config.model.seed)
        draw_fp8_weights(model, seed=config.model.seed, std=0.02)
        draw_int_weights(model, seed=config.model.seed, std=0.02)
    elif config.model.runner == "pooling" or score_head(model) is not None:
        # an embedding model or a classifier needs no LM head (nor, made of its rows, a head)
        scorer = score_head(model)
        extra = {"score.weight"} if scorer is not None and scorer.from_tokens else set()
        loaded = load_model_weights(model, iter_safetensors(model_dir),
                                    optional=frozenset({"lm_head.weight", *extra}))
        head = getattr(getattr(model, "lm_head", None), "weight", None)
        embed = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight",
                        None)
        if "lm_head.weight" not in loaded and head is not None and embed is not None and (
                head is not embed and head.shape == embed.shape):
            with torch.no_grad():  # (its token is drawn and dropped: any finite head does)
                head.copy_(embed)
    else:
        load_model_weights(model, iter_safetensors(model_dir))


def fp8_layer_names(model: nn.Module, names: list[str]) -> list[str]:
    """The model's parameter names the checkpoint's ``*.weight_scale_inv`` tensors load into
    (through the model's ``rename`` and stacking, when it has them)."""
    from mrv2.layers.weights import checkpoint_target

    rename = getattr(model, "rename", lambda name: name)
    stacked = getattr(model, "stacked_params", ())
    out = []
    for name in names:
        if name.endswith("_scale_inv"):
            target = checkpoint_target(name, stacked, rename)
            if target is not None:
                out.append(target[0])
    return out


class Reload:
    """What :func:`reloading` yields: :meth:`names` of a load's parameters as laid out."""

    def __init__(self, model: nn.Module, reopened: list[nn.Module]) -> None:
        ids = {id(m) for m in reopened}
        self.model = model
        self.prefixes = [f"{n}." for n, m in model.named_modules() if id(m) in ids]

    def names(self, loaded: set[str]) -> set[str]:
        """``loaded`` (the names the load filled: a reopened integer layer's under the
        checkpoint's names) as the model names its parameters now."""
        hit = {p for p in self.prefixes if any(n.startswith(p) for n in loaded)}
        if not hit:
            return loaded
        out = {n for n in loaded if not any(n.startswith(p) for p in hit)}
        for prefix in hit:
            module = self.model.get_submodule(prefix[:-1])
            out |= {prefix + n for n, _ in module.named_parameters(recurse=False)}
        return out


@contextlib.contextmanager
def reloading(model: nn.Module) -> Iterator[Reload]:
    """Around a load of new weights into a model already loaded and processed (an update
    of the weights, a reload; ``Runner.load_weights``, and its check on meta tensors): its
    integer layers, expert stacks and quantized LM head take the checkpoint's tensors under
    its names again (:func:`~mrv2.layers.int_reload.reopen_int_layers`), their hooks lay out
    what was loaded as the first load did, and on leaving those whose hook did not run go
    back as they were; the fresh marks (:func:`~mrv2.layers.weights.is_fresh`) are
    forgotten."""
    from mrv2.layers.int_reload import abandon_reloads, reopen_int_layers

    reopened = reopen_int_layers(model)
    try:
        yield Reload(model, reopened)
    finally:
        abandon_reloads(reopened)
        clear_fresh(model)


def process_weights_after_loading(model: nn.Module, changed: set[str] | None = None) -> None:
    """Let every module that has one run its ``process_weights_after_loading()`` (a layout for
    the device, say) once its weights are loaded and on the device; with ``changed`` (the
    parameter names loaded again: ``LLMEngine.update_weights``) only the modules holding one
    of them, parents before children, as at load."""
    chosen = []  # (first: a parent's hook may rename its children's parameters)
    for name, module in model.named_modules():
        if not callable(getattr(module, "process_weights_after_loading", None)):
            continue
        prefix = f"{name}." if name else ""
        if changed is None or any(f"{prefix}{p}" in changed
                                  for p, _ in module.named_parameters()):
            chosen.append(module)
    try:
        for module in chosen:  # (the hook of its class now: a parent's may have changed it)
            module.process_weights_after_loading()
    finally:
        clear_fresh(model)
