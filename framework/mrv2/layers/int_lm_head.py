"""An untied LM head a GPTQ / AWQ / compressed-tensors checkpoint stores quantized
(GPTQModel's ``quantization_config.lm_head: true``): :class:`IntLMHead`, made by
:func:`int_lm_head`. Its tensors are those of a quantized linear layer of the checkpoint's
format (:mod:`mrv2.layers.int_quant`); they load whole and are dequantized after loading into
the head's model-dtype weight, the head then running as an ordinary one."""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from torch import nn

from mrv2.layers.embedding import LMHead
from mrv2.layers.int_quant_config import IntQuantConfig, rows_of
from mrv2.layers.weights import apply_moving_only


class IntLMHead(LMHead):
    """An untied LM head a checkpoint stores quantized (GPTQModel's ``quantization_config.lm_head:
    true``): the checkpoint's tensors load as one row per vocabulary entry (whole, on every
    rank) and are dequantized after loading into the head's model-dtype ``weight`` (this
    rank's rows), the head then running as an ordinary one (made by :func:`int_lm_head`)."""

    quant: IntQuantConfig
    group: int
    int_loaded: set[str]

    def int_init(self, quant: IntQuantConfig) -> None:
        """Add the checkpoint's tensors (``[V, K]`` integers, ``[V, K/G]`` scales and zero
        points, ``g_idx [K]``) as parameters under its names; ``weight`` is filled from them."""
        k = self.embedding_dim
        group = quant.group_size if quant.group_size > 0 else k
        if k % group:
            raise ValueError(f"the quantized LM head's inputs ({k}) must divide into groups "
                             f"of {group} (quantization_config.group_size)")
        self.quant, self.group = quant, group
        self.weight.optional = True  # type: ignore[attr-defined]
        self._int_params()

    def _int_params(self) -> None:
        quant, group = self.quant, self.group
        n, k = self.num_embeddings, self.embedding_dim
        self.int_loaded = set()
        device = self.weight.device
        scale_dtype = torch.float32 if quant.method == "compressed-tensors" else torch.float16
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
            "qweight": ((n, k), torch.uint8), "scales": ((n, k // group), scale_dtype),
            "qzeros": ((n, k // group), torch.uint8), "g_idx": ((k,), torch.int32)}
        if quant.method == "compressed-tensors":
            shapes["weight_shape"] = ((2,), torch.int64)
        for role, (shape, dtype) in shapes.items():
            param = nn.Parameter(torch.zeros(shape, dtype=dtype, device=device),
                                 requires_grad=False)
            param.weight_loader = functools.partial(self._load_int, role)  # type: ignore[attr-defined]
            param.optional = role not in ("qweight", "scales")  # type: ignore[attr-defined]
            self.register_parameter(quant.name(role), param)

    def _load_int(self, role: str, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if role == "weight_shape":
            value = loaded.to(torch.int64)
        elif role == "g_idx":
            value = loaded.to(torch.int32)
        else:
            value = rows_of(self.quant, role, loaded)
            if role == "qzeros" and param.shape[0] < value.shape[0] < param.shape[0] + 32:
                value = value[: param.shape[0]]  # (packed along the vocabulary: its padding)
        if value.shape != param.shape:
            raise ValueError(f"the LM head's {self.quant.name(role)} expects "
                             f"{tuple(param.shape)} after unpacking, the checkpoint tensor "
                             f"gives {tuple(value.shape)}")
        with torch.no_grad():
            param.data.copy_(value)
        self.int_loaded.add(role)

    def _apply(self, fn: Any, recurse: bool = True) -> IntLMHead:
        # ``model.to(dtype)`` must move the scales, never cast them (dequantized after it)
        apply_moving_only(self, [self.quant.name("scales")],
                          lambda f: super(IntLMHead, self)._apply(f, recurse), fn)
        return self

    _reload: str | None = None

    def reopen_for_reload(self) -> bool:
        """After loading (the checkpoint's tensors dropped): take them again, as at start-up
        (new weights dequantized into ``weight`` in place); False where they are still
        there."""
        if self._parameters.get(self.quant.name("qweight")) is not None:
            return False
        self._int_params()
        self._reload = "fresh"
        return True

    def abandon_reload(self) -> None:
        """The checkpoint's tensors dropped again, ``weight`` as it was."""
        for role in ("qweight", "scales", "qzeros", "g_idx", "weight_shape"):
            self._parameters.pop(self.quant.name(role), None)
        self._reload = None

    def process_weights_after_loading(self) -> None:
        """Dequantize the checkpoint's tensors into this rank's rows of ``weight`` (once: they
        are dropped), then the plain head's layout. After new weights
        (:meth:`reopen_for_reload`): where none of the head's came, it keeps its weight;
        where only some did, a ValueError (it is dequantized whole)."""
        roles = ("qweight", "scales", "qzeros", "g_idx", "weight_shape")
        if self._reload is not None:
            need = {"qweight", "scales"} | (set() if self.quant.sym else {"qzeros"})
            got = need & self.int_loaded
            if got != need:
                self.abandon_reload()
                if got:
                    raise ValueError("new weights of the quantized LM head: give all of its "
                                     f"{', '.join(sorted(need))} tensors, not some")
                super().process_weights_after_loading()
                return
            self._reload = None
        params = {r: self._parameters.get(self.quant.name(r)) for r in roles}
        if params["qweight"] is not None:
            shape = params["weight_shape"]
            if "weight_shape" in self.int_loaded and shape is not None and shape.tolist() != [
                    self.num_embeddings, self.embedding_dim]:
                raise ValueError(f"the LM head's weight_shape {shape.tolist()} is not "
                                 f"{[self.num_embeddings, self.embedding_dim]}")
            k = self.embedding_dim
            g_idx = params["g_idx"]
            groups = (g_idx.data.long() if g_idx is not None and "g_idx" in self.int_loaded
                      else torch.arange(k, device=self.weight.device) // self.group)
            mid = float(1 << (self.quant.bits - 1))
            zeros = params["qzeros"] if "qzeros" in self.int_loaded else None
            q, scales = params["qweight"], params["scales"]
            assert q is not None and scales is not None
            out = self.weight.data  # this rank's rows (zeros past the vocabulary)
            end = min(self.num_embeddings, self.vocab_start + out.shape[0])
            with torch.no_grad():
                out.zero_()
                for start in range(self.vocab_start, end, 4096):  # (bounded temporaries)
                    rows = slice(start, min(start + 4096, end))
                    z = mid if zeros is None else zeros.data[rows].float()[:, groups]
                    out[start - self.vocab_start:rows.stop - self.vocab_start] = (
                        (q.data[rows].float() - z) * scales.data[rows].float()[:, groups]
                    ).to(out.dtype)
            for role in roles:
                self._parameters.pop(self.quant.name(role), None)
        super().process_weights_after_loading()


def int_lm_head(head: LMHead, quant: IntQuantConfig) -> IntLMHead:
    """Make ``head`` (untied) an :class:`IntLMHead` in place (before loading); a tied head (the
    embedding's weight) is a ValueError naming the settings."""
    if head.tied:
        raise ValueError("quantization_config.lm_head = true with tie_word_embeddings = true: "
                         "a quantized LM head tied to the embedding is not supported")
    head.__class__ = IntLMHead
    int_head = cast(IntLMHead, head)
    int_head.int_init(quant)
    return int_head
