"""What the engine checks and builds around a request before it runs, without engine state:
prompt and runner checks, a sequence classifier's labels, the family's multimodal processor,
the tokenizer (used by :class:`~mrv2.engine.engine.LLMEngine` and the server's
``RemoteEngine`` alike)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mrv2.config import EngineConfig, ModelConfig
from mrv2.contract.input_processor import InputProcessor
from mrv2.contract.params import MAX_LOGPROBS, SamplingParams
from mrv2.contract.requests import MultiModalItem
from mrv2.engine.tokenizer import Tokenizer
from mrv2.registry import ModelEntry, import_object

__all__ = ["check_cache_salt", "check_priority", "check_prompt", "check_runner", "check_truncation",
           "classifier_labels",
           "make_input_processor", "normalizes_embeddings", "process_multimodal",
           "last_tokens", "refused_pooling_tasks", "truncate_prompt", "truncation_room"]


def classifier_labels(config: EngineConfig, hf_config: Any) -> tuple[int | None, dict[int, str]]:
    """A sequence or token classifier's ``(num_labels, id2label)`` (``(None, {})`` for other
    models).
    A classifier is served as a pooling model: ``runner="auto"`` becomes ``"pooling"``;
    ``"generate"`` is refused by name."""
    from mrv2.model_loader.classification import is_classifier, num_labels_of

    if not is_classifier(list(getattr(hf_config, "architectures", None) or [])):
        return None, {}
    if config.model.runner == "generate":
        raise ValueError(f"runner='generate': {hf_config.architectures[0]} is a "
                         "classifier, it generates no text (runner='pooling' or 'auto')")
    config.model.runner = "pooling"
    labels = num_labels_of(hf_config)
    names = getattr(hf_config, "id2label", None) or {}
    return labels, {int(k): str(v) for k, v in names.items()}


#: sentence-transformers' modules (their class names) the engine's embeddings match (its
#: last-token state, normalized or not); any other (a ``Dense`` projection...) changes it.
_ST_MODULES = ("Transformer", "Pooling", "Normalize")


def _st_modules(model_dir: str | Path) -> list[dict[str, Any]] | None:
    """The checkpoint's sentence-transformers modules (``modules.json``'s entries); None
    without a readable list there."""
    try:
        modules = json.loads((Path(model_dir) / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    return [m for m in modules if isinstance(m, dict)] if isinstance(modules, list) else None


def refused_pooling_tasks(model_dir: str | Path) -> dict[str, str]:
    """The pooling tasks the engine cannot answer as the checkpoint's sentence-transformers
    configuration says (``modules.json``, its ``Pooling`` module's ``config.json``), each with
    the reason: ``embed`` when that pooling is not the last token's (``pooling_mode_mean_tokens``,
    ``pooling_mode_cls_token``...) or a module other than the transformer, the pooling and the
    normalization follows; the engine pools the last token only, and would otherwise give
    other vectors than the model's own. Empty without ``modules.json``."""
    path = Path(model_dir)
    for module in _st_modules(path) or []:
        kind = str(module.get("type", ""))
        if kind.rsplit(".", 1)[-1] not in _ST_MODULES:
            return {"embed": f"this model's modules.json has a {kind} module, which the "
                             "engine does not run (it pools the last token's state, "
                             "normalized): its embeddings would not be the model's"}
        if kind.rsplit(".", 1)[-1] != "Pooling":
            continue
        try:
            pooling = json.loads((path / str(module.get("path", "")) / "config.json")
                                 .read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(pooling, dict):
            continue
        modes = sorted(k for k, v in pooling.items() if k.startswith("pooling_mode_")
                       and v is True)
        if modes and modes != ["pooling_mode_lasttoken"]:
            return {"embed": f"this model pools its embeddings by {', '.join(modes)} "
                             f"({module.get('path')}/config.json); the engine pools the "
                             "last token's state only (pooling_mode_lasttoken)"}
    return {}


def normalizes_embeddings(model_dir: str | Path) -> bool:
    """Whether the model's embeddings are scaled to unit length when a request does not say
    (``PoolingParams.normalize`` None), as vLLM reads the checkpoint's sentence-transformers
    configuration: yes, unless ``modules.json`` has a ``Pooling`` module and no ``Normalize``
    module after it."""
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in _st_modules(model_dir) or []]
    return "Pooling" not in kinds or "Normalize" in kinds


def default_pooling_task(hf_config: Any) -> str:
    """The pooling task of a request that names none: ``token_classify`` for a token
    classifier, ``classify`` for a sequence classifier, else ``embed``."""
    from mrv2.model_loader.classification import is_classifier, is_token_classifier

    architectures = list(getattr(hf_config, "architectures", None) or [])
    if is_token_classifier(architectures):
        return "token_classify"
    return "classify" if is_classifier(architectures) else "embed"


