"""IBM Granite 3.x mixture of experts: ``GraniteMoeForCausalLM`` (granite-3.0 / 3.1
1b-a400m and 3b-a800m, PowerMoE-3b) and ``GraniteMoeSharedForCausalLM`` (the same with a
shared expert beside the routed ones). Every layer is Granite 4.0-H's attention layer
(:class:`~mrv2_granite_hybrid.model.HybridLayer`), always rotated by RoPE:

    h = h + m * attn(input_layernorm(h));  h = h + m * moe(post_attention_layernorm(h))

with Granite's four multipliers (token embeddings times ``embedding_multiplier``, scores
scaled by ``attention_multiplier``, ``m`` = ``residual_multiplier``, logits divided by
``logits_scaling``). ``moe``: a router (``block_sparse_moe.router.layer``) whose weights are
a softmax over the ``num_experts_per_tok`` largest of ``num_local_experts`` fp32 logits
(equal to the full softmax's top-k renormalized: the core's
:class:`~mrv2.layers.SoftmaxTopKRouter`), SwiGLU experts of ``intermediate_size`` on the
core's fused MoE kernels (the checkpoint's ``input_linear`` ``[E, 2I, H]``: each expert's gate
rows then its up rows, loaded as the fused ``w13``; ``output_linear`` ``[E, H, I]``), plus,
for ``GraniteMoeShared``, the ``shared_mlp`` (SwiGLU of ``shared_intermediate_size``; none
where that is 0, as HF builds none) added to the experts' output.

Granite MoE SWA (``GraniteMoeSWAForCausalLM``) is ``GraniteMoeShared`` (its shared expert
none unless ``shared_intermediate_size`` is set) with Granite SWA's attention, on the core's:
local layers per ``config.layer_types`` (a query sees its last ``sliding_window`` keys, its
own included), a learned sink per head (``self_attn.sinks``; HF scales each head's output by
``sigmoid(logsumexp(scores) - sink)``, the same as one more logit in the softmax's
denominator: gpt-oss's sinks) and a RoPE base per layer (``layer_rope_theta``; 0: NoPE).

Checkpoint names: the published ones (``input_linear`` / ``output_linear`` /
``router.layer``, what transformers still saves) and transformers 5's in-memory ones
(``experts.gate_up_proj`` / ``down_proj``, ``router.weight``), mapped by Granite 4.0-H's
``rename``. Tensor parallelism: attention by heads, every expert's and the shared MLP's
columns.
"""

from __future__ import annotations

from typing import Any, ClassVar

from mrv2.layers import RotaryEmbedding, head_dim_of, layer_ropes
from mrv2_granite_hybrid.model import GraniteMoeHybridForCausalLM


class GraniteMoeForCausalLM(GraniteMoeHybridForCausalLM):
    """Granite 3.x MoE in the mrv2 model contract (module docstring): attention layers
    only, each with routed experts and no shared MLP."""

    family: ClassVar[str] = "Granite MoE"

    def _layer_types(self, config: Any) -> list[str]:
        return ["full_attention"] * int(config.num_hidden_layers)

    def _shared_size(self, config: Any) -> int:
        return 0

    def _uses_rope(self, config: Any) -> bool:
        return True


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """Granite MoE with a shared expert (``shared_mlp`` of ``shared_intermediate_size``)
    beside the routed ones, in the mrv2 model contract (module docstring)."""

    family: ClassVar[str] = "Granite MoE (shared)"

    def _shared_size(self, config: Any) -> int:
        return int(getattr(config, "shared_intermediate_size", 0) or 0)


class GraniteMoeSWAForCausalLM(GraniteMoeSharedForCausalLM):
    """Granite MoE SWA in the mrv2 model contract (module docstring): Granite MoE's layers,
    local ones per ``layer_types``, attention sinks, a RoPE base per layer."""

    family: ClassVar[str] = "Granite MoE SWA"
    sinks: ClassVar[bool] = True

    def _ropes(self, config: Any, count: int) -> list[RotaryEmbedding | None]:
        """A RoPE per ``layer_rope_theta`` entry (0: none)."""
        return layer_ropes(config, head_dim_of(config),
                           getattr(config, "layer_rope_theta", None))
