"""Rotary position embedding (neox style: the two halves of the rotary dims are rotated together).

Supported HF rope types: ``default``, ``linear``, ``llama3``, ``yarn`` (with DeepSeek's
``mscale`` / ``mscale_all_dim`` attention factor, which scales the cos/sin table) and
``longrope`` (Phi-3.5 / Phi-4-mini: ``short_factor`` frequencies for positions below
``original_max_position_embeddings``, ``long_factor`` ones from there, as vLLM does; HF switches
every position of a sequence to the long factors once it outgrows the original length, so the
two differ only past it; the rows scaled by the config's ``short_mscale`` / ``long_mscale``
where it has them, Phi-3.5-MoE's), ``proportional`` (Gemma 4's global layers: the whole head is
rotated, but only its first ``int(partial_rotary_factor * head_dim // 2)`` frequencies are
RoPE's, exponents over the whole ``head_dim``; the other pairs get frequency 0 and stay as they
are, which pairs dimensions differently from a partial ``rotary_dim``), ``dynamic`` with an
``alpha`` (Hunyuan's NTK-alpha RoPE: a fixed base ``rope_theta * alpha ** (d / (d - 2))`` over
the ``d`` rotated dimensions, as transformers' HunYuan models and vLLM compute it; plain dynamic
NTK, without ``alpha``, rescales with the sequence length and is refused). The parameters come
either from a transformers 5 ``rope_parameters`` dict (holding ``rope_theta`` too) or from the
older ``rope_theta`` + ``rope_scaling`` pair; :func:`rope_parameters_of` reads both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from mrv2_kernels.rotary import KVWrite, QKNorm, rotary_embedding

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional",
                        "dynamic (with alpha)")


def rope_parameters_of(config: Any) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling)`` of an HF config; ``scaling`` is None for plain RoPE."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, Mapping) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling: Mapping[str, Any] | None = params
    else:
        theta = float(getattr(config, "rope_theta", None) or 10000.0)
        scaling = getattr(config, "rope_scaling", None)
    if not scaling or _rope_type(scaling) == "default":
        return theta, None
    return theta, dict(scaling)


def _rope_type(scaling: Mapping[str, Any]) -> str:
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def _inv_freq(
    rotary_dim: int,
    base: float,
    scaling: Mapping[str, Any] | None,
    device: torch.device | None = None,
) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim
    rope_type = "default" if scaling is None else _rope_type(scaling)
    if rope_type == "dynamic":
        assert scaling is not None
        base = _ntk_alpha_base(rotary_dim, base, scaling)
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "dynamic":
        return inv_freq.float()
    if rope_type == "default":
        return inv_freq.float()
    assert scaling is not None
    if rope_type == "longrope":  # (the short factors; the table takes the long ones too)
        return _longrope_inv_freq(inv_freq, scaling, "short_factor")
    if rope_type == "proportional":
        return _proportional_inv_freq(inv_freq, rotary_dim, scaling)
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return (inv_freq / factor).float()
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, factor, scaling).float()
    if rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, rotary_dim, base, factor, scaling).float()
    raise NotImplementedError(
        f"rope type {rope_type!r} is not supported; supported types: {SUPPORTED_ROPE_TYPES}"
    )


def _ntk_alpha_base(rotary_dim: int, base: float, scaling: Mapping[str, Any]) -> float:
    """NTK-alpha RoPE (Hunyuan's ``rope_type: dynamic`` with ``alpha``): a larger base,
    ``base * alpha ** (rotary_dim / (rotary_dim - 2))``, for every position (HF's HunYuan
    rotary embedding and vLLM's ``DynamicNTKAlphaRotaryEmbedding``). Plain dynamic NTK (no
    ``alpha``: the base grows with each sequence's length) is a ``NotImplementedError``."""
    alpha = scaling.get("alpha")
    if alpha is None:
        raise NotImplementedError(
            f"rope type 'dynamic' without alpha (dynamic NTK scaling by sequence length) is "
            f"not supported; supported types: {SUPPORTED_ROPE_TYPES}; got {dict(scaling)}")
    if float(alpha) <= 0 or rotary_dim <= 2:
        raise ValueError(f"rope_parameters.alpha must be > 0 (got {alpha}) over more than 2 "
                         f"rotary dims (got {rotary_dim})")
    return float(base) * float(alpha) ** (rotary_dim / (rotary_dim - 2))


def _longrope_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any], which: str
                       ) -> torch.Tensor:
    """LongRoPE: each frequency divided by its ``short_factor`` / ``long_factor`` entry."""
    factors = scaling.get(which)
    if factors is None or len(factors) != inv_freq.shape[0]:
        raise ValueError(f"rope_parameters.{which} must list {inv_freq.shape[0]} factors (one "
                         f"per rotary frequency), got {factors!r}")
    ext = torch.tensor(factors, dtype=torch.float64, device=inv_freq.device)
    return (inv_freq / ext).float()


