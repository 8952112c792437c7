"""The pieces every decoder-only family shares: its attention, its pre-norm layer, the layer
stack and the causal LM.

A family picks its attention options (:class:`SelfAttention`: biases, q/k norm, RoPE; or
:class:`ScaledQueryAttention`, queries scaled by position) and its MLP (a
:class:`~mrv2.layers.mlp.GatedMLP`, a non-gated :class:`~mrv2.layers.mlp.DenseMLP` or a
:class:`~mrv2.layers.moe.MoEBlock`) per layer, puts them in a :class:`DecoderLayer`
(``layer(positions, hidden_states, residual) -> (hidden_states, residual)``, the residual add
fused into the next norm) and builds :class:`DecoderModel` and :class:`CausalLM` around it;
the embedding, the final norm, the LM head (tied or not), the ``inputs_embeds`` path and the
checkpoint-name mapping are here once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, cast

import torch
from torch import nn

from mrv2.layers.attention import Attention, config_sliding_window
from mrv2.layers.embedding import LMHead, ScaledEmbedding, VocabEmbedding
from mrv2.layers.linear import QKVLinear, RowLinear, norm_linear
from mrv2.layers.mlp import DenseMLP, GatedMLP
from mrv2.layers.norm import LayerNorm, RMSNorm, ShardedRMSNorm
from mrv2.layers.rotary import RotaryEmbedding
from mrv2.layers.weights import StackedMapping, load_stacked_weights

#: HF's separate q/k/v and gate/up projections -> the fused ``qkv_proj`` / ``gate_up_proj``.
STACKED_PARAMS: StackedMapping = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
#: Only the attention's q/k/v fused: the mapping of a family whose MLPs' ``up_proj`` stands
#: alone (:class:`~mrv2.layers.mlp.DenseMLP`).
QKV_PARAMS: StackedMapping = STACKED_PARAMS[:3]


def sliding_window_of(config: Any, layer_idx: int) -> int | None:
    """The keys a query of layer ``layer_idx`` sees, as HF applies ``config.sliding_window``:
    none where ``use_sliding_window`` is false; else on the layers ``config.layer_types`` calls
    ``"sliding_attention"`` (Gemma 3, Qwen2 and SmolLM3 with ``use_sliding_window``), else on
    every layer (Mistral); None: all keys before it."""
    window = config_sliding_window(config)
    if window is None:
        return None  # (SmolLM3 lists sliding layer types it does not use unless told to)
    types = getattr(config, "layer_types", None)
    if types is not None:  # (a layer past the list, an MTP layer: full attention)
        sliding = layer_idx < len(types) and types[layer_idx] == "sliding_attention"
        return window if sliding else None
    return window


def head_dim_of(config: Any) -> int:
    """``config.head_dim``, or ``hidden_size // num_attention_heads`` when it is unset."""
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim or config.hidden_size // config.num_attention_heads)


