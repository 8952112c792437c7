"""MoE routing after the router's linear layer: the experts each token goes to, and their weights.

Two ops, each one launch per step on the GPU where torch runs a chain of small kernels
(softmax, topk's gather and sort passes, the renormalizing sum and division, the int32 cast):

- :func:`softmax_topk`: ``softmax(logits)`` in fp32 over all ``E`` experts, the ``top_k``
  largest probabilities (descending) and their experts, renormalized to sum 1 when asked
  (Qwen2/3-MoE, Qwen3-Next, Mixtral, gpt-oss: ``mrv2.layers.moe.SoftmaxTopKRouter``).
- :func:`grouped_topk`: ``sigmoid`` (or ``softmax``) scores, a correction bias added for the
  choice only, the choice limited to the ``topk_group`` best of ``n_group`` groups (a group's
  score: the sum of its two best corrected scores with a bias, else its best score), the
  picked experts' uncorrected scores as weights, renormalized, times
  ``routed_scaling_factor`` (DeepSeek-V2/V3, GLM-4.x, MiniMax, ERNIE:
  ``mrv2.layers.moe.GroupedTopKRouter``).

Both return ``(weights fp32 [T, top_k], ids int32 [T, top_k])``, in descending order of the
value chosen on (``torch.topk(sorted=True)``'s order). **Ties go to the lower expert index**,
in the references as in the kernels (at every selection: the groups and the experts). Equal
logits give equal scores in both, so they pick the same experts; only two distinct scores an
fp32 rounding apart (``exp`` and the sums are rounded differently) could come out in another
order. ``torch.topk`` itself leaves the order of equal values unspecified, and on the CPU it
does not keep the lower index (it does on CUDA, generally); the references therefore select
with :func:`topk_lowest_index`: what a stable descending sort returns, about as fast as
``torch.topk`` (the routers' math is otherwise the same as before these kernels).

Kernels: one row of logits per program (``block_t`` rows for :func:`softmax_topk`), the whole
row in registers (padded to a power of two with ``-inf``, up to :data:`MAX_EXPERTS`), then
``top_k`` rounds of a max with its lowest index, each picked expert masked out for the next
round. The grid is the row count: nothing depends on the data, no host sync.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._backend import cdiv, default_block, next_power_of_2, pdl, pdl_prologue, use_triton

__all__ = ["MAX_EXPERTS", "grouped_topk", "grouped_topk_ref", "grouped_topk_triton",
           "softmax_topk", "softmax_topk_ref", "softmax_topk_triton", "topk_lowest_index"]

#: dtypes of logits the kernels take (loaded, converted to fp32 at once).
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: The most experts a row of the kernels holds in registers; the dispatchers run the reference
#: beyond.
MAX_EXPERTS = 4096
#: The scoring functions of :func:`grouped_topk`.
SCORINGS = ("sigmoid", "softmax")
#: What :func:`grouped_topk` adds to the renormalizing sum without a ``norm_min``.
_NORM_EPS = 1e-20


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the Triton path writes comes from here (tests poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _num_warps(block_e: int) -> int:
    """Warps per row: one up to 512 experts (a round's max is a warp's shuffles then, no
    shared memory or barrier), one more per 512 beyond, at most 8. Not measured yet."""
    return max(1, min(8, block_e // 512))


def _check_logits(logits: torch.Tensor, top_k: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    if not 1 <= top_k <= logits.shape[1]:
        raise ValueError(f"top_k must be in [1, {logits.shape[1]}], got {top_k}")


def topk_lowest_index(values: torch.Tensor, k: int, *, nonnegative: bool = False
                      ) -> torch.Tensor:
    """The indices (int64) of the ``k`` largest values of each row of ``values`` (2-D, fp32),
    descending, equal values in increasing index order: what
    ``values.sort(dim=-1, descending=True, stable=True)[1][:, :k]`` returns. On the CPU as
    fast as ``torch.topk`` for many rows (a stable sort of 512 experts is 3-5 times slower),
    ~10 µs more for one (a few more small ops).

    It is ``torch.topk`` over int64 keys that are all distinct, so its result is unique: the
    value's bits as an integer of the same order (a negative float's magnitude bits flipped;
    ``nonnegative`` says there are none and skips that), times ``2**32``, minus the index.
    ``-0.0`` orders below ``+0.0`` here (the routers' scores are never ``-0.0``); NaN above
    everything, as in a descending sort. Device ops only: no host sync."""
    bits = values.float().contiguous().view(torch.int32)
    if not nonnegative:
        bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    index = torch.arange(values.shape[-1], device=values.device)
    keys = bits.to(torch.int64).bitwise_left_shift_(32).sub_(index)
    return keys.topk(k, dim=-1).indices


# ------------------------------------------------------------------------------ softmax top-k


def softmax_topk_ref(logits: torch.Tensor, top_k: int, renormalize: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch specification of :func:`softmax_topk`: ``softmax(logits)`` in fp32, the
    ``top_k`` largest probabilities of each row, descending (ties: the lower expert first),
    divided by their sum when ``renormalize``. Returns ``(weights fp32, ids int32)``
    ``[T, top_k]``."""
    _check_logits(logits, top_k)
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    ids = topk_lowest_index(probs, top_k, nonnegative=True)
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


@triton.jit(do_not_specialize=["num_rows"])
def _softmax_topk_kernel(
    logits_ptr: tl.tensor,
    w_ptr: tl.tensor,
    ids_ptr: tl.tensor,
    num_rows: int,
    num_experts: int,
    row_stride: int,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    pdl_prologue(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < num_rows
    # rows past the end read the last row (no -inf-only rows, no NaN); never stored
    src = tl.minimum(rows, num_rows - 1).to(tl.int64) * row_stride
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < num_experts
    x = tl.load(logits_ptr + src[:, None] + cols[None, :], mask=cmask[None, :],
                other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, 1)[:, None])  # the padding: exp(-inf) = 0
    p = e / tl.sum(e, 1)[:, None]
    p = tl.where(cmask[None, :], p, float("-inf"))  # never picked (top_k <= num_experts)
    kcols = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for j in tl.static_range(TOP_K):
        # the largest probability left, at its lowest column
        v, i = tl.max(p, 1, return_indices=True, return_indices_tie_break_left=True)
        i = tl.minimum(i, num_experts - 1)  # (an id in range even for a row of NaN)
        w = tl.where(kcols[None, :] == j, v[:, None], w)
        ids = tl.where(kcols[None, :] == j, i[:, None], ids)
        p = tl.where(cols[None, :] == i[:, None], float("-inf"), p)
    if RENORM:
        w = w / tl.sum(w, 1)[:, None]  # the lanes past TOP_K hold 0
    dst = rows.to(tl.int64)[:, None] * TOP_K + kcols[None, :]
    omask = rmask[:, None] & (kcols < TOP_K)[None, :]
    tl.store(w_ptr + dst, w, mask=omask)
    tl.store(ids_ptr + dst, ids, mask=omask)


def softmax_topk_triton(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    block_t: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of :func:`softmax_topk`: one launch, ``block_t`` rows a program
    (default 1 on the GPU, 4 under the interpreter), a row's ``E <=`` :data:`MAX_EXPERTS`
    logits in registers, ``top_k`` rounds of a max with its lowest index (module docstring).
    ``logits``: ``[T, E]`` fp32, bf16 or fp16 with a unit last stride (copied otherwise)."""
    _check_logits(logits, top_k)
    if logits.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"logits must be one of {_KERNEL_DTYPES}, got {logits.dtype}")
    rows, experts = logits.shape
    if experts > MAX_EXPERTS:
        raise ValueError(f"at most {MAX_EXPERTS} experts, got {experts}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = _empty((rows, top_k), torch.float32, logits.device)
    ids = _empty((rows, top_k), torch.int32, logits.device)
    if rows == 0:
        return weights, ids
    block_e = next_power_of_2(experts)
    block_t = default_block(logits, 1, 4, block_t)
    _softmax_topk_kernel[(cdiv(rows, block_t),)](
        logits, weights, ids, rows, experts, logits.stride(0),
        TOP_K=top_k, RENORM=bool(renormalize), BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=next_power_of_2(top_k), num_warps=num_warps or _num_warps(block_e),
        **pdl(logits),
    )
    return weights, ids


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights fp32, ids int32)`` ``[T, top_k]``: the ``top_k`` largest of
    ``softmax(logits)`` (fp32) per row, descending, ties to the lower expert, renormalized
    to sum 1 when ``renormalize``. Runs :func:`softmax_topk_triton` when :func:`use_triton`
    says so (and the dtype and expert count fit), else :func:`softmax_topk_ref`."""
    if (use_triton(logits) and logits.dtype in _KERNEL_DTYPES
            and logits.dim() == 2 and logits.shape[1] <= MAX_EXPERTS):
        return softmax_topk_triton(logits, top_k, renormalize)
    return softmax_topk_ref(logits, top_k, renormalize)


# ------------------------------------------------------------------------------ grouped top-k


def _check_grouped(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                   scoring: str, correction_bias: torch.Tensor | None) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    experts = logits.shape[1]
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if n_group < 1 or experts % n_group:
        raise ValueError(f"n_group ({n_group}) must divide the expert count ({experts})")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if not 1 <= top_k <= topk_group * (experts // n_group):
        raise ValueError(f"top_k must be in [1, {topk_group * (experts // n_group)}] "
                         f"(topk_group x experts per group), got {top_k}")
    if correction_bias is not None and tuple(correction_bias.shape) != (experts,):
        raise ValueError(f"correction_bias must be [{experts}], got "
                         f"{tuple(correction_bias.shape)}")


def grouped_topk_ref(
    logits: torch.Tensor,
    top_k: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
    correction_bias: torch.Tensor | None = None,
    norm_min: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch specification of :func:`grouped_topk` (``logits`` ``[T, E]``, made fp32).

    ``scores = sigmoid(logits)`` (or ``softmax``); the choice is made on ``scores +
    correction_bias``. With ``topk_group < n_group`` the ``E`` experts form ``n_group`` equal
    groups of consecutive experts, a group's score is the sum of its two best choice values
    (with a bias and two or more experts a group) or its best one, and only the ``topk_group``
    best groups' experts stay candidates. The ``top_k`` best candidates (descending choice
    value; ties, of groups and of experts: the lower index) are the ids; their uncorrected
    scores the weights, divided by their sum plus 1e-20 (by the sum clamped at ``norm_min``,
    when given) if ``renormalize``, then times ``routed_scaling_factor``. Returns ``(weights
    fp32, ids int32)`` ``[T, top_k]``."""
    _check_grouped(logits, top_k, n_group, topk_group, scoring, correction_bias)
    logits = logits.float()
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if topk_group < n_group:
        grouped = choice.view(-1, n_group, choice.shape[-1] // n_group)
        if correction_bias is not None and grouped.shape[-1] >= 2:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = topk_lowest_index(group_scores, topk_group)
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view_as(choice)
    ids = topk_lowest_index(choice, top_k)
    weights = scores.gather(1, ids)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + _NORM_EPS if norm_min is None
                             else total.clamp_min(norm_min))
    return weights * routed_scaling_factor, ids.to(torch.int32)


@triton.jit
def _grouped_topk_kernel(
    logits_ptr: tl.tensor,
    bias_ptr: tl.tensor,
    w_ptr: tl.tensor,
    ids_ptr: tl.tensor,
    row_stride: int,
    scale: float,
    norm_min: float,
    N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORM: tl.constexpr,
    CLAMP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    pdl_prologue(PDL)
    row = tl.program_id(0)  # a program a row: the grid is the row count (nothing else varies)
    base = logits_ptr + row.to(tl.int64) * row_stride
    # the row as a [group, expert of the group] tile; expert = g * GROUP_SIZE + s
    g = tl.arange(0, BLOCK_G)
    s = tl.arange(0, BLOCK_S)
    valid = (g < N_GROUP)[:, None] & (s < GROUP_SIZE)[None, :]
    eid = g[:, None] * GROUP_SIZE + s[None, :]
    x = tl.load(base + eid, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        choice = tl.sigmoid(x)
    else:
        m = tl.max(tl.max(x, 1), 0)
        total = tl.sum(tl.sum(tl.exp(x - m), 1), 0)  # the padding: exp(-inf) = 0
        choice = tl.exp(x - m) / total
    if HAS_BIAS:
        choice += tl.load(bias_ptr + eid, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if TOPK_GROUP < N_GROUP:
        best, first = tl.max(choice, 1, return_indices=True, return_indices_tie_break_left=True)
        if HAS_BIAS and GROUP_SIZE >= 2:  # plus the second best (the best again if tied)
            best += tl.max(tl.where(s[None, :] == first[:, None], float("-inf"), choice), 1)
        kept = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            open_group = (g < N_GROUP) & ~kept
            cand = tl.where(open_group, best, float("-inf"))
            top = tl.max(cand, 0)
            pick = tl.min(tl.where(open_group & (cand == top), g, BLOCK_G), 0)
            kept = kept | (g == pick)
        choice = tl.where(kept[:, None], choice, float("-inf"))
    kcols = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int32)
    free = valid
    for j in tl.static_range(TOP_K):
        cand = tl.where(free, choice, float("-inf"))
        top = tl.max(tl.max(cand, 1), 0)
        pick = tl.min(tl.min(tl.where(free & (cand == top), eid, N_GROUP * GROUP_SIZE), 1), 0)
        pick = tl.minimum(pick, N_GROUP * GROUP_SIZE - 1)  # (in range even for NaN logits)
        ids = tl.where(kcols == j, pick, ids)
        free = free & (eid != pick)
    kmask = kcols < TOP_K
    # the picked experts' uncorrected scores: from their logits again, as above
    xk = tl.load(base + ids, mask=kmask, other=0.0).to(tl.float32)
    if SIGMOID:  # noqa: SIM108 (a constexpr branch: m and total exist only in the other)
        w = tl.sigmoid(xk)
    else:
        w = tl.exp(xk - m) / total
    w = tl.where(kmask, w, 0.0)
    if RENORM:
        if CLAMP:  # noqa: SIM108 (a constexpr branch)
            w = w / tl.maximum(tl.sum(w, 0), norm_min)
        else:
            w = w / (tl.sum(w, 0) + 1e-20)  # _NORM_EPS
    dst = row.to(tl.int64) * TOP_K + kcols
    tl.store(w_ptr + dst, w * scale, mask=kmask)
    tl.store(ids_ptr + dst, ids, mask=kmask)


def grouped_topk_triton(
    logits: torch.Tensor,
    top_k: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
    correction_bias: torch.Tensor | None = None,
    norm_min: float | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of :func:`grouped_topk`: one launch, a row a program held as a
    ``[group, expert]`` tile (``E <=`` :data:`MAX_EXPERTS`); the group scores, ``topk_group``
    rounds choosing groups, ``top_k`` rounds choosing experts (each a max, ties to the lower
    index), then the picked experts' scores from their logits. ``logits``: ``[T, E]`` fp32,
    bf16 or fp16 with a unit last stride (copied otherwise); ``correction_bias`` ``[E]``."""
    _check_grouped(logits, top_k, n_group, topk_group, scoring, correction_bias)
    if logits.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"logits must be one of {_KERNEL_DTYPES}, got {logits.dtype}")
    rows, experts = logits.shape
    if experts > MAX_EXPERTS:
        raise ValueError(f"at most {MAX_EXPERTS} experts, got {experts}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = _empty((rows, top_k), torch.float32, logits.device)
    ids = _empty((rows, top_k), torch.int32, logits.device)
    if rows == 0:
        return weights, ids
    bias = correction_bias
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    group_size = experts // n_group
    block_g, block_s = next_power_of_2(n_group), next_power_of_2(group_size)
    _grouped_topk_kernel[(rows,)](
        logits, bias if bias is not None else logits, weights, ids, logits.stride(0),
        float(routed_scaling_factor), float(norm_min or 0.0),
        N_GROUP=n_group, GROUP_SIZE=group_size, TOPK_GROUP=topk_group, TOP_K=top_k,
        SIGMOID=scoring == "sigmoid", HAS_BIAS=bias is not None, RENORM=bool(renormalize),
        CLAMP=norm_min is not None, BLOCK_G=block_g, BLOCK_S=block_s,
        BLOCK_K=next_power_of_2(top_k), num_warps=num_warps or _num_warps(block_g * block_s),
        **pdl(logits),
    )
    return weights, ids


def grouped_topk(
    logits: torch.Tensor,
    top_k: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
    correction_bias: torch.Tensor | None = None,
    norm_min: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k routing (:func:`grouped_topk_ref` says the math): ``(weights fp32,
    ids int32)`` ``[T, top_k]``. Runs :func:`grouped_topk_triton` when :func:`use_triton` says
    so (and the dtypes and expert count fit), else :func:`grouped_topk_ref`."""
    kwargs: dict[str, Any] = dict(
        n_group=n_group, topk_group=topk_group, renormalize=renormalize,
        routed_scaling_factor=routed_scaling_factor, scoring=scoring,
        correction_bias=correction_bias, norm_min=norm_min)
    if (use_triton(logits) and logits.dtype in _KERNEL_DTYPES and logits.dim() == 2
            and logits.shape[1] <= MAX_EXPERTS
            and (correction_bias is None or correction_bias.dtype in _KERNEL_DTYPES)):
        return grouped_topk_triton(logits, top_k, **kwargs)
    return grouped_topk_ref(logits, top_k, **kwargs)