def _proportional_inv_freq(inv_freq: torch.Tensor, head_dim: int, scaling: Mapping[str, Any]
                           ) -> torch.Tensor:
    """Proportional RoPE (Gemma 4): of the ``head_dim / 2`` frequencies of a whole head, the
    first ``int(partial_rotary_factor * head_dim // 2)`` kept (their exponents over the whole
    ``head_dim``), the rest 0, all divided by ``factor`` (default 1), as transformers'
    ``_compute_proportional_rope_parameters``."""
    rotated = int(float(scaling.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    kept = torch.arange(inv_freq.shape[0], device=inv_freq.device) < rotated
    return (torch.where(kept, inv_freq, 0.0) / float(scaling.get("factor", 1.0))).float()


def _llama3_inv_freq(
    inv_freq: torch.Tensor, factor: float, scaling: Mapping[str, Any]
) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by ``factor``, a smooth blend in between."""
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # 0 at the long-wavelength end of the blend band, 1 at its short-wavelength end.
    smooth = ((original_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_factor(scaling: Mapping[str, Any], max_position: int) -> float:
    factor = scaling.get("factor")
    if factor is None:  # DeepSeek-V3 style: the ratio of the context lengths
        if "original_max_position_embeddings" not in scaling:
            raise ValueError("rope_parameters: rope_type 'yarn' needs factor or "
                             f"original_max_position_embeddings, got {dict(scaling)}")
        return max_position / float(scaling["original_max_position_embeddings"])
    return float(factor)


def _yarn_inv_freq(inv_freq: torch.Tensor, rotary_dim: int, base: float, factor: float,
                   scaling: Mapping[str, Any]) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dimensions that rotate fewer than ``beta_slow`` times over the
    original context are interpolated (divided by ``factor``), those rotating more than
    ``beta_fast`` times kept, a linear ramp between."""
    if "original_max_position_embeddings" not in scaling:
        raise ValueError("rope_parameters.original_max_position_embeddings is required for "
                         f"rope_type 'yarn', got {dict(scaling)}")
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    original = float(scaling["original_max_position_embeddings"])

    def dim_of(rotations: float) -> float:  # the dim that rotates ``rotations`` times
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64, device=inv_freq.device) - low)
            / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def attention_factor_of(scaling: Mapping[str, Any] | None, max_position: int) -> float:
    """The factor a rope type multiplies cos and sin by (1 but for YaRN: its
    ``attention_factor``, else from ``factor`` with DeepSeek's ``mscale`` /
    ``mscale_all_dim``)."""
    if scaling is not None and _rope_type(scaling) == "longrope":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        original = float(scaling["original_max_position_embeddings"])
        factor = float(scaling.get("factor") or max_position / original)
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if scaling is None or _rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling, max_position)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
    return _yarn_mscale(factor)


