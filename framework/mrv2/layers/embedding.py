"""Token embedding and the LM head (optionally tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers.linear import cpu_weight_layout
from mrv2_kernels.cpu_linear import linear_cpu


class VocabEmbedding(nn.Module):
    """Token-id lookup: ``[T]`` int32/int64 ids -> ``[T, embedding_dim]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_size: int = 1) -> None:
        super().__init__()
        if tp_size != 1:
            raise NotImplementedError(
                f"tensor parallelism is not implemented yet (tp_size={tp_size})"
            )
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class LMHead(nn.Module):
    """Projects hidden states ``[N, hidden]`` to logits ``[N, vocab]`` in the model dtype.

    With ``tied_to`` given, the head reuses that embedding's weight parameter (one tensor, one
    parameter name: the embedding's), so loading either checkpoint name fills both.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        tied_to: VocabEmbedding | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tied = tied_to is not None
        if tied_to is not None:
            if tied_to.weight.shape != (num_embeddings, embedding_dim):
                raise ValueError(
                    f"cannot tie an LM head of shape {(num_embeddings, embedding_dim)} to an "
                    f"embedding of shape {tuple(tied_to.weight.shape)}"
                )
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))
        self.bias = nn.Parameter(torch.empty(num_embeddings)) if bias else None

    def process_weights_after_loading(self) -> None:
        """Called once the weights are loaded: the CPU layout (:func:`cpu_weight_layout`;
        a tied embedding then gathers its rows with a stride, a small cost per token).
        Subclasses with their own ``forward`` keep their layout."""
        if type(self).forward is LMHead.forward:
            with torch.no_grad():
                self.weight.data = cpu_weight_layout(self.weight.data)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.is_cuda:
            return F.linear(hidden_states, self.weight, self.bias)
        return linear_cpu(hidden_states, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.embedding_dim} -> {self.num_embeddings}, tied={self.tied}"
