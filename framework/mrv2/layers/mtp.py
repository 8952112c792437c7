"""Multi-token-prediction (MTP) layers, DeepSeek-V3 section 2.2's design, as DeepSeek-V3 and
GLM-4.5/4.6/4.7 checkpoints keep them: ``num_nextn_predict_layers`` layers after the main ones,
``model.layers.{num_hidden_layers + i}.*``, each ``enorm``, ``hnorm``, ``eh_proj``, one full
decoder block of the family (``input_layernorm``, ``self_attn.*``, ``post_attention_layernorm``,
``mlp.*``) and ``shared_head.norm``. Some checkpoints also carry ``embed_tokens.weight`` and
``shared_head.head.weight`` there: copies of the main model's embedding and LM head, which
:class:`MultiTokenPredictor` shares instead (skipped on load).

One MTP step at ``T`` tokens::

    e = enorm(embed(input_ids))                   # [T, H]
    h = hnorm(previous_hidden_states)             # [T, H]
    x = eh_proj(cat([e, h], -1))                  # [T, 2H] -> [T, H]
    out = decoder_block(positions, x)             # attention over the layer's own KV cache
    logits = lm_head(shared_head.norm(out))       # compute_logits

Contract (what a speculator feeds it, ``mrv2-plugin-mtp``), for MTP step 0 of a request whose
target step covered positions ``p .. q`` (hidden states ``h_p .. h_q``) and sampled token
``t_{q+1}``:

- ``previous_hidden_states[j]``: the target's *final, normed* hidden state at position
  ``p + j`` (what ``CausalLM.forward`` returns, i.e. what the default
  ``ModelState.speculator_inputs`` hands over);
- ``input_ids[j]``: the token at position ``p + j + 1`` (the step's tokens shifted left by
  one; the last is the token just sampled);
- ``positions[j] = p + j``: the *hidden state's* position, so the layer's KV cache entry for
  position ``p + j`` sits in the same slot as the target's (one block table serves both).

The output row ``j`` predicts the token at position ``p + j + 2``. Step ``s > 0`` (MTP layer
``s % num_nextn_predict_layers``: the checkpoints ship one, reused for every draft) feeds the
draft of step ``s - 1``, the un-normed output row of step ``s - 1`` as
``previous_hidden_states``, and position ``q + s``. Unlike vLLM, ``forward`` does not zero the
token embedding at position 0 (vLLM's MTP layers do; it only changes the cache entry of
position 0).

A family gives its causal LM a ``build_mtp(first_layer_idx)`` returning a
:class:`MultiTokenPredictor` over its own decoder block (:func:`build_mtp` does the sharing and
placement).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch import nn

from mrv2.contract.kv_cache import KVCacheLayer, KVCacheSpec
from mrv2.layers.embedding import LMHead, VocabEmbedding
from mrv2.layers.linear import LinearBase
from mrv2.layers.norm import RMSNorm
from mrv2.layers.weights import StackedMapping, load_stacked_weights

#: ``model.layers.{i}.rest`` of a checkpoint tensor name.
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
#: Checkpoint sub-names of an MTP layer that are not its decoder block's.
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
#: Duplicates of the main model's embedding and LM head: shared, never loaded here.
_SHARED = ("embed_tokens.", "shared_head.head.")

#: ``make_block(layer_idx, cache_idx)``: the family's decoder block for checkpoint layer
#: ``layer_idx`` whose attention caches in KV cache layer ``cache_idx``; called as
#: ``block(positions, x, None) -> (out, residual)``.
BlockFactory = Callable[[int, int], nn.Module]


def mtp_layer_count(config: Any) -> int:
    """How many MTP layers a checkpoint's config declares (``num_nextn_predict_layers``)."""
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0)