def longrope_mscales(scaling: Mapping[str, Any], attention_factor: float
                     ) -> tuple[float, float]:
    """The factors LongRoPE's cos/sin rows are multiplied by: ``(short, long)``, for the rows
    below ``original_max_position_embeddings`` and from there on. A config's own
    ``short_mscale`` / ``long_mscale`` (Phi-3.5-MoE's, which HF's PhiMoE and vLLM apply), else
    ``attention_factor`` for both."""
    short, long = scaling.get("short_mscale"), scaling.get("long_mscale")
    return (attention_factor if short is None else float(short),
            attention_factor if long is None else float(long))


#: Rope types whose config already states the scaled length in ``max_position_embeddings``
#: (vLLM's rule; ``su`` is longrope's old name, ``mrope`` Qwen-VL's unscaled M-RoPE).
_LENGTH_STATED = ("llama3", "longrope", "su", "mrope")


def rope_scaled_length(config: Any) -> int | None:
    """The context length an HF text config's RoPE scaling gives, as vLLM derives it
    (``_get_and_verify_max_len``): YaRN's ``original_max_position_embeddings * factor``
    (``max_position_embeddings`` where the original is not given), other types
    ``max_position_embeddings * factor`` (``factor`` 1 where absent); None where there is no
    scaling, no ``max_position_embeddings``, or a type whose config states its length
    (:data:`_LENGTH_STATED`). Per-layer-type ``rope_parameters`` (Gemma 3 / 4 in
    transformers 5, whose ``max_position_embeddings`` is already the scaled length: vLLM
    skips Gemma 3's too) count as no scaling."""
    limit = getattr(config, "max_position_embeddings", None)
    _, scaling = rope_parameters_of(config)
    if scaling is None or limit is None or _rope_type(scaling) in _LENGTH_STATED:
        return None
    if _rope_type(scaling) == "yarn":  # (factor: DeepSeek's ratio of the lengths if absent)
        factor = _yarn_factor(scaling, int(limit))
        original = scaling.get("original_max_position_embeddings") or limit
        return int(float(original) * factor)
    return int(int(limit) * float(scaling.get("factor") or 1.0))


