"""Qwen3-VL (``Qwen3VLForConditionalGeneration``) in the mrv2 model contract.

The language model is Qwen3's decoder (per-head q/k RMSNorm, projections biased per
``attention_bias``) over the flat token batch, rotating by *interleaved* M-RoPE
(:mod:`mrv2_qwen_vl.mrope`; ``[3, T]`` positions from the model state, as for Qwen2.5-VL). The
vision tower (:class:`~mrv2_qwen_vl.vision_qwen3.Qwen3VisionTower`) is a submodule run by the
model state on a step's new images, never by ``forward``.

Deepstack
---------
Besides the merged image tokens, the tower returns one feature per deepstack merger
(``deepstack_visual_indexes``, in block order). HF adds feature ``j`` to the hidden states of
the image-token rows right after decoder layer ``j`` (the layer's whole output, residual
included), for ``j < len(features)`` (features past the last layer are unused).
:meth:`Qwen3VLForConditionalGeneration.embed_images` returns the image's rows as one
``[N, 1 + L, hidden]`` tensor (column 0: the input embedding, column ``1 + j``: feature
``j``, ``L`` capped at the layer count), so the model state's encoder cache keeps them
together under one key and a prefill chunk slices all of them with the same rows.

``forward`` takes them as ``deepstack`` (:class:`DeepstackRows`: the step's image-token rows
and their ``[R, L, hidden]`` features) and adds feature ``j`` to layer ``j``'s output at those
rows with ``index_add`` (device indices, no host sync). mrv2's layers keep the residual stream
as ``hidden + residual`` (the add fused into the next norm); the feature goes into the
``hidden`` half, which sums to HF's stream.

Only a step that computes image placeholder rows passes ``deepstack``: the choice is made on
the host from the step's CPU bookkeeping (the model state's ``get_mm_embeddings``), so
text-only steps, decode steps and the CUDA graphs (captured from dummy batches without
images) run exactly the Qwen3 text forward: no persistent deepstack buffer, no masked
zero-adds, nothing per layer. The price is that a step with image rows runs eager; those are
prefill steps, which run eager anyway.

Checkpoints load as HF 5.17 saves them (``model.language_model.*``, ``model.visual.*``,
``lm_head.weight``) and as the original layout (``model.layers.*``, ``visual.*``);
``tie_word_embeddings`` is read at the top level of the composite config, as HF does.

Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL-30B-A3B, 235B-A22B) is the
same model with Qwen3-MoE's routed experts in the MLP's place (layers outside
``mlp_only_layers`` whose ``(i + 1) % decoder_sparse_step == 0``; top-k of a softmax,
renormalized). Its published checkpoints keep each layer's experts stacked and transposed
(``experts.gate_up_proj`` ``[E, H, 2I]``, ``experts.down_proj`` ``[E, I, H]``); transformers
saves them untransposed (``[E, 2I, H]``, ``[E, H, I]``). Both load: a stack is transposed
where its shape says it is the published one (where ``H == 2I`` the gate/up stack cannot
tell, and is read as transformers saves it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    FusedMoE,
    GatedMLP,
    MoEBlock,
    SelfAttention,
    SoftmaxTopKRouter,
    head_dim_of,
)
from mrv2.layers.moe import is_sparse_layer
from mrv2.model_loader.build import vl_text_config
from mrv2_qwen_vl.model import load_text_and_vision
from mrv2_qwen_vl.mrope import get_mrope
from mrv2_qwen_vl.vision_qwen3 import CHECKPOINT_PREFIXES, Qwen3VisionTower

__all__ = ["DeepstackRows", "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
           "Qwen3VLTextModel"]


@dataclass(frozen=True)
class DeepstackRows:
    """A step's deepstack inputs: ``token_indices`` ``[R]`` int64 rows of the flat step batch
    (image placeholders) and their ``features`` ``[R, L, hidden]`` (feature ``j`` is added
    after decoder layer ``j``)."""

    token_indices: torch.Tensor
    features: torch.Tensor


class Qwen3VLTextModel(DecoderModel):
    """The decoder stack; ``forward`` adds the deepstack features when it is given some."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None, deepstack: DeepstackRows | None = None,
    ) -> torch.Tensor:
        if deepstack is None:
            return super().forward(input_ids, positions, inputs_embeds)
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rows, features = deepstack.token_indices, deepstack.features
        residual = None
        for i, layer in enumerate(self.layers):
            if self.aux_hidden_states is not None and i in self._aux_slots:
                self._keep(i, hidden_states, residual)
            hidden_states, residual = layer(positions, hidden_states, residual)
            if i < features.shape[1]:
                hidden_states = hidden_states.index_add(
                    0, rows, features[:, i].to(hidden_states.dtype))
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3VLForConditionalGeneration(CausalLM):
    """Qwen3-VL: Qwen3 text decoder with interleaved M-RoPE and deepstack, plus the vision
    tower (``visual``)."""

    media_encoders: ClassVar[tuple[str, ...]] = ("visual",)

    def __init__(self, config: Any) -> None:
        text = vl_text_config(config)
        rope = get_mrope(text, head_dim_of(text), interleaved=True,
                         default_section=(24, 20, 20))
        bias = bool(getattr(text, "attention_bias", False))

        def layer(i: int) -> DecoderLayer:
            attention = SelfAttention(text, i, rope, qkv_bias=bias, o_bias=bias, qk_norm=True)
            return DecoderLayer(text, attention, type(self).mlp(text, i))

        super().__init__(text, Qwen3VLTextModel(text, layer))
        self.hf_config = config
        self.visual = Qwen3VisionTower(config.vision_config)
        #: How many deepstack features the decoder consumes (HF ignores any past its layers).
        self.deepstack_depth = min(len(self.visual.deepstack_layers), len(self.model.layers))

    @staticmethod
    def mlp(text: Any, layer_idx: int) -> nn.Module:
        """Decoder layer ``layer_idx``'s MLP: a SwiGLU MLP (the MoE model: its experts)."""
        return GatedMLP(text.hidden_size, text.intermediate_size, text.hidden_act)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None, deepstack: DeepstackRows | None = None,
    ) -> torch.Tensor:
        """As :meth:`CausalLM.forward`, plus the step's ``deepstack`` rows (module doc)."""
        out: torch.Tensor = self.model(input_ids, positions, inputs_embeds, deepstack)
        return out

    def embed_images(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
                     ) -> torch.Tensor:
        """``[N, 1 + L, hidden]`` rows of the images in ``pixel_values`` (their patch rows in
        order) with patch grids ``grid_thw``, in the model dtype: column 0 replaces the
        placeholder embeddings, column ``1 + j`` is deepstack feature ``j``."""
        tokens, deepstack = self.visual(pixel_values, grid_thw)
        rows = torch.stack([tokens, *deepstack[: self.deepstack_depth]], dim=1)
        return rows.to(self.model.embed_tokens.weight.dtype)

    def rename(self, name: str) -> str | None:
        """A text checkpoint name as the decoder's: transformers' ``model.language_model.*``
        is ``model.*`` (LoRA adapters of these models use either)."""
        return super().rename(name.replace("model.language_model.", "model.", 1))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Text weights through the decoder's loader, ``visual.*`` through the tower's."""
        return load_text_and_vision(self, self.visual, CHECKPOINT_PREFIXES, weights)


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL-MoE: Qwen3-VL with routed experts in the sparse layers (module docstring)."""

    @staticmethod
    def mlp(text: Any, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s routed experts, or a SwiGLU MLP where the config keeps one."""
        if not is_sparse_layer(text, layer_idx):
            return GatedMLP(text.hidden_size, text.intermediate_size, text.hidden_act)
        if text.hidden_act != "silu":
            raise ValueError(f"Qwen3-VL-MoE experts support hidden_act 'silu' only, got "
                             f"{text.hidden_act!r}")
        router = SoftmaxTopKRouter(text.hidden_size, text.num_experts,
                                   text.num_experts_per_tok, renormalize=True)
        return MoEBlock(router, FusedMoE(text.num_experts, text.hidden_size,
                                         text.moe_intermediate_size))

    def _untranspose(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        text = vl_text_config(self.hf_config)
        hidden, inter = int(text.hidden_size), int(text.moe_intermediate_size)
        published = {"experts.gate_up_proj": (hidden, 2 * inter),
                     "experts.down_proj": (inter, hidden)}
        for name, tensor in weights:
            shape = next((s for k, s in published.items() if name.endswith(k)), None)
            if (shape is not None and tensor.dim() == 3 and tuple(tensor.shape[1:]) == shape
                    and shape[0] != shape[1]):
                tensor = tensor.transpose(1, 2)
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As Qwen3-VL's, the experts' stacks in either layout (module docstring)."""
        return super().load_weights(self._untranspose(weights))
