"""Mixture-of-experts layers: routers, the fused routed experts, and the MoE block around them.

A MoE block is ``routed(x) + shared(x)``: a router picks ``top_k`` experts per token with a
weight each, the routed experts (:class:`FusedMoE`, every expert's weights stacked in one
tensor for :func:`mrv2_kernels.fused_moe.fused_moe`) run their SwiGLU MLPs on the tokens sent
to them and add them up with those weights, and optional shared experts (a dense
:class:`~mrv2.layers.mlp.GatedMLP`) see every token. Routers:

- :class:`SoftmaxTopKRouter`: softmax over the experts, top-k, optionally renormalized
  (Qwen3-MoE's ``norm_topk_prob``, Mixtral, Qwen2-MoE).
- :class:`GroupedTopKRouter`: sigmoid scores plus ``e_score_correction_bias`` choose the
  experts inside the ``topk_group`` best of ``n_group`` groups; the weights are the uncorrected
  scores, optionally renormalized, times ``routed_scaling_factor`` (DeepSeek-V3's "noaux_tc",
  GLM-4.5/4.6/4.7). With softmax scores and no correction bias it is DeepSeek-V2's
  group-limited greedy routing (group score: its best expert).

Everything here is device ops of static shapes: no host reads, so a MoE layer records into a
CUDA graph like any other. Checkpoints keep one tensor per expert
(``...experts.{e}.gate_proj.weight``); :func:`mrv2.model_loader.load_stacked_weights` sends
them (and transformers 5's stacked ``experts.gate_up_proj`` / ``experts.down_proj``) to
:class:`FusedMoE`'s stacked parameters.
"""

from __future__ import annotations

import os
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.contract.forward_context import real_token_count
from mrv2.distributed.parallel_state import all_reduce, expert_parallel
from mrv2.layers.linear import resolve_tp, split_evenly
from mrv2.layers.mlp import GatedMLP
from mrv2.layers.weights import apply_moving_only
from mrv2_kernels.fused_moe import ACTIVATIONS, fused_moe
from mrv2_kernels.moe_router import grouped_topk, softmax_topk
from mrv2_kernels.norm_gemv import decode_linear

#: Environment variable: when set to 1 before a model is built, every :class:`FusedMoE` counts
#: the distinct experts each forward reads (``FusedMoE.expert_reads``), for the benchmarks'
#: byte floor. Off by default: it costs a few small launches per layer.
COUNT_READS_ENV = "MRV2_COUNT_EXPERT_READS"

