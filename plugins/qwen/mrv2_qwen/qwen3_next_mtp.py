"""Qwen3-Next's multi-token-prediction (MTP) head, as its checkpoints keep it under ``mtp.``:

- ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``: the norms of the token embedding
  and of the previous hidden state;
- ``mtp.fc``: ``[H, 2H]``, no bias, over ``cat([embedding, hidden], -1)``;
- ``mtp.layers.{i}``: ``num_nextn_predict_layers`` (absent from the published configs: one)
  decoder layers of the family with full attention (:class:`mrv2_qwen.qwen3_next.Qwen3NextLayer`:
  the gated attention with q/k norms and partial RoPE, then the MLP that the main model's layer
  ``i`` would have: the routed experts with the gated shared expert on the published
  checkpoints), each expert's ``gate_proj``/``up_proj``/``down_proj`` stacked as the main
  model's are;
- ``mtp.norm``: the final norm before the LM head.

Every norm is Qwen3-Next's zero-centered RMSNorm (``1 + weight``: the loader adds the 1, as the
main model's does). The token embedding and the LM head are the main model's (shared: the
checkpoints carry no copies). One MTP step at ``T`` tokens::

    e = pre_fc_norm_embedding(embed(input_ids))       # [T, H]
    h = pre_fc_norm_hidden(previous_hidden_states)    # [T, H]
    x = fc(cat([e, h], -1))                           # [T, 2H] -> [T, H]
    out = layer(positions, x)                         # attention over its own KV cache layer
    logits = lm_head(norm(out))                       # compute_logits

The hidden-state, token and position contract is :mod:`mrv2.layers.mtp`'s: step 0 takes the
target's final normed hidden states, the tokens shifted left by one and the hidden states'
positions (the MTP cache entries share the target's block table); ``forward`` returns the layer
output un-normed and ``compute_logits`` applies ``mtp.norm``. A step ``s > 0`` gets the
previous step's un-normed output: it goes through ``mtp.norm`` before ``pre_fc_norm_hidden``,
so the draft chain feeds the MTP layer the *normed* output of the step before, as vLLM's and
SGLang's Qwen3-Next MTP do (their forward returns ``norm(out)``) and as step 0's input (the
target's normed hidden state) is. Unlike DeepSeek's MTP in vLLM, nothing zeroes the embedding
at position 0 (vLLM's Qwen3-Next MTP does not either).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from mrv2.layers import STACKED_PARAMS, LMHead, RMSNorm, VocabEmbedding, get_rope, head_dim_of
from mrv2.layers.linear import LinearBase
from mrv2.layers.mtp import SharedHeadMTP
from mrv2.layers.weights import StackedMapping, load_stacked_weights
from mrv2_qwen.qwen3_moe import skip_absent_shared_expert
from mrv2_qwen.qwen3_next import Qwen3NextLayer, layer_types_of

#: Checkpoint name prefixes of the MTP head (``model.mtp.``: the same tensors one level down).
MTP_PREFIXES = ("mtp.", "model.mtp.")


def mtp_layer_count(config: Any) -> int:
    """``num_nextn_predict_layers``; 1 when the config does not say (the published Qwen3-Next
    configs do not: their checkpoints carry one MTP layer). ValueError when it is below 1."""
    count = getattr(config, "num_nextn_predict_layers", None)
    count = 1 if count is None else int(count)
    if count < 1:
        raise ValueError(f"Qwen3-Next MTP: num_nextn_predict_layers must be >= 1, got {count} "
                         f"(the checkpoint has no MTP layers)")
    return count


def _zero_centered_norm(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An MTP norm's checkpoint weight ``w`` as ``1 + w`` (fp32); any other tensor as it is."""
    parts = name.rsplit(".", 2)
    if len(parts) == 3 and parts[2] == "weight" and "norm" in parts[1]:
        return tensor.float() + 1.0
    return tensor