class SharedHead(nn.Module):
    """The norm before the (shared) LM head: checkpoint name ``shared_head.norm``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MTPLayer(nn.Module):
    """One MTP layer: ``enorm``, ``hnorm``, ``eh_proj``, the decoder block ``mtp_block`` and
    ``shared_head.norm``. Checkpoint tensor ``model.layers.{N + i}.X`` is parameter ``X`` for
    the first four, ``mtp_block.X`` else."""

    def __init__(self, config: Any, block: nn.Module) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.eh_proj = LinearBase(2 * hidden, hidden, bias=False)
        self.mtp_block = block
        self.shared_head = SharedHead(config)

    def forward(
        self, positions: torch.Tensor, embeds: torch.Tensor, previous_hidden_states: torch.Tensor
    ) -> torch.Tensor:
        e = cast(torch.Tensor, self.enorm(embeds))
        h = cast(torch.Tensor, self.hnorm(previous_hidden_states))
        x = self.eh_proj(torch.cat([e, h], dim=-1))
        out, residual = self.mtp_block(positions, x, None)
        return cast(torch.Tensor, out + residual)


class SharedHeadMTP(nn.Module):
    """Base of an MTP module over a causal LM's *shared* token embedding and LM head: both kept
    in a tuple, outside the module's tree, so they are not parameters of it
    (``named_parameters``, ``state_dict``, ``.to()`` and the strict load check see the MTP
    layers' own weights only); its attention's KV cache layers declared by
    :meth:`kv_cache_specs`. A family whose checkpoints lay the MTP head out otherwise than
    :class:`MultiTokenPredictor` (Qwen3-Next's ``mtp.*``) subclasses it."""

    first_layer_idx: int
    layers: nn.ModuleList

    def __init__(self, embed_tokens: VocabEmbedding, lm_head: LMHead) -> None:
        super().__init__()
        self._shared: tuple[VocabEmbedding, LMHead] = (embed_tokens, lm_head)

    @property
    def embed_tokens(self) -> VocabEmbedding:
        """The main model's token embedding (shared)."""
        return self._shared[0]

    @property
    def lm_head(self) -> LMHead:
        """The main model's LM head (shared)."""
        return self._shared[1]

    def kv_cache_specs(self) -> dict[int, KVCacheSpec]:
        """``{cache layer index: spec}`` of the MTP layers' attention (for a speculator's
        ``kv_cache_specs``)."""
        return {m.layer_idx: m.kv_cache_spec() for m in self.modules()
                if isinstance(m, KVCacheLayer)}

    def extra_repr(self) -> str:
        return f"layers={len(self.layers)}, first_cache_layer={self.first_layer_idx}"


class MultiTokenPredictor(SharedHeadMTP):
    """The ``num_nextn_predict_layers`` MTP layers of a checkpoint (see the module for the
    hidden-state and position contract).

    ``embed_tokens`` and ``lm_head`` are the main model's and *shared*
    (:class:`SharedHeadMTP`). MTP layer ``i`` is ``make_block(num_hidden_layers + i,
    first_layer_idx + i)``; its KV cache layers are declared by :meth:`kv_cache_specs`.
    ``stacked`` maps the checkpoint's separate projections to the block's fused ones.
    """

    def __init__(
        self,
        config: Any,
        embed_tokens: VocabEmbedding,
        lm_head: LMHead,
        make_block: BlockFactory,
        stacked: StackedMapping = (),
        first_layer_idx: int | None = None,
    ) -> None:
        super().__init__(embed_tokens, lm_head)
        count = mtp_layer_count(config)
        if count < 1:
            raise ValueError(
                "config.num_nextn_predict_layers is 0: the checkpoint has no MTP layers"
            )
        self.config = config
        self.stacked = stacked
        self.num_main_layers = int(config.num_hidden_layers)
        self.first_layer_idx = self.num_main_layers if first_layer_idx is None else first_layer_idx
        self.layers = nn.ModuleList(
            MTPLayer(config, make_block(self.num_main_layers + i, self.first_layer_idx + i))
            for i in range(count)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        step: int = 0,
    ) -> torch.Tensor:
        """``input_ids``, ``positions`` ``[T]``, ``previous_hidden_states`` ``[T, H]`` -> the
        MTP layer ``step % num_nextn_predict_layers``'s output ``[T, H]`` (block output plus
        residual, not normed). Runs inside a forward context that holds its cache layer."""
        layer = self.layers[step % len(self.layers)]
        return cast(torch.Tensor, layer(positions, self.embed_tokens(input_ids),
                                        previous_hidden_states))

    def compute_logits(self, hidden_states: torch.Tensor, step: int = 0) -> torch.Tensor:
        """``[N, H]`` MTP outputs -> ``[N, vocab]``: the shared LM head after the layer's
        ``shared_head.norm``."""
        layer = cast(MTPLayer, self.layers[step % len(self.layers)])
        normed = cast(torch.Tensor, layer.shared_head.norm(hidden_states))
        return cast(torch.Tensor, self.lm_head(normed))

    def rename(self, name: str) -> str | None:
        """A checkpoint name -> this module's parameter name; None for everything but the MTP
        layers' own tensors (main layers, embedding, head, and the MTP layers' copies of the
        embedding and head)."""
        m = LAYER_NAME.match(name)
        if m is None:
            return None
        index = int(m.group(1)) - self.num_main_layers
        rest = m.group(2)
        if index < 0 or rest.startswith(_SHARED) or "rotary_emb.inv_freq" in rest:
            return None
        if rest.startswith(_OWN):
            return f"layers.{index}.{rest}"
        return f"layers.{index}.mtp_block.{rest}"

    @property
    def stacked_params(self) -> StackedMapping:
        """The checkpoint-to-fused projection mapping (as a causal LM's ``stacked_params``)."""
        return self.stacked

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the MTP layers' tensors from a whole checkpoint's ``(name, tensor)`` pairs
        (routed experts into the stacked expert weights); returns the parameter names loaded.
        A checkpoint with more MTP layers than ``num_nextn_predict_layers`` is an error."""
        return load_stacked_weights(self, weights, self.stacked, self.rename)


def build_mtp(model: nn.Module, cls: Callable[..., SharedHeadMTP], *args: Any,
              **kwargs: Any) -> Any:
    """``cls(config, embed_tokens, lm_head, *args, **kwargs)`` for causal LM ``model`` (a
    :class:`~mrv2.layers.decoder.CausalLM`), built on its device in its dtype with unloaded
    weights: load them with ``load_model_weights(mtp, iter_safetensors(model_dir))``, then run
    ``mrv2.model_loader.build.process_weights_after_loading(mtp)``."""
    embed = cast(VocabEmbedding, model.model.embed_tokens)  # type: ignore[union-attr]
    weight = embed.weight
    previous = torch.get_default_dtype()
    torch.set_default_dtype(weight.dtype)
    try:
        with torch.device(weight.device):
            return cls(model.config, embed, model.lm_head, *args, **kwargs)
    finally:
        torch.set_default_dtype(previous)
