"""Token embedding and the LM head (optionally tied to the embedding), vocabulary-parallel.

With tensor parallelism each rank holds ``ceil(vocab / size)`` rows of the table (the last
rank's tail padded with zeros): the embedding looks up the ids in its range, zeroes the rest
and all-reduces; the LM head computes its slice of the logits and all-gathers them, so every
rank's sampler sees the full vocabulary's logits. (The alternative, each rank's top-k gathered,
would move less at large vocabularies but cannot serve top-p, penalties or logprobs over the
whole vocabulary; a decode step's gather is ``batch x vocab`` values, small beside the weights.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.distributed.parallel_state import all_gather_last, all_reduce, tp_rank, tp_size
from mrv2.layers.linear import cpu_weight_layout
from mrv2_kernels.cpu_linear import linear_cpu


def _vocab_rows(num_embeddings: int, size: int) -> int:
    return -(-num_embeddings // size)


def _load_rows(param: nn.Parameter, loaded: torch.Tensor, start: int, total: int) -> None:
    """Rows ``start : start + len(param)`` of a whole ``[total, dim]`` table (zeros past it)."""
    if loaded.shape != (total, param.shape[1]):
        raise ValueError(f"parameter expects shape {(total, param.shape[1])}, checkpoint "
                         f"tensor has {tuple(loaded.shape)}")
    rows = min(param.shape[0], max(0, total - start))
    with torch.no_grad():
        param.data[:rows].copy_(loaded.narrow(0, start, rows))
        param.data[rows:].zero_()


class VocabEmbedding(nn.Module):
    """Token-id lookup: ``[T]`` int32/int64 ids -> ``[T, embedding_dim]`` (this rank's rows of
    the table with tensor parallelism; see the module)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_size = tp_size()
        rows = _vocab_rows(num_embeddings, self.tp_size)
        self.vocab_start = tp_rank() * rows
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim))
        if self.tp_size > 1:
            self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's rows of the checkpoint's whole table."""
        _load_rows(param, loaded, self.vocab_start, self.num_embeddings)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(mine, local, 0), self.weight)
        return all_reduce(out.masked_fill_(~mine.unsqueeze(-1), 0.0))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class ScaledEmbedding(VocabEmbedding):
    """Token embeddings times ``scale`` (Gemma's ``sqrt(hidden_size)``, Granite's
    ``embedding_multiplier``); a tied LM head reads the unscaled table. ``round_scale``: the
    factor rounded to the table's dtype first, as HF's Gemma multiplies by a tensor of the
    embeddings' dtype (Granite multiplies by the float itself). A host float either way: no
    tensor is made per call (nor copied to the device inside a CUDA graph's capture)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float,
                 round_scale: bool = False, scales_given: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = float(scale)
        self.round_scale = round_scale
        #: The family's HF model multiplies embeddings it is given (``inputs_embeds``) too,
        #: after the lookup (Granite's ``embedding_multiplier``), so prompts given as
        #: embeddings are scaled as they arrive; False: HF scales inside its embedding module
        #: (Gemma, Falcon-H1), and given embeddings are taken as they are.
        self.scales_given = scales_given
        self._scales: dict[torch.dtype, float] = {}

    def _scale_for(self, dtype: torch.dtype) -> float:
        if not self.round_scale:
            return self.scale
        if dtype not in self._scales:
            self._scales[dtype] = float(torch.tensor(self.scale, dtype=dtype))
        return self._scales[dtype]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(input_ids)
        return rows * self._scale_for(rows.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale}"


class PoolingLogits(nn.Module):
    """Stands in for the LM head of an engine that only pools (``runner="pooling"``, a
    sequence classifier): zero logits ``[N, vocab]``, no weights, no product. A pooling
    request samples one token nobody reads; this spares the head's memory (vocab x hidden:
    1.2 GB on an untied 8B model) and its product every step."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.new_zeros(hidden_states.shape[0], self.vocab_size)


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
        self.tp_size = tp_size()
        rows = _vocab_rows(num_embeddings, self.tp_size)
        self.vocab_start = tp_rank() * rows
        if tied_to is not None:
            if (tied_to.num_embeddings, tied_to.embedding_dim) != (num_embeddings, embedding_dim):
                raise ValueError(
                    f"cannot tie an LM head of shape {(num_embeddings, embedding_dim)} to an "
                    f"embedding of shape {(tied_to.num_embeddings, tied_to.embedding_dim)}"
                )
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(rows, embedding_dim))
            if self.tp_size > 1:
                self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.bias = nn.Parameter(torch.empty(rows)) if bias else None
        if self.bias is not None and self.tp_size > 1:
            self.bias.weight_loader = self.bias_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's rows of the checkpoint's whole head."""
        _load_rows(param, loaded, self.vocab_start, self.num_embeddings)

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's part of the checkpoint's whole bias (zeros past the vocabulary)."""
        if loaded.shape != (self.num_embeddings,):
            raise ValueError(f"parameter expects shape {(self.num_embeddings,)}, checkpoint "
                             f"tensor has {tuple(loaded.shape)}")
        rows = min(param.shape[0], max(0, self.num_embeddings - self.vocab_start))
        with torch.no_grad():
            param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))
            param.data[rows:].zero_()

    def process_weights_after_loading(self) -> None:
        """Called once the weights are loaded: the CPU layout (:func:`cpu_weight_layout`;
        a tied embedding then gathers its rows with a stride, a small cost per token).
        Subclasses with their own ``forward`` keep their layout."""
        if type(self).forward is LMHead.forward:
            with torch.no_grad():
                self.weight.data = cpu_weight_layout(self.weight.data)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.is_cuda:
            logits = F.linear(hidden_states, self.weight, self.bias)
        else:
            logits = linear_cpu(hidden_states, self.weight, self.bias)
        if self.tp_size == 1:
            return logits
        return all_gather_last(logits)[..., : self.num_embeddings]

    def extra_repr(self) -> str:
        return f"{self.embedding_dim} -> {self.num_embeddings}, tied={self.tied}"
