"""Step-3.7's multi-token-prediction (MTP) layers for the ``mtp`` speculator
(``--speculative-config '{"method": "mtp", "num_speculative_tokens": k}'``).

The checkpoints keep ``num_nextn_predict_layers`` of them after the main layers, as DeepSeek-V3
does (:mod:`mrv2.layers.mtp`): ``model.layers.{num_hidden_layers + i}.*``, each ``enorm``,
``hnorm``, ``eh_proj``, one Step decoder block (``input_layernorm``, the gated attention,
``post_attention_layernorm``, the dense MLP or the experts, named as the main layers') and
``shared_head.norm``; the published ones put the last under ``transformer.``
(``transformer.shared_head.norm``) beside ``transformer.shared_head.output``, a copy of the LM
head, which is shared instead (as the main embedding is; vLLM strips ``transformer.`` too).
Every norm is Step's ``1 + w`` RMSNorm.

MTP layer ``i``'s block is what transformers 5.17's config says (it splits the legacy
per-layer lists padded with the MTP layers' entries): attention ``mtp_layer_types[i]``
(a ``sliding_attention`` layer: ``sliding_window`` keys, ``num_sliding_attention_heads``
query heads, the sliding layers' RoPE; else the full layers'), MLP ``mtp_mlp_layer_types[i]``
(``dense``: a SwiGLU of ``intermediate_size``; ``sparse``: the experts), its activations
clamped only where ``swiglu_limits`` / ``swiglu_limits_shared`` still list the MTP layers
(transformers drops their entries). Draft step ``s`` runs layer ``s % num_nextn_predict_layers``
and feeds the next step its output un-normed (vLLM's chain; transformers' ``MtpModel`` feeds
the ``shared_head.norm`` output instead).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn

from mrv2.layers import STACKED_PARAMS, LMHead, VocabEmbedding
from mrv2.layers.mtp import MultiTokenPredictor
from mrv2.model_loader.build import vl_text_name

#: Where the published checkpoints nest the MTP layers' head norm and head copy.
_NESTED = ".transformer.shared_head."
#: The MTP layers' LM head copies (published: ``shared_head.output``): the main head serves.
_HEAD_COPIES = (".shared_head.output.", ".shared_head.head.")


def _need(ok: bool, field: str, value: Any, what: str) -> None:
    if not ok:
        raise ValueError(f"Step3p7ForConditionalGeneration: config.json text_config.{field} = "
                         f"{value!r}: {what} (needed by speculative_config method 'mtp')")


def mtp_layer_kinds(config: Any) -> list[tuple[str, str]]:
    """``(attention type, MLP type)`` of each MTP layer; a ``ValueError`` naming the text
    config's field if the config declares none or lists them otherwise than it can run."""
    count = getattr(config, "num_nextn_predict_layers", None) or 0
    _need(int(count) >= 1, "num_nextn_predict_layers", count,
          "the checkpoint declares no MTP layers")
    count = int(count)
    kinds = getattr(config, "mtp_layer_types", None)
    ropes = getattr(config, "rope_parameters", None) or {}
    _need(isinstance(kinds, list) and len(kinds) == count
          and all(k in ("full_attention", "sliding_attention") and k in ropes for k in kinds),
          "mtp_layer_types", kinds,
          f"must list, for each of the {count} MTP layers, 'full_attention' or "
          f"'sliding_attention' (a type the main layers have: its RoPE)")
    mlps = getattr(config, "mtp_mlp_layer_types", None)
    _need(isinstance(mlps, list) and len(mlps) == count
          and all(m in ("dense", "sparse") for m in mlps), "mtp_mlp_layer_types", mlps,
          f"must list 'dense' or 'sparse' for each of the {count} MTP layers")
    return list(zip(cast(list[str], kinds), cast(list[str], mlps), strict=True))


class MTPLayerConfig:
    """The text config as MTP layer ``index``'s block reads it at cache layer ``cache_idx``:
    ``layer_types`` / ``mlp_layer_types`` / the clamps' lists hold that layer's entries at
    ``cache_idx`` (where the block looks them up), everything else the text config's."""

    def __init__(self, config: Any, index: int, cache_idx: int, kind: str, mlp: str) -> None:
        self._config = config
        self.layer_types = ["full_attention"] * cache_idx + [kind]
        self.mlp_layer_types = ["dense"] * cache_idx + [mlp]
        main = int(config.num_hidden_layers)
        for field in ("swiglu_limits", "swiglu_limits_shared"):
            limits = list(getattr(config, field, None) or [])
            # transformers drops the MTP layers' entries; a config that kept them clamps
            value = limits[main + index] if len(limits) > main + index else None
            setattr(self, field, [None] * cache_idx + [value])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


class Step3p7MTP(MultiTokenPredictor):
    """Step-3.7's MTP layers (module docstring) over the main model's shared embedding and LM
    head; ``make_block(config, cache_idx)`` builds a Step decoder block from a
    :class:`MTPLayerConfig`. Loads the checkpoint's MTP tensors in the published layout
    (stacked experts, ``share_expert``, ``transformer.shared_head``) or transformers' names."""

    def __init__(self, config: Any, embed_tokens: VocabEmbedding, lm_head: LMHead,
                 make_block: Callable[[Any, int], nn.Module],
                 expand: Callable[[Iterable[tuple[str, torch.Tensor]]],
                                  Iterable[tuple[str, torch.Tensor]]],
                 rename_block: Callable[[str], str],
                 first_layer_idx: int | None = None) -> None:
        kinds = mtp_layer_kinds(config)
        main = int(config.num_hidden_layers)

        def block(layer_idx: int, cache_idx: int) -> nn.Module:
            kind, mlp = kinds[layer_idx - main]
            return make_block(MTPLayerConfig(config, layer_idx - main, cache_idx, kind, mlp),
                              cache_idx)

        super().__init__(config, embed_tokens, lm_head, block, STACKED_PARAMS, first_layer_idx)
        self._expand = expand
        self._rename_block = rename_block

    def rename(self, name: str) -> str | None:
        """A checkpoint name -> this module's parameter name; None for everything but the MTP
        layers' own tensors (and their copies of the LM head and embedding)."""
        name = vl_text_name(name).replace(_NESTED, ".shared_head.")
        if any(copy in name for copy in _HEAD_COPIES):
            return None
        return super().rename(self._rename_block(name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the MTP layers' tensors of a whole checkpoint (each norm as ``1 + w``, stacked
        experts one per expert); returns the parameter names loaded."""
        mine = ((name, t) for name, t in weights if self.rename(name) is not None)
        return super().load_weights(self._expand(mine))
