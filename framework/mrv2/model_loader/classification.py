"""Sequence-classification models (``XForSequenceClassification``), as vLLM adapts them
(``as_seq_cls_model``): the registered ``XForCausalLM`` of the same family, plus a linear
``score`` head ``[num_labels, hidden]`` (no bias, HF's layout and name) over the final hidden
state of a prompt's last token. Every family that registers a causal LM gets its classifier
(Qwen3's reward and reranker models, Llama's...) with no plugin code.

A causal LM trained to answer with tokens (Qwen3-Reranker's "yes"/"no") becomes a classifier
through ``hf_overrides`` as in vLLM: ``architectures`` ``XForSequenceClassification`` and
``classifier_from_token`` (with ``is_original_qwen3_reranker`` or ``method:
"from_2_way_softmax"``, two tokens make one score, ``P(yes)``); the head is then made from
the LM head's rows of those tokens (:func:`score_from_tokens`).

Token classifiers (``XForTokenClassification``: the same ``score`` head, with a bias, over
every token's final hidden state; process reward models served as vLLM serves them) load the
same way and answer ``token_classify`` requests, one row of label probabilities per prompt
token.

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
#: A token classifier's architecture suffix (``Qwen3ForTokenClassification``).
TOKEN_SUFFIX = "ForTokenClassification"


def is_classifier(architectures: Sequence[str]) -> bool:
    """Whether the checkpoint's first architecture is a sequence or token classifier."""
    return bool(architectures) and architectures[0].endswith((SUFFIX, TOKEN_SUFFIX))


def is_token_classifier(architectures: Sequence[str]) -> bool:
    """Whether the checkpoint's first architecture is a token classifier."""
    return bool(architectures) and architectures[0].endswith(TOKEN_SUFFIX)


def classifier_tokens(hf_config: Any) -> list[str] | None:
    """``classifier_from_token`` (vLLM's ``hf_overrides`` for a causal LM served as a
    classifier, Qwen3-Reranker's ``["no", "yes"]``): the tokens whose LM-head rows make the
    score head; None when the checkpoint has its own head. ValueError naming the field when
    it is not a list of at least two strings."""
    tokens = getattr(hf_config, "classifier_from_token", None)
    if tokens is None:
        return None
    if (not isinstance(tokens, list) or len(tokens) < 2
            or not all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"classifier_from_token must be a list of at least two token "
                         f"strings, got {tokens!r}")
    return tokens


def _two_way(hf_config: Any, tokens: list[str]) -> bool:
    """Two tokens read as one score, ``P(tokens[1])`` of the pair's softmax (vLLM's
    ``from_2_way_softmax``, Qwen3-Reranker's ``is_original_qwen3_reranker``)."""
    return len(tokens) == 2 and (bool(getattr(hf_config, "is_original_qwen3_reranker", False))
                                 or getattr(hf_config, "method", None) == "from_2_way_softmax")


def num_labels_of(hf_config: Any) -> int:
    """The classifier's label count: one for a two-way token classifier, one per token of
    :func:`classifier_tokens` otherwise, else ``num_labels`` (transformers derives it from
    ``id2label``); ValueError naming it when it is not a positive int."""
    tokens = classifier_tokens(hf_config)
    if tokens is not None:
        return 1 if _two_way(hf_config, tokens) else len(tokens)
    labels = getattr(hf_config, "num_labels", None)
    if not isinstance(labels, int) or isinstance(labels, bool) or labels < 1:
        raise ValueError(f"config.json: num_labels (or id2label) must give >= 1 label for a "
                         f"sequence classifier, got {labels!r}")
    return labels


class ScoreHead(nn.Module):
    """The classifier's head: ``[N, hidden] -> [N, num_labels]`` logits (``score.weight``,
    and ``score.bias`` for a token classifier, as HF lays them out; ``from_tokens``: made
    from LM-head rows, not in the checkpoint)."""

    def __init__(self, hidden_size: int, num_labels: int, from_tokens: bool = False,
                 bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_labels)) if bias else None
        self.from_tokens = from_tokens

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.to(self.weight.dtype), self.weight, self.bias)


def add_score_head(model: nn.Module, hidden_size: int, hf_config: Any) -> None:
    """Give ``model`` its ``score`` head (built on the current default device and dtype)."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    model.score = ScoreHead(hidden_size, num_labels_of(hf_config),
                            classifier_tokens(hf_config) is not None,
                            bias=is_token_classifier(architectures))


#: Where a token classifier's rows are read from, first found first: the LM head, else the
#: tied embedding.
_HEAD_NAMES = ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight")


def score_from_tokens(model: nn.Module, hf_config: Any, model_dir: str) -> None:
    """Fill a token classifier's head from the checkpoint's LM-head rows of its tokens (the
    tied embedding's when it has no ``lm_head.weight``), read alone from the files: their
    difference, ``yes - no``, for a two-way one (``sigmoid(l_yes - l_no)`` is the pair's
    softmax), else the rows themselves. ValueError naming a token the tokenizer lacks."""
    import transformers

    from mrv2.model_loader.loader import iter_safetensors

    head = score_head(model)
    tokens = classifier_tokens(hf_config)
    if head is None or tokens is None:
        return
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
            raise ValueError(f"classifier_from_token: {token!r} is not a token of the "
                             "model's tokenizer")
        ids.append(token_id)
    # (the checkpoint's tensors are memory-mapped views: only the picked rows are read)
    tables = {name: t for name, t in iter_safetensors(model_dir) if name in _HEAD_NAMES}
    found = next((tables[n][ids].float() for n in _HEAD_NAMES if n in tables), None)
    if found is None:
        raise ValueError(f"classifier_from_token: {model_dir} holds no lm_head.weight or "
                         "embed_tokens.weight to read the tokens' rows from")
    weight = found[1:2] - found[0:1] if _two_way(hf_config, tokens) else found
    with torch.no_grad():
        head.weight.copy_(weight)


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