class FusedMoE(nn.Module):
    """The routed experts: ``num_experts`` SwiGLU MLPs with stacked weights.

    ``w13_weight`` ``[E, 2I, H]`` holds each expert's gate rows then its up rows,
    ``w2_weight`` ``[E, H, I]`` its down projection. ``forward(x, topk_weights, topk_ids)``
    returns ``sum_j topk_weights[:, j] * expert_{topk_ids[:, j]}(x)``.

    Expert parallelism (built under :func:`~mrv2.distributed.parallel_state.
    expert_parallel_build`, the engine's ``enable_expert_parallel``): each rank holds
    ``E / size`` whole experts (``first_expert`` on, ``local_experts`` of them; no column
    split: ``tp_size`` reads 1 here), routes every pair and computes its own experts' (the
    others' ids point at its first expert with a zero weight: no host sync, a graph's shapes),
    and the ranks' outputs are summed as under tensor parallelism (``world`` ranks).

    ``bias``: ``w13_bias`` ``[E, 2I]`` (gate then up) and ``w2_bias`` ``[E, H]`` on the
    projections; ``activation``: ``"silu"`` (``silu(gate) * up``), gpt-oss's clamped
    ``"swigluoai"`` (:func:`mrv2_kernels.fused_moe_ref.glu`, clamped at ``swiglu_limit``),
    Gemma 4's GeGLU ``"gelu_tanh"`` or Step's clamped SiLU ``"silu_clamp"`` (``min(silu(gate),
    swiglu_limit) * clamp(up, -swiglu_limit, swiglu_limit)``).

    Tensor parallelism splits every expert's intermediate dimension: a rank holds ``I / size``
    gate, up and down columns of each expert (tensor parallelism inside the experts; the
    router and the routing are the same on every rank) and the partial outputs are summed
    (all-reduce; ``reduce_output=False`` leaves it to :class:`MoEBlock`, which sums the
    shared experts' partials with them in one all-reduce).
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int,
        tp_size: int | None = None, reduce_output: bool = True, *, bias: bool = False,
        activation: str = "silu", swiglu_limit: float = 7.0,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"the experts' activation must be one of {', '.join(ACTIVATIONS)};"
                             f" got {activation!r}")
        self.activation = activation
        self.swiglu_limit = float(swiglu_limit)
        rank, size = resolve_tp(tp_size)
        #: The ranks whose outputs are summed (tensor or expert parallelism alike).
        self.world = size
        self.expert_parallel = expert_parallel() and size > 1
        if self.expert_parallel:  # whole experts per rank; columns not split
            self.local_experts = split_evenly(num_experts, size,
                                              "num_experts (expert parallelism)")
            self.first_expert = rank * self.local_experts
            rank, size = 0, 1
        else:
            self.local_experts, self.first_expert = num_experts, 0
        #: The rank and size the experts' columns are split over (1 under expert parallelism).
        self.tp_rank, self.tp_size = rank, size
        self.reduce_output = reduce_output
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.full_intermediate_size = intermediate_size
        #: This rank's intermediate columns per expert.
        intermediate_size = split_evenly(intermediate_size, self.tp_size,
                                         "moe intermediate size")
        self.intermediate_size = intermediate_size
        #: This rank's intermediate rows, and where they start in its layout (integer experts
        #: pad their layout to whole groups: :mod:`mrv2.layers.int_quant_moe`).
        self.rank_inter, self.pad_before = intermediate_size, 0
        local = self.local_experts
        self.w13_weight = nn.Parameter(torch.empty(local, 2 * intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(local, hidden_size, intermediate_size))
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if bias:
            self.w13_bias = nn.Parameter(torch.empty(local, 2 * intermediate_size))
            self.w2_bias = nn.Parameter(torch.empty(local, hidden_size))
            for param in (self.w13_bias, self.w2_bias):
                param.weight_loader = self.bias_loader  # type: ignore[attr-defined]
        self.count_reads = os.environ.get(COUNT_READS_ENV, "") == "1"
        self.expert_reads: torch.Tensor | None = None

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str] | None = None
    ) -> None:
        """Copy one expert's ``gate``/``up``/``down`` tensor (``shard_id = (expert, kind)``), or
        the whole stacked tensor (``shard_id`` None), into ``param`` (this rank's columns)."""
        loaded = self.rank_part(param, loaded, shard_id)
        if shard_id is None:
            target = param.data
            loaded = self.local_stack(loaded)
        else:
            expert, kind = shard_id
            local = self.local_expert(expert)
            if local is None:
                return  # another rank's expert
            expert = local
            inter = self.intermediate_size
            if kind == "gate":
                target = param.data[expert, :inter]
            elif kind == "up":
                target = param.data[expert, inter:]
            elif kind == "down":
                target = param.data[expert]
            else:
                raise ValueError(f"expert shard must be 'gate', 'up' or 'down', got {kind!r}")
        if target.shape != loaded.shape:
            raise ValueError(
                f"expects shape {tuple(target.shape)}, checkpoint tensor has "
                f"{tuple(loaded.shape)}"
            )
        with torch.no_grad():
            target.copy_(loaded)

    def local_expert(self, expert: int) -> int | None:
        """Expert ``expert``'s index on this rank, or None where another rank holds it; a
        ValueError outside ``[0, num_experts)``."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert index must be in [0, {self.num_experts}), got {expert}")
        local = expert - self.first_expert
        return local if 0 <= local < self.local_experts else None

    def local_stack(self, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a whole stacked checkpoint tensor ``[E, ...]``."""
        if loaded.shape[0] != self.num_experts:
            raise ValueError(f"expects the whole stack of {self.num_experts} experts, got "
                             f"{tuple(loaded.shape)}")
        return loaded.narrow(0, self.first_expert, self.local_experts)

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """The stacked biases: ``w13_bias`` ``[E, 2I]`` (this rank's gate and up columns),
        ``w2_bias`` ``[E, H]`` (added once: on rank 0, zero on the others, since the ranks'
        outputs are summed)."""
        want = ((self.num_experts, 2 * self.full_intermediate_size) if param is self.w13_bias
                else (self.num_experts, self.hidden_size))
        if tuple(loaded.shape) != want:
            raise ValueError(f"expects the whole stacked bias {want}, got {tuple(loaded.shape)}")
        loaded = self.local_stack(loaded)
        if param is self.w2_bias:
            with torch.no_grad():
                param.data.copy_(loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
            return
        # this rank's gate and up columns, where its layout holds them (integer experts may
        # pad their rows to whole groups: int_quant_moe)
        full, mine, first = self.full_intermediate_size, self.rank_inter, self.pad_before
        start, inter = self.tp_rank * mine, self.intermediate_size
        with torch.no_grad():
            param.data.zero_()
            for half in (0, 1):
                param.data[:, half * inter + first : half * inter + first + mine] = \
                    loaded[:, half * full + start : half * full + start + mine]

    def epilogue(self) -> dict[str, Any]:
        """The biases and the activation, as :func:`~mrv2_kernels.fused_moe.fused_moe` takes
        them (every expert kind passes them on)."""
        return {"w13_bias": self.w13_bias, "w2_bias": self.w2_bias,
                "activation": self.activation, "swiglu_limit": self.swiglu_limit}

    def rank_part(self, param: nn.Parameter, loaded: torch.Tensor,
                  shard_id: tuple[int, str] | None) -> torch.Tensor:
        """This rank's intermediate slice of a whole checkpoint tensor: rows of a gate / up
        tensor ``[I, H]``, columns of a down tensor ``[H, I]``; of a stacked ``[E, 2I, H]``
        gate/up tensor, the slice of each half."""
        if self.tp_size == 1:
            return loaded
        full, mine = self.full_intermediate_size, self.intermediate_size
        start = self.tp_rank * mine
        down = param is self.w2_weight if shard_id is None else shard_id[1] == "down"
        dim = -1 if down else -2
        whole = full if down or shard_id is not None else 2 * full
        if loaded.dim() < 2 or loaded.shape[dim] != whole:
            raise ValueError(f"expects the whole checkpoint tensor, {whole} along dimension "
                             f"{dim}; got shape {tuple(loaded.shape)}")
        if down or shard_id is not None:
            return loaded.narrow(dim, start, mine)
        return torch.cat([loaded.narrow(-2, start, mine),
                          loaded.narrow(-2, full + start, mine)], dim=-2)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The sum of the ranks' partial outputs (unless :class:`MoEBlock` does it)."""
        return all_reduce(y) if self.reduce_output and self.world > 1 else y

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        valid = real_token_count(x.shape[0])  # a graph's padding rows: no expert read for them
        if self.expert_parallel:  # the others' pairs: this rank's first expert, weight 0
            ids = topk_ids - self.first_expert
            mine = (ids >= 0) & (ids < self.local_experts)
            topk_ids = torch.where(mine, ids, 0).to(topk_ids.dtype)
            topk_weights = torch.where(mine, topk_weights, 0.0)
            if self.count_reads:
                self._count(torch.where(mine, ids, self.local_experts), valid)
        elif self.count_reads:
            self._count(topk_ids, valid)
        return self.reduce(self._experts(x, topk_weights, topk_ids, valid))

    def _experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 valid: torch.Tensor | None) -> torch.Tensor:
        """The fused routed experts of this rank (rows from ``valid[0]`` on skipped)."""
        return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                         valid_tokens=valid, **self.epilogue())

    def _count(self, topk_ids: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add the number of distinct experts ``topk_ids`` selects (of its first ``valid[0]``
        rows) to ``expert_reads`` (device ops only, so it counts inside CUDA graph replays
        too)."""
        if self.expert_reads is None or self.expert_reads.device != topk_ids.device:
            self.expert_reads = torch.zeros((), dtype=torch.int64, device=topk_ids.device)
        ids = topk_ids.long()
        spare = self.local_experts  # (expert parallelism: the others' pairs point there too)
        if valid is not None:  # padding rows pick the spare slot
            rows = torch.arange(ids.shape[0], device=ids.device)[:, None]
            ids = torch.where(rows < valid, ids, spare)
        hits = torch.zeros(spare + 1, dtype=torch.int32, device=topk_ids.device)
        hits.scatter_(0, ids.reshape(-1), 1)
        self.expert_reads += hits[:spare].sum()

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights, biases and (a quantized subclass's) scales: what a
        step reads per distinct expert it routes to. Every parameter of this module is a
        stack of one row per local expert."""
        return int(sum(p[0].numel() * p.element_size()
                       for p in self.parameters(recurse=False)))

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}"
                + (", bias" if self.w13_bias is not None else "")
                + (f", {self.activation}" if self.activation != "silu" else "")
                + (f", experts {self.first_expert}-{self.first_expert + self.local_experts - 1}"
                   " here" if self.expert_parallel else ""))


