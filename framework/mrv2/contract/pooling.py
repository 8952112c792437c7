"""What a pooling request (an embedding, a classifier's labels, either per prompt token)
asks for, as vLLM's ``PoolingParams`` names it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any


def matryoshka_of(hf_config: Any) -> bool | tuple[int, ...]:
    """Whether the model's embeddings may be cut short (``dimensions``), as vLLM reads it
    from config.json (or ``hf_overrides``): ``matryoshka_dimensions``, the sizes it allows,
    or ``is_matryoshka: true``, any size; False: neither (a model not trained for it)."""
    sizes = getattr(hf_config, "matryoshka_dimensions", None)
    if sizes:
        return tuple(int(n) for n in sizes)
    return bool(getattr(hf_config, "is_matryoshka", False))


#: What a pooling request can ask for: of the prompt's last token, or of every prompt token.
TASKS = ("embed", "classify", "token_embed", "token_classify")


@dataclass(frozen=True)
class PoolingParams:
    """A vector for the prompt instead of generated text, from the final hidden state of the
    prompt's last token (last-token pooling, what decoder embedding models such as
    Qwen3-Embedding and decoder classifiers are trained for).

    ``task``: None (the default, vLLM's) takes the task the caller names (``LLM.encode``'s
    ``pooling_task``, else the model's own), and means ``"embed"`` where none is named.
    ``task="embed"``: that state, its first ``dimensions`` entries when set (Matryoshka
    models), scaled to unit length with ``normalize`` (None: as the model says, which is
    yes unless its sentence-transformers configuration has no ``Normalize`` module, as vLLM
    reads it). ``task="classify"``: a sequence
    classifier's label probabilities (its ``score`` head's logits, softmax; the sigmoid of a
    single label's). ``token_embed`` / ``token_classify``: the same for every prompt token
    (a token classifier's labels, a process reward model's per-step scores, multi-vector
    retrieval), one row per token; such a request reads no prefix cache (every token's state
    is computed).

    ``use_activation`` (vLLM's): ``False`` asks a classifier for its raw logits instead of
    probabilities (``classify``, ``token_classify``); for an embedding it is another name
    of ``normalize`` (taken where ``normalize`` is None; the two may not disagree)."""

    normalize: bool | None = None
    dimensions: int | None = None
    task: str | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"PoolingParams.task must be one of {list(TASKS)}, got "
                             f"{self.task!r}")
        if self.kind.endswith("classify") and self.dimensions is not None:
            raise ValueError("PoolingParams.dimensions applies to task='embed' or "
                             "'token_embed' only")
        if self.use_activation is not None and not self.kind.endswith("classify"):
            if self.normalize is None:  # (an embedding's activation: its normalization)
                object.__setattr__(self, "normalize", self.use_activation)
            elif self.normalize != self.use_activation:
                raise ValueError(f"PoolingParams.use_activation={self.use_activation} "
                                 f"disagrees with normalize={self.normalize}; give one")
        if self.dimensions is not None and (not isinstance(self.dimensions, int)
                                            or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions must be an int >= 1 or None, got "
                             f"{self.dimensions!r}")

    @property
    def kind(self) -> str:
        """The task asked for: ``task``, ``"embed"`` when none is named."""
        return self.task or "embed"

    @property
    def per_token(self) -> bool:
        """Whether every prompt token gets a row (``token_embed``, ``token_classify``)."""
        return self.kind.startswith("token_")

    def check(self, hidden_size: int, num_labels: int | None = None,
              matryoshka: bool | Sequence[int] = False,
              refused: Mapping[str, str] | None = None) -> None:
        """ValueError naming ``dimensions`` when the model's embeddings are shorter, or the
        model may not cut them short (``matryoshka``: :func:`matryoshka_of`, vLLM's refusal),
        or ``task`` when it asks for labels of a model that has none (``num_labels`` None: not
        a sequence classifier); ``refused``: the tasks this model cannot answer, each with
        its reason (the ValueError's message)."""
        if refused and self.kind in refused:
            raise ValueError(f"task={self.kind!r} is refused: {refused[self.kind]}")
        if self.kind.endswith("classify") and num_labels is None:
            raise ValueError(f"task={self.kind!r} needs a classification model (a checkpoint "
                             "of an XForSequenceClassification or XForTokenClassification "
                             "architecture); this one has no classification head")
        if self.dimensions is not None and not matryoshka:
            raise ValueError(f"dimensions={self.dimensions}: this model does not support "
                             "Matryoshka embeddings (config.json has no is_matryoshka or "
                             "matryoshka_dimensions), its embeddings cannot be cut short")
        if (self.dimensions is not None and not isinstance(matryoshka, bool)
                and self.dimensions not in matryoshka):
            raise ValueError(f"dimensions={self.dimensions} is invalid: this model's "
                             f"matryoshka_dimensions are {list(matryoshka)}")
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions={self.dimensions} is invalid: this model's "
                             f"embeddings have {hidden_size} (1 <= dimensions <= "
                             f"{hidden_size})")


def with_task(pooling_params: PoolingParams | None, task: str | None) -> PoolingParams:
    """``pooling_params`` (None: the defaults) for ``task`` (None: its own), as vLLM's
    ``LLM.encode`` sets them: ValueError naming both where the params name another task."""
    params = pooling_params or PoolingParams()
    if task is None or params.task == task:
        return params
    if params.task is not None:
        raise ValueError(f"pooling_task={task!r} differs from pooling_params.task="
                         f"{params.task!r}: one cannot overwrite the other (leave "
                         "PoolingParams.task unset)")
    return replace(params, task=task)