class Qwen3NextMTP(SharedHeadMTP):
    """Qwen3-Next's MTP head (module docstring), built as ``Qwen3NextMTP(config, embed_tokens,
    lm_head)`` from the main model's shared embedding and LM head (usually through
    :meth:`mrv2_qwen.qwen3_next.Qwen3NextForCausalLM.build_mtp`).

    Parameter names are the checkpoint's without ``mtp.`` (``fc.weight``,
    ``layers.0.self_attn.qkv_proj.weight``, ``layers.0.mlp.experts.w13_weight``, ...).
    ``embed_tokens`` and ``lm_head`` are shared (:class:`~mrv2.layers.mtp.SharedHeadMTP`). MTP
    layer ``i``'s attention caches in KV cache layer
    ``first_layer_idx + i`` (default: the main model's full-attention layer count, right after
    its cache layers).
    """

    def __init__(
        self,
        config: Any,
        embed_tokens: VocabEmbedding,
        lm_head: LMHead,
        first_layer_idx: int | None = None,
    ) -> None:
        super().__init__(embed_tokens, lm_head)
        count = mtp_layer_count(config)
        self.config = config
        if first_layer_idx is None:
            first_layer_idx = layer_types_of(config).count("full_attention")
        self.first_layer_idx = first_layer_idx
        hidden, eps = int(config.hidden_size), float(config.rms_norm_eps)
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps=eps)
        self.fc = LinearBase(2 * hidden, hidden, bias=False)
        rope = get_rope(config, head_dim_of(config))
        # Layer i's MLP is what the main model's layer i would have (vLLM and SGLang index the
        # MTP layers from 0 too): the sparse MoE on every published checkpoint.
        self.layers = nn.ModuleList(
            Qwen3NextLayer(config, i, "full_attention", first_layer_idx + i, rope)
            for i in range(count)
        )
        self.norm = RMSNorm(hidden, eps=eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden_states: torch.Tensor,
        step: int = 0,
    ) -> torch.Tensor:
        """``input_ids``, ``positions`` ``[T]``, ``previous_hidden_states`` ``[T, H]`` (step 0:
        the target's normed hidden states; step ``s > 0``: step ``s - 1``'s output, normed
        here first) -> MTP layer ``step % num_nextn_predict_layers``'s output ``[T, H]``
        (layer output plus residual, not normed). Runs inside a forward context that holds
        its cache layer."""
        hidden = previous_hidden_states
        if step > 0:
            hidden = cast(torch.Tensor, self.norm(hidden))
        e = cast(torch.Tensor, self.pre_fc_norm_embedding(self.embed_tokens(input_ids)))
        h = cast(torch.Tensor, self.pre_fc_norm_hidden(hidden))
        x = self.fc(torch.cat([e, h], dim=-1))
        out, residual = self.layers[step % len(self.layers)](positions, x, None)
        return cast(torch.Tensor, out + residual)

    def compute_logits(self, hidden_states: torch.Tensor, step: int = 0) -> torch.Tensor:
        """``[N, H]`` MTP outputs -> ``[N, vocab]``: the shared LM head after ``mtp.norm``
        (one norm for every MTP layer, so ``step`` does not matter)."""
        return cast(torch.Tensor, self.lm_head(self.norm(hidden_states)))

    def rename(self, name: str) -> str | None:
        """A checkpoint name -> this module's parameter name; None for everything outside
        ``mtp.`` (the main model's tensors, its embedding and LM head) and RoPE caches."""
        for prefix in MTP_PREFIXES:
            if name.startswith(prefix):
                rest = name[len(prefix):]
                break
        else:
            return None
        if "rotary_emb.inv_freq" in rest or skip_absent_shared_expert(rest,
                                                                     self.config) is None:
            return None
        return rest.replace(".mlp.shared_expert.", ".mlp.shared_experts.")

    @property
    def stacked_params(self) -> StackedMapping:
        """The checkpoint-to-fused projection mapping (the main model's)."""
        return STACKED_PARAMS

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load the ``mtp.*`` tensors of a whole checkpoint's ``(name, tensor)`` pairs (routed
        experts into the stacked expert weights, each norm as ``1 + w``); returns the parameter
        names loaded. An ``mtp.*`` name that matches no parameter (an MTP layer past
        ``num_nextn_predict_layers`` included) is a ValueError."""
        mine = ((name, _zero_centered_norm(name, t)) for name, t in weights
                if self.rename(name) is not None)
        return load_stacked_weights(self, mine, STACKED_PARAMS, self.rename)