class SoftmaxTopKRouter(nn.Module):
    """``softmax(x @ weight.T (+ bias))`` in fp32, the ``top_k`` largest, renormalized to sum
    1 when ``renormalize`` (the same as a softmax over the ``top_k`` largest logits: gpt-oss,
    with ``bias``). ``forward(x)`` returns ``(topk_weights fp32, topk_ids int32)`` ``[T, k]``,
    in descending order, equal probabilities to the lower expert first: after the linear layer,
    :func:`mrv2_kernels.moe_router.softmax_topk` (one kernel on the GPU)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 bias: bool = False) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.top_k = top_k
        self.renormalize = renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route(F.linear(x, self.weight, self.bias))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` after the linear layer: ``logits`` ``[..., num_experts]`` (rows may be
        strided: a slice of a wider product)."""
        lead = logits.shape[:-1]
        weights, ids = softmax_topk(logits.reshape(-1, logits.shape[-1]), self.top_k,
                                    self.renormalize)
        return weights.view(*lead, self.top_k), ids.view(*lead, self.top_k)

    def extra_repr(self) -> str:
        return f"experts={self.weight.shape[0]}, top_k={self.top_k}, renorm={self.renormalize}"


class GroupedTopKRouter(nn.Module):
    """Group-limited top-k over fp32 scores (DeepSeek-V3 "noaux_tc", GLM-4.x; see the module).

    Scores are ``sigmoid`` (or ``softmax``) of the fp32 router logits. The experts are split
    into ``n_group`` equal groups; a group's score is the sum of its two best corrected scores
    (with a correction bias), else its best score. Only the ``topk_group`` best groups compete
    for the ``top_k`` picks, made on ``score + e_score_correction_bias``. The weights are the
    picked experts' uncorrected scores, renormalized (plus 1e-20) when ``renormalize``, times
    ``routed_scaling_factor``. Returns ``(topk_weights fp32, topk_ids int32)`` (ties, of
    groups and of experts, to the lower index): after the linear layer,
    :func:`mrv2_kernels.moe_router.grouped_topk` (one kernel on the GPU).

    ``norm_min``: the renormalizing sum clamped at it instead of 1e-20 added (configs that name
    their own floor). ``fp32_weight``: the router's weight kept fp32 whatever the model dtype
    (as checkpoints that store it so are run), like the correction bias.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        n_group: int = 1,
        topk_group: int = 1,
        renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        scoring: str = "sigmoid",
        correction_bias: bool = True,
        norm_min: float | None = None,
        fp32_weight: bool = False,
    ) -> None:
        super().__init__()
        if scoring not in ("sigmoid", "softmax"):
            raise ValueError(f"scoring_func must be 'sigmoid' or 'softmax', got {scoring!r}")
        if n_group < 1 or num_experts % n_group:
            raise ValueError(f"n_group ({n_group}) must divide n_routed_experts ({num_experts})")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
        if not 1 <= top_k <= topk_group * (num_experts // n_group):
            raise ValueError(
                f"num_experts_per_tok must be in [1, {topk_group * (num_experts // n_group)}] "
                f"(topk_group x experts per group), got {top_k}"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.n_group = n_group
        self.topk_group = topk_group
        self.renormalize = renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.scoring = scoring
        self.norm_min = norm_min
        #: Parameters ``model.to(dtype)`` moves but never casts (fp32 as built).
        self._fp32 = ["e_score_correction_bias"] + (["weight"] if fp32_weight else [])
        self.weight = nn.Parameter(torch.empty(
            num_experts, hidden_size, dtype=torch.float32 if fp32_weight else None))
        self.e_score_correction_bias: nn.Parameter | None = None
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
            )

    def _apply(self, fn: Any, recurse: bool = True) -> GroupedTopKRouter:
        # ``model.to(dtype)`` (after loading) must only move the correction bias: it stays fp32,
        # as the checkpoints store it, since a bf16-rounded bias reorders near-tied experts
        # (and an fp32 router weight likewise).
        apply_moving_only(self, self._fp32,
                          lambda f: super(GroupedTopKRouter, self)._apply(f, recurse), fn)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        return grouped_topk(logits, self.top_k, n_group=self.n_group,
                            topk_group=self.topk_group, renormalize=self.renormalize,
                            routed_scaling_factor=self.routed_scaling_factor,
                            scoring=self.scoring, correction_bias=self.e_score_correction_bias,
                            norm_min=self.norm_min)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, groups={self.n_group}, "
                f"topk_group={self.topk_group}, scoring={self.scoring}, "
                f"scale={self.routed_scaling_factor}")


class MoEBlock(nn.Module):
    """``experts(x, *gate(x)) + shared_experts(x)``: a router named ``gate`` (checkpoints'
    ``mlp.gate``), the routed ``experts`` and optional ``shared_experts``. With tensor
    parallelism both halves produce partial sums and the block all-reduces once.

    ``shared_expert_gate=True`` scales the shared experts' output per token by
    ``sigmoid(shared_expert_gate(x))``, a ``[hidden] -> [1]`` projection replicated on every
    rank (Qwen2-MoE, Qwen3-Next; a scalar per token, so it scales the partial sums alike)."""

    def __init__(
        self, gate: nn.Module, experts: FusedMoE, shared_experts: GatedMLP | None = None,
        shared_expert_gate: bool = False,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts
        self.shared_expert_gate: nn.Linear | None = None
        if shared_expert_gate:
            if shared_experts is None:
                raise ValueError("shared_expert_gate needs shared_experts")
            self.shared_expert_gate = nn.Linear(experts.hidden_size, 1, bias=False)
        self.tp_size = experts.world
        experts.reduce_output = False
        if shared_experts is not None:
            shared_experts.down_proj.reduce_output = False
        #: The router's weight with the shared-expert gate's row after it (``[E + 1, H]``),
        #: made after loading: one product gives both on the GPU (a decode step's GEMV
        #: instead of the router's and the gate's cuBLAS calls). None: apart.
        self.router_and_gate: torch.Tensor | None = None

    def process_weights_after_loading(self) -> None:
        """With a shared-expert gate and a plain softmax router of the same dtype: stack
        their weights (:attr:`router_and_gate`); again after the weights change."""
        gate, shared_gate = self.gate, self.shared_expert_gate
        self.router_and_gate = None
        if (shared_gate is None or type(gate) is not SoftmaxTopKRouter or gate.bias is not None
                or gate.weight.dtype != shared_gate.weight.dtype
                or gate.weight.device != shared_gate.weight.device):
            return
        with torch.no_grad():
            self.router_and_gate = torch.cat([gate.weight, shared_gate.weight]).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stacked = self.router_and_gate
        shared_scale = None
        if stacked is not None:
            logits = decode_linear(x, stacked)
            experts = stacked.shape[0] - 1
            topk_weights, topk_ids = cast(SoftmaxTopKRouter, self.gate).route(
                logits[..., :experts])
            shared_scale = torch.sigmoid(logits[..., experts:])
        else:
            topk_weights, topk_ids = self.gate(x)
        out: torch.Tensor = self.experts(x, topk_weights, topk_ids)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                if shared_scale is None:
                    shared_scale = torch.sigmoid(self.shared_expert_gate(x))
                shared = shared_scale * shared
            out = out + shared
        return all_reduce(out) if self.tp_size > 1 else out


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` of a Qwen3-MoE-style config (Qwen3-MoE, Qwen3-VL-MoE) routes
    to experts: ``num_experts`` > 0, not in ``mlp_only_layers``, and ``(i + 1) %
    decoder_sparse_step == 0``; the others keep a dense MLP."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    only_mlp = getattr(config, "mlp_only_layers", None) or []
    return (layer_idx not in only_mlp and config.num_experts > 0
            and (layer_idx + 1) % step == 0)


def shared_expert_moe(config: Any, gate: nn.Module, shared_bias: bool = False) -> MoEBlock:
    """The DeepSeek-style MoE block (DeepSeek-V2/V3, GLM-4.x): ``gate``, ``n_routed_experts``
    routed experts of ``moe_intermediate_size`` and, when ``n_shared_experts``, one shared
    SwiGLU MLP of ``moe_intermediate_size * n_shared_experts`` that sees every token (its
    projections biased with ``shared_bias``: DeepSeek-V2's ``mlp_bias``)."""
    experts = FusedMoE(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
    shared = None
    if config.n_shared_experts:
        shared = GatedMLP(config.hidden_size,
                          config.moe_intermediate_size * config.n_shared_experts,
                          config.hidden_act, bias=shared_bias)
    return MoEBlock(gate, experts, shared)