def check_runner(config: EngineConfig, pooling: bool) -> None:
    """An engine of ``runner="pooling"`` takes embedding requests only: ValueError naming
    the runner for a generation request."""
    if config.model.runner == "pooling" and not pooling:
        raise ValueError("this engine runs a pooling model (runner='pooling'): it takes "
                         "embedding and classification requests only (LLM.embed, "
                         "LLM.classify, LLM.score, /v1/embeddings, /classify, /score, "
                         "/rerank)")


def check_prompt(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int,
                 vocab_size: int, pooling: bool = False,
                 max_logprobs: int = MAX_LOGPROBS) -> None:
    """The checks of a request that need no engine state: a prompt of 1 to
    ``max_model_len - 1`` ids in the vocabulary (a pooling request's: to ``max_model_len``,
    as vLLM's; its one sampled token is dropped), the params' token ids, and their logprobs
    counts at most ``max_logprobs`` (``--max-logprobs``). ``ValueError``
    naming the field (``LLMEngine.validate`` and the server's ``RemoteEngine`` run it)."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("the prompt is empty: give at least one token")
    most = max_model_len if pooling else max_model_len - 1
    if n > most:
        raise ValueError(
            f"the prompt has {n} tokens, but max_model_len is {max_model_len}: "
            f"prompts may have at most {most} tokens"
        )
    bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}")
    params.check_vocab(vocab_size)
    params.check_logprobs(max_logprobs, vocab_size)


def last_tokens(ids: list[int], keep: int | None, room: int, multimodal: bool = False
                ) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``keep`` of ``ids`` (None: all of them;
    -1: ``room``). Raises ``ValueError`` where it would cut a ``multimodal`` prompt."""
    keep = room if keep == -1 else keep
    if keep is None or len(ids) <= keep:
        return ids
    if multimodal:
        raise ValueError("truncate_prompt_tokens would cut a multimodal prompt (its "
                         "placeholders must stay whole)")
    return ids[-keep:]


def check_truncation(keep: int | None, longest: int, max_tokens: int = 0,
                     name: str = "max_tokens") -> None:
    """vLLM's bound on ``truncate_prompt_tokens``: at most ``longest`` (the model's
    ``max_model_len``) less ``max_tokens`` (a generation request's own answer length, the
    server's field ``name``; 0: a pooling or offline prompt's, whose bound is the context),
    else a ValueError naming it (vLLM's 400), however short the prompt. -1 always passes."""
    if keep is None:
        return
    if max_tokens and keep > longest - max_tokens:
        raise ValueError(f"truncate_prompt_tokens={keep} cannot be greater than max_model_len "
                         f"- {name} = {longest} - {max_tokens} = {longest - max_tokens}. "
                         "Please request a smaller truncation size.")
    if keep > longest:
        raise ValueError(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                         f"({longest}). Please request a smaller truncation size.")


def truncation_room(max_model_len: int, max_tokens: int | None) -> int:
    """What ``truncate_prompt_tokens: -1`` keeps of a generation prompt (vLLM's): the context
    less ``max_tokens`` (at least one token of answer), at most ``max_model_len - 1``."""
    return max(max_model_len - max(max_tokens or 0, 1), 1)


def truncate_prompt(prompt_token_ids: list[int], params: SamplingParams, max_model_len: int,
                    multimodal: bool = False) -> list[int]:
    """The prompt's last ``params.truncate_prompt_tokens`` ids (:func:`last_tokens`, -1's
    :func:`truncation_room`). Raises ``ValueError`` for a cut above ``max_model_len`` (vLLM's
    offline bound, :func:`check_truncation`) or where it would cut a ``multimodal`` prompt."""
    check_truncation(params.truncate_prompt_tokens, max_model_len)
    return last_tokens(prompt_token_ids, params.truncate_prompt_tokens,
                       truncation_room(max_model_len, params.max_tokens), multimodal)


def check_cache_salt(cache_salt: Any) -> str | None:
    """A request's ``cache_salt`` (vLLM's): None, or a non-empty string; ValueError naming
    the field otherwise."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"cache_salt must be a non-empty string if given, got {cache_salt!r}")
    return cache_salt


#: A request's ``priority`` bounds (vLLM's: a signed 64-bit integer).
PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1


def check_priority(priority: Any, policy: str) -> int:
    """A request's ``priority`` (vLLM's; lower runs first): an int, and 0 unless the
    scheduling ``policy`` is ``"priority"`` (vLLM's refusal); ValueError naming the field
    otherwise."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise ValueError(f"priority must be a 64-bit signed integer, got {priority}")
    if priority != 0 and policy != "priority":
        raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled: "
                         f"the scheduling policy is {policy!r} (start the server with "
                         "--scheduling-policy priority, or the engine with "
                         "policy=\"priority\")")
    return priority


