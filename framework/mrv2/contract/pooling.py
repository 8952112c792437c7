"""What a pooling request (an embedding, a classifier's labels, either per prompt token)
asks for, as vLLM's ``PoolingParams`` names it."""

from __future__ import annotations

from dataclasses import dataclass

#: What a pooling request can ask for: of the prompt's last token, or of every prompt token.
TASKS = ("embed", "classify", "token_embed", "token_classify")


@dataclass(frozen=True)
class PoolingParams:
    """A vector for the prompt instead of generated text, from the final hidden state of the
    prompt's last token (last-token pooling, what decoder embedding models such as
    Qwen3-Embedding and decoder classifiers are trained for).

    ``task="embed"``: that state, its first ``dimensions`` entries when set (Matryoshka
    models), scaled to unit length with ``normalize``. ``task="classify"``: a sequence
    classifier's label probabilities (its ``score`` head's logits, softmax; the sigmoid of a
    single label's). ``token_embed`` / ``token_classify``: the same for every prompt token
    (a token classifier's labels, a process reward model's per-step scores, multi-vector
    retrieval), one row per token; such a request reads no prefix cache (every token's state
    is computed)."""

    normalize: bool = True
    dimensions: int | None = None
    task: str = "embed"

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"PoolingParams.task must be one of {list(TASKS)}, got "
                             f"{self.task!r}")
        if self.task.endswith("classify") and self.dimensions is not None:
            raise ValueError("PoolingParams.dimensions applies to task='embed' or "
                             "'token_embed' only")
        if self.dimensions is not None and (not isinstance(self.dimensions, int)
                                            or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions must be an int >= 1 or None, got "
                             f"{self.dimensions!r}")

    @property
    def per_token(self) -> bool:
        """Whether every prompt token gets a row (``token_embed``, ``token_classify``)."""
        return self.task.startswith("token_")

    def check(self, hidden_size: int, num_labels: int | None = None) -> None:
        """ValueError naming ``dimensions`` when the model's embeddings are shorter, or
        ``task`` when it asks for labels of a model that has none (``num_labels`` None: not
        a sequence classifier)."""
        if self.task.endswith("classify") and num_labels is None:
            raise ValueError(f"task={self.task!r} needs a classification model (a checkpoint "
                             "of an XForSequenceClassification or XForTokenClassification "
                             "architecture); this one has no classification head")
        if self.dimensions is not None and self.dimensions > hidden_size:
            raise ValueError(f"dimensions={self.dimensions} is invalid: this model's "
                             f"embeddings have {hidden_size} (1 <= dimensions <= "
                             f"{hidden_size})")
