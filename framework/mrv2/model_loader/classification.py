"""Sequence-classification models (``XForSequenceClassification``), as vLLM adapts them
(``as_seq_cls_model``): the registered ``XForCausalLM`` of the same family, plus a linear
``score`` head ``[num_labels, hidden]`` (no bias, HF's layout and name) over the final hidden
state of a prompt's last token. Every family that registers a causal LM gets its classifier
(Qwen3's reward and reranker models, Llama's...) with no plugin code.

The engine serves such a model as a pooling model (``runner="pooling"``): classification
requests (``PoolingParams(task="classify")``: ``LLM.classify``, ``LLM.score``, ``/classify``,
``/score``, ``/rerank``) and embedding requests; the checkpoint needs no LM head.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SUFFIX = "ForSequenceClassification"


def is_classifier(architectures: Sequence[str]) -> bool:
    """Whether the checkpoint's first architecture is a sequence classifier."""
    return bool(architectures) and architectures[0].endswith(SUFFIX)


def num_labels_of(hf_config: Any) -> int:
    """The classifier's label count: ``num_labels`` (transformers derives it from
    ``id2label``); ValueError naming it when it is not a positive int."""
    labels = getattr(hf_config, "num_labels", None)
    if not isinstance(labels, int) or isinstance(labels, bool) or labels < 1:
        raise ValueError(f"config.json: num_labels (or id2label) must give >= 1 label for a "
                         f"sequence classifier, got {labels!r}")
    return labels


class ScoreHead(nn.Module):
    """The classifier's head: ``[N, hidden] -> [N, num_labels]`` logits (``score.weight``)."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.to(self.weight.dtype), self.weight)


def add_score_head(model: nn.Module, hidden_size: int, num_labels: int) -> None:
    """Give ``model`` its ``score`` head (built on the current default device and dtype)."""
    model.score = ScoreHead(hidden_size, num_labels)


def score_head(model: nn.Module) -> ScoreHead | None:
    """The model's classification head, or None (not a classifier)."""
    head = getattr(model, "score", None)
    return head if isinstance(head, ScoreHead) else None


def label_probs(logits: torch.Tensor) -> torch.Tensor:
    """Logits ``[..., num_labels]`` -> probabilities in fp32: softmax over the labels, or the
    sigmoid of a single label's logit (a reranker's or reward model's score), as vLLM's
    classify activation."""
    logits = logits.float()
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