def context_limit(config: Any) -> tuple[int | None, str]:
    """``(longest context, why)`` of an HF text config: ``max_position_embeddings``, or the
    longer :func:`rope_scaled_length` of its RoPE scaling (never below
    ``max_position_embeddings``, which positions always reach); None where the config has
    no ``max_position_embeddings``. The engine's ``max_model_len`` may not pass it, and
    rotary tables are built to reach it (:func:`get_rope`). ``why`` names its source, by the
    config's own field name (``n_positions`` where the config class maps it so: GPT-2,
    GPTBigCode)."""
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None:
        return None, "config.json has no max_position_embeddings"
    # (the config's own name for it: GPT-2-style configs map it to n_positions)
    field = getattr(type(config), "attribute_map", {}).get("max_position_embeddings",
                                                            "max_position_embeddings")
    why = f"the model's {field}={limit}"
    scaled = rope_scaled_length(config)
    if scaled is None or scaled <= int(limit):
        return int(limit), why
    _, scaling = rope_parameters_of(config)
    assert scaling is not None
    if _rope_type(scaling) == "yarn" and scaling.get("original_max_position_embeddings"):
        base = f"original_max_position_embeddings={scaling['original_max_position_embeddings']}"
    else:
        base = f"max_position_embeddings={limit}"
    return scaled, (f"the limit {scaled} its rope scaling derives ({why}; rope_type "
                    f"{_rope_type(scaling)!r}: {base} * factor={scaling.get('factor')})")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key at given absolute positions.

    The cos/sin table (fp32, ``positions`` rows: ``max_position`` by default) is built on
    first use, on the positions' device; one instance can be shared by every layer of a
    model. ``max_position`` is the model's ``max_position_embeddings``, which some scaling
    math reads (YaRN without ``factor``, LongRoPE's attention factor); ``positions`` only
    sizes the table (the longest context: RoPE scaling may reach past
    ``max_position_embeddings``), its rows the same whatever their number.

    :attr:`reverse` (set before first use): rotate by minus each angle, the table's sines
    negated (NanoChat's ``rotate_half``, whose signs are flipped against Llama's).
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float = 10000.0,
        scaling: Mapping[str, Any] | None = None,
        rotary_dim: int | None = None,
        positions: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if self.rotary_dim % 2 or self.rotary_dim > head_dim:
            raise ValueError(
                f"rotary_dim must be even and at most head_dim ({head_dim}), got {self.rotary_dim}"
            )
        self.max_position = max_position
        #: The table's rows: the positions it reaches.
        self.positions = max_position if positions is None else positions
        self.base = base
        self.scaling = dict(scaling) if scaling else None
        if self.scaling is not None and _rope_type(self.scaling) == "yarn":
            self.scaling["factor"] = _yarn_factor(self.scaling, max_position)
        self.attention_factor = attention_factor_of(self.scaling, max_position)
        _inv_freq(self.rotary_dim, base, self.scaling)  # fail on an unsupported type right away
        self._cos_sin: torch.Tensor | None = None
        self.reverse = False

    def _table(self, device: torch.device) -> torch.Tensor:
        if self._cos_sin is None or self._cos_sin.device != device:
            inv_freq = _inv_freq(self.rotary_dim, self.base, self.scaling, device)
            positions = torch.arange(self.positions, dtype=torch.float32, device=device)
            freqs = torch.outer(positions, inv_freq)
            if self.scaling is not None and _rope_type(self.scaling) == "longrope":
                original = int(self.scaling["original_max_position_embeddings"])
                plain = _inv_freq(self.rotary_dim, self.base, None, device).double()
                long_freq = _longrope_inv_freq(plain, self.scaling, "long_factor")
                freqs[original:] = torch.outer(positions[original:], long_freq)
                short_scale, long_scale = longrope_mscales(self.scaling, self.attention_factor)
                table = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
                table[:original] *= short_scale
                table[original:] *= long_scale
                self._cos_sin = table
            else:
                self._cos_sin = (torch.cat([freqs.cos(), freqs.sin()], dim=-1)
                                 * self.attention_factor)
            if self.reverse:
                self._cos_sin[:, self.rotary_dim // 2:].neg_()
        return self._cos_sin

    def whole_head_table(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The cos/sin table when :meth:`forward` is the plain rotation of whole heads at
        ``positions`` ``[T]`` (so an attention kernel may apply it instead), else None: a
        partial ``rotary_dim``, or a subclass with its own ``forward`` (M-RoPE)."""
        if (self.rotary_dim != self.head_dim or positions.dim() != 1
                or type(self).forward is not RotaryEmbedding.forward):
            return None
        return self._table(positions.device)

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        qk_norm: QKNorm | None = None,
        kv_write: KVWrite | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query`` ``[T, H*D]`` (or ``[T, H, D]``) and ``key`` at ``positions`` ``[T]``.

        ``qk_norm`` ``(q_weight, k_weight, eps)`` RMS-normalizes each head first (Qwen3's
        q_norm / k_norm). One kernel for all of it
        (:func:`mrv2_kernels.rotary.rotary_embedding`) on the Triton path, which works in
        place: use the returned tensors. ``kv_write`` ``(value, kv_cache, slot_mapping)`` also
        stores the rotated key and ``value`` in the paged KV cache (in the same launch where
        the kernel can).
        """
        return rotary_embedding(
            positions, query, key, self._table(positions.device), self.head_dim, self.rotary_dim,
            qk_norm, kv_write,
        )

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
            f"max_position={self.max_position}, positions={self.positions}, base={self.base}, "
            f"scaling={self.scaling}" + (", reverse" if self.reverse else "")
        )


def get_rope(config: Any, head_dim: int, layer_type: str | None = None,
             theta: float | None = None) -> RotaryEmbedding:
    """The RoPE of an HF decoder config (``partial_rotary_factor`` honoured: the rotated
    dimensions, or with ``proportional`` RoPE the frequencies kept over the whole head); its
    table reaches :func:`context_limit`, past ``max_position_embeddings`` where RoPE scaling
    extends the context.

    ``layer_type`` (``"sliding_attention"``, ``"full_attention"``): the RoPE of that kind of
    layer, where transformers 5 keeps one ``rope_parameters`` entry per layer type (OLMo 3:
    YaRN on the full-attention layers only); a config with one flat ``rope_parameters`` gives
    every layer type the same. ``theta``: the base in place of the config's ``rope_theta``
    (a per-layer base: Granite SWA's ``layer_rope_theta``), its scaling kept."""
    params = getattr(config, "rope_parameters", None) or {}
    per_type = params.get(layer_type) if layer_type is not None else None
    if isinstance(per_type, Mapping):
        params = per_type
        if "rope_theta" not in params:
            raise ValueError(f"config.json rope_parameters[{layer_type!r}] has no rope_theta")
        base = float(params["rope_theta"])
        scaling = None if _rope_type(params) == "default" else dict(params)
    else:
        base, scaling = rope_parameters_of(config)
    partial = float(
        params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    )
    if scaling is not None and _rope_type(scaling) == "proportional":
        partial = 1.0  # (the factor picks frequencies: _proportional_inv_freq)
    if theta is not None:
        base = float(theta)
    return RotaryEmbedding(
        head_dim,
        max_position=int(config.max_position_embeddings),
        base=base,
        scaling=scaling,
        rotary_dim=int(head_dim * partial),
        positions=context_limit(config)[0],
    )


def layer_ropes(config: Any, head_dim: int, thetas: Sequence[float | None] | None
                ) -> list[RotaryEmbedding | None]:
    """One RoPE per layer from a base per layer (``thetas``, one per ``num_hidden_layers``;
    0: that layer rotates nothing, NoPE), layers of one base sharing one table; ``thetas``
    None: every layer :func:`get_rope`'s. ValueError where the list's length is wrong."""
    count = int(config.num_hidden_layers)
    if thetas is None:
        rope = get_rope(config, head_dim)
        return [rope] * count
    if len(thetas) != count:
        raise ValueError(f"config.json: a RoPE base per layer must list {count} values (one a "
                         f"layer), got {len(thetas)}")
    tables = {float(t): get_rope(config, head_dim, theta=float(t)) for t in set(thetas) if t}
    return [tables[float(t)] if t else None for t in thetas]


def rope_rows_to_halves(rows: torch.Tensor, head_dim: int, rope_dim: int | None = None
                        ) -> torch.Tensor:
    """Checkpoints of interleaved RoPE (GPT-J's pairs ``(x0, x1), (x2, x3), ...``: DeepSeek,
    ERNIE) run by this module's half-split one: ``rows`` ``[heads * head_dim, ...]`` (a q or
    k projection's output rows, or a tensor indexed by them: bias, per-row scales, a LoRA
    ``B``), each head's last ``rope_dim`` rows (all of them by default) reordered in place from
    the pairs to halves (even rows, then odd). q and k reordered alike keep their scores.
    ``rows`` must be contiguous (fp8: viewed as bytes by the caller). Returns ``rows``."""
    rope_dim = head_dim if rope_dim is None else rope_dim
    order = torch.cat([torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)])
    heads = rows.view(-1, head_dim, *rows.shape[1:])[:, head_dim - rope_dim:]
    heads.copy_(heads[:, order.to(rows.device)])
    return rows


#: fp8 element types: their rows are moved as bytes.
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def rope_heads_to_halves(rows: torch.Tensor, head_dim: int, rotary_dim: int | None = None,
                         leading: bool = False) -> torch.Tensor:
    """:func:`rope_rows_to_halves` as a new tensor: ``rows`` ``[heads * head_dim, ...]`` may
    be a read-only view of a checkpoint, fp8 (moved as bytes) or not contiguous. Each head's
    ``rotary_dim`` rows (all by default) are reordered: its last ones (DeepSeek's layout), or
    with ``leading`` its first ones (GLM's partial rotary). ValueError unless ``rows`` holds
    whole heads of an even rotary part."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if rows.dim() == 0 or rows.shape[0] % head_dim or rotary_dim % 2:
        raise ValueError(f"expects whole heads of {head_dim} rows ({rotary_dim} rotated, an "
                         f"even count), got shape {tuple(rows.shape)}")
    raw = rows.view(torch.uint8) if rows.dtype in _FP8 else rows
    out = raw.clone(memory_format=torch.contiguous_format)
    if leading and rotary_dim < head_dim:
        per_head = out.view(-1, head_dim, *out.shape[1:])
        rotated = per_head[:, :rotary_dim].contiguous()
        rope_rows_to_halves(rotated.view(-1, *out.shape[1:]), rotary_dim)
        per_head[:, :rotary_dim] = rotated
    else:
        rope_rows_to_halves(out, head_dim, rotary_dim)
    return out.view(rows.dtype) if rows.dtype in _FP8 else out


def qk_rows_to_halves(qkv: Any, rows: torch.Tensor, rotary_dim: int | None = None,
                      leading: bool = False) -> torch.Tensor:
    """``rows`` ``[q + 2 kv, ...]``, indexed as this rank's output of ``qkv`` (a
    :class:`~mrv2.layers.linear.QKVLinear`), with its q and k heads' rotary rows in the halves
    order (:func:`rope_heads_to_halves`), in place; v untouched. What a fused projection's
    ``row_order`` is for an interleaved-RoPE family (a LoRA adapter's ``B``: the weight's rows
    are reordered as they load). Returns ``rows``."""
    for start, size in ((0, qkv.q_size), (qkv.q_size, qkv.kv_size)):
        part = rows[start:start + size]
        part.copy_(rope_heads_to_halves(part, qkv.head_dim, rotary_dim, leading))
    return rows


def qk_tensor_to_halves(name: str, what: str, t: torch.Tensor, rows: int, head_dim: int,
                        family: str, *, rotary_dim: int | None = None, leading: bool = False
                        ) -> torch.Tensor:
    """A q or k projection's checkpoint tensor (``name``; ``what``: its last part, ``weight``,
    ``bias``, ``weight_scale``...) of a family whose RoPE rotates interleaved pairs, with each
    head's rows in the halves order (:func:`rope_heads_to_halves`, ``rotary_dim`` and
    ``leading`` passed on: a partial rotation of each head's first dims is GPT-J's; ``rows``:
    the whole projection's output rows): the weight, the bias and per-row scales permuted; a
    per-tensor scale, and block scales whose blocks hold whole heads, kept as they are. Any
    other layout (GPTQ's / AWQ's packed integers) is a ValueError naming the tensor and
    ``family``."""
    if what in ("weight", "bias", "weight_scale", "weight_scale_inv") and (
            t.dim() >= 1 and t.shape[0] == rows):
        return rope_heads_to_halves(t, head_dim, rotary_dim, leading)
    if what.endswith("scale") and t.numel() == 1 or (
            what == "weight_scale_inv" and t.dim() == 2 and -(-rows // t.shape[0]) % head_dim == 0):
        return t  # (no row leaves its block)
    raise ValueError(f"checkpoint tensor {name!r} {tuple(t.shape)}: {family} rotates "
                     f"interleaved RoPE pairs, for which mrv2 reorders the q/k projections' "
                     f"rows as they load; this tensor's layout (a packed integer format?) does "
                     f"not allow it")