class SelfAttention(nn.Module):
    """Fused QKV projection, optional per-head q/k RMSNorm, RoPE, paged attention over KV cache
    layer ``layer_idx``, output projection (HF's ``self_attn.*`` names).

    Heads from the config (``num_attention_heads``, ``num_key_value_heads`` or as many,
    :func:`head_dim_of`), split across tensor-parallel ranks by :class:`QKVLinear`;
    ``qkv_bias`` / ``o_bias`` put biases on the projections (Qwen3 and Llama: both per
    ``attention_bias``; GLM-4.x: q/k/v only), ``qk_norm`` adds Qwen3's per-head
    ``q_norm`` / ``k_norm`` (built with ``rms_norm_eps``), fused into the rotation;
    ``qk_norm="projection"``: norms over the whole query and key projections instead (OLMo 2,
    MiniMax-M2; :func:`projection_norms`), before the rotation.
    ``scale``: the scores' factor (default ``head_dim ** -0.5``); ``logit_softcap``: scores
    soft-capped (Gemma 2); ``sinks``: a learned attention-sink score per head, ``sinks``
    ``[num_heads]`` (gpt-oss; this rank's heads under tensor parallelism). Local layers
    attend over the config's sliding window (:func:`sliding_window_of`).
    """

    def __init__(
        self, config: Any, layer_idx: int, rope: RotaryEmbedding | None, *,
        qkv_bias: bool = False,
        o_bias: bool = False, qk_norm: bool | str = False, scale: float | None = None,
        logit_softcap: float | None = None, sinks: bool = False,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, num_heads, num_kv_heads, bias=qkv_bias
        )
        self.o_proj = RowLinear(num_heads * self.head_dim, config.hidden_size, bias=o_bias)
        self.q_norm: RMSNorm | ShardedRMSNorm | None = None
        self.k_norm: RMSNorm | ShardedRMSNorm | None = None
        if qk_norm not in (False, True, "projection"):
            raise ValueError(f"qk_norm must be False, True (per head) or 'projection', got "
                             f"{qk_norm!r}")
        self.projection_norm = qk_norm == "projection"
        if self.projection_norm:
            self.q_norm, self.k_norm = projection_norms(self.qkv_proj, config.rms_norm_eps)
        elif qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = rope
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.empty(self.qkv_proj.num_heads))
            self.sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]
        self.attn = Attention(  # this rank's heads
            self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, self.head_dim,
            self.head_dim**-0.5 if scale is None else scale, layer_idx,
            sliding_window=sliding_window_of(config, layer_idx), logit_softcap=logit_softcap,
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden_states))

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Everything after the QKV projection: q/k norms, RoPE, attention, output projection.
        RoPE runs inside the attention layer, where the backend can write the KV cache in the
        same kernel."""
        return cast(torch.Tensor, self.o_proj(self.attention_output(positions, qkv)))

    def attention_output(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """:meth:`attend` without the output projection: ``[T, this rank's heads *
        head_dim]``, for a family that changes it first (AFMoE's output gate)."""
        q, k, v = self.qkv_proj.split(qkv)
        norms = None
        if self.projection_norm and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.q_norm is not None and self.k_norm is not None and self.rotary_emb is None:
            # per-head norms with no rotation to fuse them into (a NoPE layer: EXAONE 4)
            d = self.head_dim
            q = cast(torch.Tensor, self.q_norm(q.reshape(-1, d))).reshape(q.shape)
            k = cast(torch.Tensor, self.k_norm(k.reshape(-1, d))).reshape(k.shape)
        elif self.q_norm is not None and self.k_norm is not None:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        return cast(torch.Tensor, self.attn(q, k, v, positions=positions,
                                            rotary=self.rotary_emb, qk_norm=norms,
                                            sinks=self.sinks))

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's heads of the checkpoint's ``sinks`` ``[num_attention_heads]``."""
        heads, rank, size = param.shape[0], self.qkv_proj.tp_rank, self.qkv_proj.tp_size
        if tuple(loaded.shape) != (heads * size,):
            raise ValueError(f"sinks must be [{heads * size}] (one per attention head), got "
                             f"{tuple(loaded.shape)}")
        with torch.no_grad():
            param.data.copy_(loaded.narrow(0, rank * heads, heads))


def llama4_query_scaling(config: Any, where: str = "config.json rope_parameters"
                         ) -> tuple[float, float]:
    """``(beta, original_max_position_embeddings)`` of ``config.rope_parameters`` (HF's
    ``llama_4_scaling_beta``: Ministral 3), for :class:`ScaledQueryAttention`; ValueError
    naming the fields (``where``: where they are read) if either is missing or not usable."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    beta, original = (params.get(k) for k in ("llama_4_scaling_beta",
                                              "original_max_position_embeddings"))
    if beta is None or original is None or not math.isfinite(float(beta)) \
            or float(original) <= 0:
        raise ValueError(f"{where}: Ministral 3 needs a finite llama_4_scaling_beta and a "
                         f"positive original_max_position_embeddings, got {beta!r} and "
                         f"{original!r}")
    return float(beta), float(original)


class ScaledQueryAttention(SelfAttention):
    """:class:`SelfAttention` with each query times ``1 + beta * log(1 + floor(p /
    original))`` (``p``: its position; ``scaling`` ``(beta, original)`` from
    :func:`llama4_query_scaling`), HF's ``get_llama_4_attn_scale`` of Ministral 3 (applied
    there after the rotation; the same per-token factor before it). No q/k norms."""

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding | None,
                 scaling: tuple[float, float], **kwargs: Any) -> None:
        super().__init__(config, layer_idx, rope, **kwargs)
        self.beta, self.original = scaling

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(qkv)
        scale = torch.log1p(torch.floor(positions.float() / self.original)) * self.beta + 1.0
        q = q * scale.to(q.dtype)[:, None]  # (HF: the factor rounded to the query's dtype)
        out = self.attn(q, k, v, positions=positions, rotary=self.rotary_emb)
        return cast(torch.Tensor, self.o_proj(out))


