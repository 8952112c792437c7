"""Pairs for scoring (``LLM.score``, ``/score``, ``/rerank``), as vLLM pairs them: one first
item against every second item, or the two lists item by item; and what a pair's score is
for each kind of model."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def broadcast_pairs(firsts: Sequence[T], seconds: Sequence[T],
                    names: tuple[str, str] = ("data_1", "data_2")) -> list[tuple[T, T]]:
    """The pairs: a single first item repeated for every second one, else item by item;
    ValueError naming both fields when the lists are empty or their lengths differ."""
    if not firsts or not seconds:
        raise ValueError(f"{names[0]} and {names[1]} must each hold at least one item")
    if len(firsts) == 1:
        return [(firsts[0], second) for second in seconds]
    if len(firsts) != len(seconds):
        raise ValueError(f"{names[0]} holds {len(firsts)} items and {names[1]} "
                         f"{len(seconds)}: give one {names[0]} item, or as many as "
                         f"{names[1]} holds")
    return list(zip(firsts, seconds, strict=True))


def check_scorer(num_labels: int | None) -> None:
    """ValueError unless the model scores pairs: an embedding model (``num_labels`` None:
    cosine similarity) or a classifier of one label (a reranker: its sigmoid)."""
    if num_labels is not None and num_labels != 1:
        raise ValueError(f"scoring needs a classifier of one label (a reranker) or an "
                         f"embedding model; this classifier has num_labels={num_labels} "
                         "(classify instead)")


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Two vectors' cosine similarity, in float64: their dot product over their norms (an
    embedding is not unit length where the model does not normalize, a sentence-transformers
    checkpoint without a ``Normalize`` module); 0.0 where either is all zeros."""
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    return float(dot / norms) if norms > 0 else 0.0