def make_input_processor(path: str | None, model_dir: str, hf_config: Any,
                         tokenizer: Tokenizer | None, config: EngineConfig,
                         entry: ModelEntry | None = None) -> InputProcessor | None:
    """The family's multimodal prompt processor registered as ``path`` (an import path; None
    or empty: a text-only model), built for the checkpoint at ``model_dir``. ``entry``: the
    registration it comes from, named in the error where the path does not import."""
    if not path:
        apply_mm_processor_kwargs(None, config.multimodal.mm_processor_kwargs)
        return None
    cls = entry.load("input_processor") if entry is not None else import_object(path)
    processor: InputProcessor = cls(model_dir, hf_config, tokenizer, config)
    apply_mm_processor_kwargs(processor, config.multimodal.mm_processor_kwargs, model_dir)
    return processor


def apply_mm_processor_kwargs(processor: InputProcessor | None, kwargs: dict[str, Any],
                              model_dir: str = "") -> None:
    """``--mm-processor-kwargs`` (vLLM's): the HF image processor of ``processor`` loaded
    again from ``model_dir`` with them (``{"max_pixels": N}``), as ``from_pretrained`` takes
    them. ValueError naming the field where the model takes no images or the processor has
    no such setting (transformers would ignore it)."""
    if not kwargs:
        return
    hf = getattr(processor, "image_processor", None)
    if hf is None:
        why = ("the model takes text only" if processor is None
               else getattr(processor, "images_refused", "") or "the model has no image "
               "processor")
        raise ValueError(f"mm_processor_kwargs={kwargs}: {why}")
    assert processor is not None
    cls = type(hf)
    typed = getattr(cls, "valid_kwargs", None)  # (transformers 5: the settings' TypedDict)
    known = set(getattr(typed, "__required_keys__", ())) | set(
        getattr(typed, "__optional_keys__", ()))
    unknown = sorted(k for k in kwargs if k not in known and not hasattr(hf, k))
    if unknown or not hasattr(cls, "from_pretrained"):
        what = (f"has no setting {', '.join(map(repr, unknown))}" if unknown
                else "takes no settings")
        raise ValueError(f"mm_processor_kwargs: the image processor {cls.__name__} {what}")
    processor.image_processor = cls.from_pretrained(model_dir, local_files_only=True,
                                                    **kwargs)


def process_multimodal(processor: InputProcessor | None, architecture: str,
                       prompt_token_ids: list[int], mm_data: Any
                       ) -> tuple[list[int], list[MultiModalItem]]:
    """``mm_data`` through a family's input ``processor`` (None: a text-only model):
    ``ValueError`` naming the field on bad data or a text-only model."""
    if not isinstance(mm_data, dict):
        raise ValueError(f"multi_modal_data must be a dict such as {{'image': ...}}, got "
                         f"{type(mm_data).__name__}")
    if processor is None:
        raise ValueError(f"multi_modal_data: {architecture} takes text only")
    return processor.process(list(prompt_token_ids), mm_data)


def tokenizer_kwargs(model: ModelConfig) -> dict[str, Any]:
    """``AutoTokenizer.from_pretrained``'s keywords for ``tokenizer_mode`` ('slow': the Python
    tokenizer) and ``trust_remote_code``."""
    kwargs: dict[str, Any] = {}
    if model.tokenizer_mode == "slow":
        kwargs["use_fast"] = False
    if model.trust_remote_code:
        kwargs["trust_remote_code"] = True
    return kwargs


def _load_tokenizer(path: str, chat_template: str | None = None, required: bool = False,
                    kwargs: dict[str, Any] | None = None) -> Tokenizer | None:
    """The tokenizer at ``path`` (None where there is none), its chat template replaced by
    ``chat_template`` (``--chat-template``) when given; ``kwargs``: :func:`tokenizer_kwargs`.
    ``required`` (a tokenizer named on its own, ``--tokenizer``): a ValueError naming the
    field where none loads."""
    try:
        tokenizer = Tokenizer(path, **(kwargs or {}))
    except (OSError, ValueError) as error:
        if required:
            raise ValueError(f"tokenizer={path!r}: {error}; give a directory holding a "
                             "tokenizer (tokenizer.json, tokenizer_config.json...)") from None
        return None
    if chat_template is not None:
        tokenizer.set_chat_template(chat_template)
    return tokenizer