def projection_norms(qkv: QKVLinear, eps: float) -> tuple[ShardedRMSNorm, ShardedRMSNorm]:
    """RMSNorms over the whole query and key projections of ``qkv`` (all heads at once: OLMo 2,
    MiniMax-M2), each holding this rank's heads' slice of the checkpoint's weight; key heads
    replicated over ranks count once."""
    d, size = qkv.head_dim, qkv.tp_size
    q = ShardedRMSNorm(qkv.num_heads * size * d, eps, qkv.tp_rank * qkv.num_heads * d,
                       qkv.num_heads * d)
    total = qkv.total_kv_heads
    k = ShardedRMSNorm(total * d, eps, qkv.first_kv_head * d, qkv.num_kv_heads * d,
                       replicas=max(1, size * qkv.num_kv_heads // total))
    return q, k


#: Builds one of a decoder's norms (each call a new module): what :class:`DecoderLayer` and
#: :class:`DecoderModel` take for LayerNorm families (``lambda: LayerNorm(hidden, eps)``).
NormFactory = Callable[[], RMSNorm | LayerNorm]


def rms_norm_of(config: Any) -> NormFactory:
    """The default norm factory: an RMSNorm of ``config.hidden_size`` and ``rms_norm_eps``."""
    return lambda: RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


def norm_mlp(
    norm: RMSNorm | LayerNorm, mlp: nn.Module, x: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The second half of a pre-norm block: ``mlp(norm(x + residual))`` and the new residual.

    A SwiGLU :class:`~mrv2.layers.mlp.GatedMLP` runs its gate/up projection fused with the
    norm (:func:`~mrv2.layers.linear.norm_linear`), a :class:`~mrv2.layers.mlp.DenseMLP` its
    up projection; any other MLP (a MoE block) after the norm.
    """
    if isinstance(mlp, GatedMLP) and mlp.hidden_act == "silu":
        act, residual = norm_linear(norm, mlp.gate_up_proj, x, residual, silu_and_mul=True)
        return mlp.down_proj(act), residual
    if isinstance(mlp, DenseMLP):
        up, residual = norm_linear(norm, mlp.up_proj, x, residual)
        return mlp.down_proj(mlp.act_fn(up)), residual
    if residual is None:
        return mlp(norm(x)), x
    normed, residual = norm(x, residual)
    return mlp(normed), residual


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer: ``input_layernorm``, ``self_attn`` (a :class:`SelfAttention`),
    ``post_attention_layernorm``, ``mlp`` (HF's names). Each norm runs fused with the
    projection after it where it can (:func:`~mrv2.layers.linear.norm_linear`,
    :func:`norm_mlp`): one launch per decode step instead of three. ``norm``: what builds both
    norms (default: the config's RMSNorm; a LayerNorm family passes its own)."""

    def __init__(self, config: Any, self_attn: SelfAttention, mlp: nn.Module,
                 norm: NormFactory | None = None) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        make = norm or rms_norm_of(config)
        self.input_layernorm: RMSNorm | LayerNorm = make()
        self.post_attention_layernorm: RMSNorm | LayerNorm = make()

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm_linear(
            self.input_layernorm, self.self_attn.qkv_proj, hidden_states, residual
        )
        hidden_states = self.self_attn.attend(positions, qkv)
        return norm_mlp(self.post_attention_layernorm, self.mlp, hidden_states, residual)


class ParallelDecoderLayer(nn.Module):
    """A parallel block (GPT-J, GPT-NeoX's ``use_parallel_residual``, StableLM's, phi-1/2's,
    Cohere's): attention and MLP side by side off one stream ``x = hidden + residual``, HF's
    names ``input_layernorm``, ``self_attn``, ``mlp`` and, with ``mlp_norm``,
    ``post_attention_layernorm``. It computes ``x + attn(ln1(x)) + mlp(n)`` where ``n`` is
    ``ln1(x)``, or ``post_attention_layernorm(x)`` with ``mlp_norm`` (GPT-NeoX: the MLP's
    own norm of the same stream).

    ``forward(positions, hidden, residual)`` returns ``(hidden, residual)`` whose sum (taken
    by the next layer's norm kernel, or the final norm's) is the block's output, summed in the
    checkpoint family's order so the rounding matches: ``residual_last`` gives ``(attn + mlp)
    + x`` (GPT-NeoX, GPT-J, phi), otherwise ``(x + attn) + mlp`` (StableLM, Cohere). The
    first residual add runs inside ``input_layernorm``'s kernel, which may write the sum into
    the residual's storage: the residual handed in is not read again.
    """

    def __init__(self, self_attn: SelfAttention, mlp: nn.Module, norm: NormFactory, *,
                 residual_last: bool, mlp_norm: bool = False) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm: RMSNorm | LayerNorm = norm()
        self.post_attention_layernorm: RMSNorm | LayerNorm | None = norm() if mlp_norm else None
        self.residual_last = residual_last

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, normed = hidden_states, cast(torch.Tensor, self.input_layernorm(hidden_states))
        else:
            normed, x = cast(tuple[torch.Tensor, torch.Tensor],
                             self.input_layernorm(hidden_states, residual))
        attn = cast(torch.Tensor, self.self_attn(positions, normed))
        post = self.post_attention_layernorm
        mlp = cast(torch.Tensor, self.mlp(normed if post is None else post(x)))
        return (attn + mlp, x) if self.residual_last else (x + attn, mlp)

    def extra_repr(self) -> str:
        return f"residual_last={self.residual_last}"


class PostNormDecoderLayer(nn.Module):
    """A post-norm decoder layer (OLMo 2, EXAONE 4): attention and MLP each followed by its
    norm (``post_attention_layernorm``, ``post_feedforward_layernorm``), then the residual add;
    no pre-norms. The residual stream is passed on summed (``(hidden, residual)``, as the
    pre-norm layers pass theirs)."""

    def __init__(self, config: Any, self_attn: SelfAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = hidden_states if residual is None else hidden_states + residual
        x = x + cast(torch.Tensor, self.post_attention_layernorm(self.self_attn(positions, x)))
        return cast(torch.Tensor, self.post_feedforward_layernorm(self.mlp(x))), x


class DecoderModel(nn.Module):
    """``embed_tokens``, ``layers`` (``make_layer(i)`` for each of ``num_layers``, default
    ``config.num_hidden_layers``) and the final ``norm``: HF's ``model.*`` names.

    :meth:`keep_aux_hidden_states` makes every forward also copy the residual stream at the
    input of chosen layers into a persistent buffer (Eagle3 drafts from them); off by default.
    """

    def __init__(
        self, config: Any, make_layer: Callable[[int], nn.Module], num_layers: int | None = None,
        norm: NormFactory | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        count = config.num_hidden_layers if num_layers is None else num_layers
        self.layers = nn.ModuleList(make_layer(i) for i in range(count))
        self.norm: RMSNorm | LayerNorm = (norm or rms_norm_of(config))()
        self.hidden_size = int(config.hidden_size)
        #: ``[max_num_tokens, len(ids) * hidden]``, set by :meth:`keep_aux_hidden_states`.
        self.aux_hidden_states: torch.Tensor | None = None
        self._aux_slots: dict[int, list[int]] = {}

    def keep_aux_hidden_states(self, layer_ids: Sequence[int], max_num_tokens: int
                               ) -> torch.Tensor:
        """From now on, every forward copies the residual stream at the *input* of each layer
        of ``layer_ids`` (``hidden_states + residual`` there; the embeddings for layer 0) into
        its column slice of one persistent buffer ``[max_num_tokens, len(layer_ids) *
        hidden]``, slice ``j`` for ``layer_ids[j]``, which is returned (and kept as
        :attr:`aux_hidden_states`). Allocated once, so a CUDA graph captured afterwards writes
        into the same memory at every replay. Ids out of ``0 .. num_layers - 1`` are a
        ``ValueError``."""
        ids = [int(i) for i in layer_ids]
        bad = [i for i in ids if not 0 <= i < len(self.layers)]
        if not ids or bad:
            raise ValueError(
                f"aux hidden state layer ids {ids} must be in 0..{len(self.layers) - 1} (the "
                f"model has {len(self.layers)} layers)"
            )
        weight = self.embed_tokens.weight
        self.aux_hidden_states = torch.empty(max_num_tokens, len(ids) * self.hidden_size,
                                             dtype=weight.dtype, device=weight.device)
        self._aux_slots = {}
        for slot, layer in enumerate(ids):
            self._aux_slots.setdefault(layer, []).append(slot)
        return self.aux_hidden_states

    def _keep(self, layer: int, hidden_states: torch.Tensor, residual: torch.Tensor | None
              ) -> None:
        aux = self.aux_hidden_states
        assert aux is not None
        num_tokens, width = hidden_states.shape[0], self.hidden_size
        if num_tokens > aux.shape[0]:
            raise ValueError(f"a forward of {num_tokens} tokens exceeds the aux hidden state "
                             f"buffer's {aux.shape[0]} rows")
        for slot in self._aux_slots[layer]:
            out = aux[:num_tokens, slot * width:(slot + 1) * width]
            if residual is None:
                out.copy_(hidden_states)
            else:
                torch.add(hidden_states, residual, out=out)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        if self.aux_hidden_states is None:
            for layer in self.layers:
                hidden_states, residual = layer(positions, hidden_states, residual)
        else:
            for i, layer in enumerate(self.layers):
                if i in self._aux_slots:
                    self._keep(i, hidden_states, residual)
                hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class CausalLM(nn.Module):
    """A :class:`DecoderModel` plus the LM head, in the mrv2 model contract (flat token batch,
    paged attention). Subclasses set ``stacked_params`` and extend :meth:`rename` for their
    checkpoints' names."""

    stacked_params: ClassVar[StackedMapping] = STACKED_PARAMS
    #: Attributes holding submodules that run only on media items (a vision-language model's
    #: vision / audio towers and projectors), never in a text step: the byte floor
    #: (:func:`mrv2.bench.measure.weight_bytes`) leaves their parameters out.
    media_encoders: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any, model: DecoderModel) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = model
        tied_to = model.embed_tokens if self.tie_word_embeddings else None
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, tied_to=tied_to)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids``, ``positions`` ``[T]`` -> final hidden states ``[T, hidden_size]``
        (``inputs_embeds`` ``[T, hidden_size]``, when given, replaces the token embeddings)."""
        return cast(torch.Tensor, self.model(input_ids, positions, inputs_embeds))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, hidden_size]`` input embeddings."""
        return cast(torch.Tensor, self.model.embed_tokens(input_ids))

    @property
    def prompt_embeds_scale(self) -> float:
        """What prompts given as embeddings are multiplied by as they arrive, as the family's
        HF model multiplies its ``inputs_embeds`` (a :class:`ScaledEmbedding` whose
        ``scales_given`` is set: Granite's ``embedding_multiplier``); 1 otherwise."""
        embed = getattr(self.model, "embed_tokens", None)
        return embed.scale if isinstance(embed, ScaledEmbedding) and embed.scales_given else 1.0

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> ``[N, vocab_size]`` in the model dtype."""
        return cast(torch.Tensor, self.lm_head(hidden_states))

    def keep_aux_hidden_states(self, layer_ids: Sequence[int], max_num_tokens: int
                               ) -> torch.Tensor:
        """Keep the residual stream at the input of ``layer_ids`` in a persistent buffer
        (:meth:`DecoderModel.keep_aux_hidden_states`); returns it."""
        return self.model.keep_aux_hidden_states(layer_ids, max_num_tokens)

    @property
    def aux_hidden_states(self) -> torch.Tensor | None:
        """The buffer of :meth:`keep_aux_hidden_states` (its first rows are the last forward's
        tokens), or None when nothing is kept."""
        return self.model.aux_hidden_states

    def rename(self, name: str) -> str | None:
        """A checkpoint tensor's parameter name, or None to skip it (RoPE caches; a tied
        checkpoint's ``lm_head.weight`` fills the embedding). A decoder saved without its
        ``model.`` prefix (``layers.*``, ``embed_tokens.*``, ``norm.*``: Qwen3-Embedding's
        checkpoints) loads as if it had it."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name.startswith(("layers.", "embed_tokens.", "norm.")):
            name = "model." + name
        if self.tie_word_embeddings and name == "lm_head.weight":
            return "model.embed_tokens.weight"
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF checkpoint tensors; returns the parameter names loaded. With tied
        embeddings a checkpoint's LM head fills the embedding only where the checkpoint has no
        embedding of its own (vLLM skips it then too), whichever file holds which."""
        if not self.tie_word_embeddings:
            return load_stacked_weights(self, weights, self.stacked_params, self.rename)
        embed = "model.embed_tokens.weight"
        heads: list[tuple[str, torch.Tensor]] = []

        def without_head() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if "lm_head" in name and self.rename(name) == embed:
                    heads.append((name, tensor))
                else:
                    yield name, tensor

        loaded = load_stacked_weights(self, without_head(), self.stacked_params, self.rename)
        if heads and embed not in loaded:
            loaded |= load_stacked_weights(self, heads[-1:], self.stacked_params, self.rename)
        return loaded
