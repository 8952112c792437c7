"""Fused mixture-of-experts: the routed experts' SwiGLU MLPs for a batch of tokens (reference
in fused_moe_ref).

Contract (``x`` ``[T, H]``, ``w13`` ``[E, 2*I, H]`` holding each expert's gate rows then its up
rows, ``w2`` ``[E, H, I]``, ``topk_weights`` ``[T, K]`` fp32, ``topk_ids`` ``[T, K]`` int)::

    for t, j:  e = topk_ids[t, j]
        gate_up = (x[t].float() @ w13[e].float().T).to(x.dtype)          # [2I]
        act     = (silu(gate_up[:I].float()) * gate_up[I:].float()).to(x.dtype)
        y[t, j] = (act.float() @ w2[e].float().T)                       # [H], fp32
    out[t] = (sum_j topk_weights[t, j] * y[t, j]).to(x.dtype)

The roundings are those of the unfused layers (a gate/up linear, ``silu_and_mul``, a down
linear). Biases (``w13_bias`` ``[E, 2I]``, ``w2_bias`` ``[E, H]``) join the fp32 products
before those roundings (the down bias before the routing weight), and ``activation`` may be
gpt-oss's clamped ``"swigluoai"``, GeGLU or Step's clamped SiLU ``"silu_clamp"`` instead of
SiLU (:func:`~mrv2_kernels.fused_moe_ref.glu`).
``topk_ids`` outside ``[0, E)`` are not allowed: nothing checks them, and the Triton path
does not skip them safely (the GEMMs' alignment leaves such a pair out, so its row of the
combine's input is never written and, with the fused combine, its token's arrival count
never completes: the output row is left unwritten and the persistent count stays off for
later calls; the pair-a-program kernels of :mod:`~mrv2_kernels.fused_moe_gemv` read the
weights at that expert's offset, outside the tensors).
With ``valid_tokens`` (int32 ``[1]`` on the device: a CUDA graph's real token count) the rows
from ``valid_tokens[0]`` on are padding: no expert is read or computed for them and their
output rows are unspecified (the reference leaves them at zero).

The Triton path (:func:`fused_moe_triton`; its kernels in :mod:`~mrv2_kernels.
fused_moe_kernels`) runs, without a host synchronization and with
buffer sizes that depend on ``(T, K, E, BLOCK_M)`` only (so a CUDA graph can capture it):

1. :func:`~mrv2_kernels.moe_align.moe_align` (its own module) sorts the ``T*K`` (token, slot)
   pairs by expert on the GPU: each expert's flat pair indices padded to a multiple of
   ``BLOCK_M``, the expert of every block, the padded row count. Experts without tokens get
   no block.
2. A grouped gate/up GEMM: each program takes one block of sorted pairs (one expert) and one
   ``BLOCK_N`` slice of the intermediate features, gathers the tokens' rows of ``x``,
   accumulates gate and up in fp32 with ``tl.dot``, rounds each to ``x.dtype`` and writes
   ``act = silu(gate) * up`` (rounded) at the pair's flat row of a ``[T*K, I]`` buffer.
3. A grouped down GEMM over the same blocks: ``act @ w2[e].T`` in fp32, times the pair's
   routing weight, written at the flat row of an fp32 ``[T*K, H]`` buffer.
4. The combine: ``out[t] = sum_j y[t*K + j]`` in slot order (deterministic: no fp32
   atomics), rounded to ``x.dtype``. A kernel of its own, or for decode-sized batches fused
   into the down GEMM: an int32 arrival count per (token, output slice) picks the program
   that stores a token's last row, and that program sums the token's rows in slot order.

FP8 weights (``w13``/``w2`` float8_e4m3fn with block scales ``w13_scale``/``w2_scale``,
``block = (bn, bk)``, default the engine's per-row ``(1, 128)``; format, contract and the
reasons: :mod:`~mrv2_kernels.fused_moe_fp8`): the same steps, switched at compile time
(``FP8``: the bf16 kernels' code is unchanged). ``x`` is quantized per (token, group of
``bk``) and the SiLU*up activation per (pair, group) as DeepSeek-V3 and vLLM do; each
``BLOCK_K`` step (which divides ``bk``) ``tl.dot``s fp8 tiles into fresh fp32 products and
adds them times the rows' activation scales and the columns' weight scales. Where each
quantization runs (:class:`MoeTiles`): by default ``x`` and the activation are quantized once
each by :func:`~mrv2_kernels.fp8_gemm.per_token_group_quant_fp8_triton`; the tiles can move
either into the GEMM that reads it (:mod:`~mrv2_kernels.fused_moe_fp8`).

Integer weights (GPTQ / AWQ / compressed-tensors experts, ``int_experts``: packed along K,
per-row group scales and zero points; :mod:`~mrv2_kernels.fused_moe_int`): the same steps
with the weight tiles unpacked in the GEMMs (``INT``) and nothing else quantized; the K steps
divide the group size. MXFP4 experts (gpt-oss: e2m1 codes, e8m0 scales, groups of 32) take
the same path with the codes decoded to their values (``FP4``). Not yet measured on a GPU.

Programs past the real block count exit at once. Tiles are arguments (``block_m`` etc.) with
per-backend defaults (:func:`moe_tiles`): for decode-sized batches (a few pairs per expert, the
step bound by reading the hit experts' weights) 16-row blocks and narrow slices, so the
programs spread over every SM; 128-row blocks of wide slices when many tokens share each
expert. On an H200 (``python -m mrv2_kernels.bench_moe``, Qwen3-30B-A3B's layer, bf16) one
token takes 28 µs (0.64 of the weight-bandwidth floor), 8 to 256 tokens 0.84-0.95 of it,
and 8,192 tokens 1.6 ms (~375 TFLOP/s); the torch reference takes 3-65 ms.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton.language as tl

from ._backend import cdiv, use_triton
from .fp8_gemm import FP8_DTYPE, per_token_group_quant_fp8_triton
from .fused_moe_fp8 import DEFAULT_BLOCK, check_fp8_args
from .fused_moe_gemv import GemvTiles, fused_moe_gemv, gemv_fits
from .fused_moe_int import IntExperts, check_int_args
from .fused_moe_kernels import _moe_combine_kernel, _moe_down_kernel, _moe_gate_up_kernel
from .fused_moe_ref import (
    ACTIVATIONS,
    PLAIN,
    Epilogue,
    _check,
    check_epilogue,
    fused_moe_ref,
)
from .int_bits import TWO23_BITS, magic_by_default
from .int_dense import dequantize_experts, use_int_dense
from .moe_align import _ID_DTYPES, _tile, moe_align, moe_align_ref, moe_max_blocks
from .moe_tiles import MoeTiles, _check_fp8_tiles, moe_tiles
from .mxfp4_dense import use_dense

__all__ = [
    "ACTIVATIONS",
    "Epilogue",
    "IntExperts",
    "MoeTiles",
    "fused_moe",
    "fused_moe_ref",
    "fused_moe_triton",
    "moe_align",
    "moe_align_ref",
    "moe_max_blocks",
    "moe_tiles",
]

#: dtypes of ``x`` / the weights the Triton kernels take (loaded, converted to fp32 at once).
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the GEMMs write comes from here (tests poison them; the align step has its
    own, :func:`mrv2_kernels.moe_align._empty`)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check_kernel_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       topk_weights: torch.Tensor, topk_ids: torch.Tensor, fp8: bool) -> None:
    """What the Triton path assumes beyond :func:`_check` (and, ``fp8``,
    :func:`~mrv2_kernels.fused_moe_fp8.check_fp8_args`): dtypes, one device, unit strides."""
    if x.dtype not in _KERNEL_DTYPES:
        raise ValueError(f"x must be fp32/bf16/fp16, got {x.dtype}")
    for name, w in (("w13", w13), ("w2", w2)):
        if not fp8 and w.dtype != x.dtype:
            raise ValueError(f"{name} must have x's dtype {x.dtype}, got {w.dtype}")
        if w.shape[2] > 1 and w.stride(2) != 1:
            raise ValueError(f"{name} rows must be contiguous (stride(2) == 1)")
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if topk_ids.dtype not in _ID_DTYPES:
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    for name, t in (("w13", w13), ("w2", w2), ("topk_weights", topk_weights),
                    ("topk_ids", topk_ids)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")


# -------------------------------------------------------------------------------- the op


#: Per-device arrival counts of the fused combine (zero between launches: each combining
#: program resets its own). Outgrown buffers stay alive: CUDA graphs may still use them.
_COUNTERS: dict[str, list[torch.Tensor]] = {}


def _arrival_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """Zeroed int32 arrival counts, at least ``needed``; allocated outside CUDA-graph capture
    only (a graph's warm-up call does it). None (use the combine kernel) if a capture finds
    none big enough."""
    buffers = _COUNTERS.setdefault(str(device), [])
    if not buffers or buffers[-1].numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buffers.append(torch.zeros(max(needed, 1 << 16), dtype=torch.int32, device=device))
    return buffers[-1]


class _Fp8(NamedTuple):
    """The FP8 weights' scales (fp32) and block."""

    w13_scale: torch.Tensor
    w2_scale: torch.Tensor
    bn: int
    bk: int


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _moe_chunk(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, out: torch.Tensor, tiles: MoeTiles,
               fp8: _Fp8 | None = None, valid_tokens: torch.Tensor | None = None,
               first_token: int = 0, ints: IntExperts | None = None,
               epi: Epilogue = PLAIN) -> None:
    """The four steps of the module docstring for ``x`` ``[T > 0, H]``, into ``out``. FP8:
    ``x`` quantized once before the gate/up GEMM (or inside it), the activation in the
    gate/up epilogue, the down GEMM or a kernel of its own (``tiles.act_quant``)."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    num_pairs = num_tokens * top_k
    bm = tiles.block_m
    int_args: dict[str, object] = {}
    sorted_ids, block_expert, num_post = moe_align(topk_ids, num_experts, bm, valid_tokens,
                                                   first_token)
    max_blocks = block_expert.shape[0]
    y = _empty((num_pairs, hidden), torch.float32, x.device)
    upcast = not x.is_cuda
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    a1, a1_scale, s13, s2 = x, y, y, y  # unused pointers: any tensor
    w_bn, w_bk = 1, 1
    quant_out = False
    if ints is not None:  # the scales' (per-row) layout; zero points in the same strides
        s13, s2, w_bk = ints.w13_scale, ints.w2_scale, ints.group_size
        z13 = ints.w13_zeros if ints.w13_zeros is not None else s13
        z2 = ints.w2_zeros if ints.w2_zeros is not None else s2
        int_args = {"INT": True, "BITS": ints.bits, "HAS_ZEROS": ints.w13_zeros is not None,
                    "FP4": ints.fp4, "INT_FOLD": tiles.int_fold, "INT_MAGIC": tiles.int_magic,
                    "two23": TWO23_BITS}
        act = _empty((num_pairs, inter), x.dtype, x.device)
    elif fp8 is None:
        act = _empty((num_pairs, inter), x.dtype, x.device)
    else:
        s13, s2, w_bn, w_bk = fp8
        if not tiles.fuse_x_quant:
            a1, a1_scale = per_token_group_quant_fp8_triton(x, w_bk)
        quant_out = tiles.act_quant == "epilogue"
        act = _empty((num_pairs, inter), FP8_DTYPE if quant_out else x.dtype, x.device)
    act_scale = (_empty((num_pairs, cdiv(inter, w_bk)), torch.float32, x.device)
                 if quant_out else y)
    b13, b2 = epi.w13_bias, epi.w2_bias
    bias13 = {} if b13 is None else {"b_ptr": b13, "b_s0": b13.stride(0), "HAS_BIAS": True}
    bias2 = {} if b2 is None else {"b_ptr": b2, "b_s0": b2.stride(0), "HAS_BIAS": True}
    act_args = ({} if epi.activation == "silu"
                else {"ACT": ACTIVATIONS.index(epi.activation), "act_limit": epi.swiglu_limit})
    _moe_gate_up_kernel[(max_blocks * cdiv(inter, tiles.block_n1),)](
        a1, w13, act, sorted_ids, block_expert, num_post, num_pairs, max_blocks, top_k, hidden,
        inter, a1.stride(0), w13.stride(0), w13.stride(1), act.stride(0), a1_scale, s13,
        act_scale, a1_scale.stride(0), *_strides3(s13), act_scale.stride(0), BLOCK_M=bm,
        BLOCK_N=tiles.block_n1, BLOCK_K=tiles.block_k1, GROUP_M=tiles.group_m,
        EVEN_K=hidden % tiles.block_k1 == 0, UPCAST=upcast, DOT_PRECISION=precision,
        FP8=fp8 is not None, QUANT_A=fp8 is not None and tiles.fuse_x_quant,
        QUANT_OUT=quant_out, W_BN=w_bn, W_BK=w_bk, ACT_DTYPE=_TL_DTYPES[x.dtype],
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **({"wz_ptr": z13, **int_args} if ints is not None else {}), **bias13, **act_args,
    )
    if fp8 is not None and tiles.act_quant == "kernel":
        act, act_scale = per_token_group_quant_fp8_triton(act, w_bk)
    num_n2 = cdiv(hidden, tiles.block_n2)
    counters = _arrival_counters(x.device, num_tokens * num_n2) if tiles.fused_combine else None
    _moe_down_kernel[(max_blocks * num_n2,)](
        act, w2, topk_weights, y, sorted_ids, block_expert, num_post, num_pairs, max_blocks,
        top_k, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), topk_weights.stride(0),
        topk_weights.stride(1), y.stride(0), out, counters if counters is not None else y,
        out.stride(0), act_scale, s2, act_scale.stride(0), *_strides3(s2), BLOCK_M=bm,
        BLOCK_N=tiles.block_n2, BLOCK_K=tiles.block_k2, GROUP_M=tiles.group_m,
        EVEN_K=inter % tiles.block_k2 == 0, UPCAST=upcast, DOT_PRECISION=precision,
        FUSED_COMBINE=counters is not None, FP8=fp8 is not None,
        QUANT_A=fp8 is not None and tiles.act_quant == "down", W_BN=w_bn, W_BK=w_bk,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **({"wz_ptr": z2, **int_args} if ints is not None else {}), **bias2,
    )
    if counters is not None:
        return
    block_t, block_h = (1, 1024) if x.is_cuda else (8, 64)
    _moe_combine_kernel[(cdiv(num_tokens, block_t), cdiv(hidden, block_h))](
        y, out, num_tokens, top_k, hidden, y.stride(0), out.stride(0), BLOCK_T=block_t,
        BLOCK_H=block_h, num_warps=4,
    )


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    """A scale tensor's three strides (zeros for the unused 2-D stand-in)."""
    return (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 3 else (0, 0, 0)


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] | list[int] = DEFAULT_BLOCK,
    block_m: int | None = None,
    block_n1: int | None = None,
    block_k1: int | None = None,
    block_n2: int | None = None,
    block_k2: int | None = None,
    group_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    chunk_tokens: int = 8192,
    fused_combine: bool | None = None,
    fuse_x_quant: bool | None = None,
    act_quant: str | None = None,
    valid_tokens: torch.Tensor | None = None,
    int_experts: IntExperts | None = None,
    epilogue: Epilogue = PLAIN,
    int_fold: bool | None = None,
    int_magic: bool | None = None,
    int_gemv: bool | None = None,
    int_dense: bool | None = None,
) -> torch.Tensor:
    """Triton implementation of :func:`fused_moe` (module docstring: align, gate/up GEMM, down
    GEMM, combine); tile arguments override :func:`moe_tiles`. Never synchronizes with the
    host. Scratch per ``chunk_tokens`` tokens (longer batches run chunk after chunk):
    ``[T*K, I]`` of ``x.dtype`` and ``[T*K, H]`` fp32 (512 MiB for 8,192 tokens of
    Qwen3-30B-A3B).

    ``fused_combine`` (default: :func:`moe_tiles`' choice, on for decode-sized batches):
    the down GEMM also adds each token's ``K`` rows (the program that
    stores a token's last row for an output slice, by an atomic arrival count per token and
    slice, sums the rows in slot order), so no combine launch; the counts live in a small
    persistent buffer per device, so calls on one device must not run concurrently on two
    streams. A CUDA-graph capture that finds the buffer too small uses the combine kernel.

    FP8 weights (``w13_scale``/``w2_scale``, :mod:`~mrv2_kernels.fused_moe_fp8`; ``bk`` a
    power of two that ``block_k1`` and ``block_k2`` divide): ``fuse_x_quant`` and
    ``act_quant`` (``"epilogue"``, ``"down"``, ``"kernel"``) say where the activations are
    quantized (:class:`MoeTiles`); also scratch ``[T, H]`` fp8 and the activation's fp8 copy.

    ``valid_tokens`` (int32 ``[1]`` on the device; a CUDA graph's real token count): the rows
    from ``valid_tokens[0]`` on are padding; their pairs are left out of the alignment, so
    no expert is read or computed for them, and their output rows are unspecified.

    ``int_experts``: ``w13`` / ``w2`` hold packed integers (:mod:`~mrv2_kernels.
    fused_moe_int`); the K steps are cut to divide the group size; ``int_fold``
    (:class:`MoeTiles`) scales each weight tile before its dot, ``int_magic`` makes the
    weights floats from their bits, ``int_gemv`` runs the pair-a-program CUDA-core kernels
    (:mod:`~mrv2_kernels.fused_moe_gemv`; the default for a few tokens); ``int_dense``:
    the experts dequantized to ``x``'s dtype first, then the unquantized GEMMs
    (:mod:`~mrv2_kernels.mxfp4_dense`: MXFP4's default for large steps;
    :mod:`~mrv2_kernels.int_dense`: integers', opt-in).
    """
    overrides = {k: v for k, v in dict(
        block_m=block_m, block_n1=block_n1, block_k1=block_k1, block_n2=block_n2,
        block_k2=block_k2, group_m=group_m, num_warps=num_warps, num_stages=num_stages,
        fused_combine=fused_combine, int_fold=int_fold, int_magic=int_magic,
        int_gemv=int_gemv).items() if v is not None}
    if int_experts is not None:
        return _fused_moe_int(x, w13, w2, topk_weights, topk_ids, int_experts, valid_tokens,
                              epilogue, chunk_tokens, overrides, int_dense)
    _check(x, w13, w2, topk_weights, topk_ids)
    epilogue = check_epilogue(w13, w2, epilogue)
    fp8_block = check_fp8_args(w13, w2, w13_scale, w2_scale, block)
    _check_kernel_args(x, w13, w2, topk_weights, topk_ids, fp8_block is not None)
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_experts, two_i, _ = w13.shape
    out = _empty((num_tokens, hidden), x.dtype, x.device)
    if num_tokens == 0:
        return out
    if top_k == 0:
        return out.zero_()
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    fp8 = None
    if fp8_block is not None and w13_scale is not None and w2_scale is not None:
        if fp8_block[1] & (fp8_block[1] - 1):
            raise ValueError(f"block K must be a power of two on the Triton path, got {block}")
        fp8 = _Fp8(w13_scale.float(), w2_scale.float(), *fp8_block)
    minimum = 16 if x.is_cuda else 1  # tl.dot's smallest tile on the GPU
    for start in range(0, num_tokens, chunk_tokens):
        stop = min(start + chunk_tokens, num_tokens)
        plan = moe_tiles(stop - start, top_k, num_experts, hidden, two_i // 2, x.device,
                         fp8_block)
        tiles = MoeTiles(
            block_m=_tile("block_m", block_m or plan.block_m, minimum),
            block_n1=_tile("block_n1", block_n1 or plan.block_n1, minimum),
            block_k1=_tile("block_k1", block_k1 or plan.block_k1, minimum),
            block_n2=_tile("block_n2", block_n2 or plan.block_n2, minimum),
            block_k2=_tile("block_k2", block_k2 or plan.block_k2, minimum),
            group_m=_tile("group_m", group_m or plan.group_m, 1),
            num_warps=_tile("num_warps", num_warps or plan.num_warps, 1),
            num_stages=num_stages or plan.num_stages,
            fused_combine=plan.fused_combine if fused_combine is None else fused_combine,
            fuse_x_quant=plan.fuse_x_quant if fuse_x_quant is None else fuse_x_quant,
            act_quant=plan.act_quant if act_quant is None else act_quant,
        )
        if fp8 is not None:
            tiles = _check_fp8_tiles(tiles, fp8.bk, fuse_x_quant is None, act_quant is None)
        _moe_chunk(x[start:stop], w13, w2, topk_weights[start:stop], topk_ids[start:stop],
                   out[start:stop], tiles, fp8, valid_tokens, start, epi=epilogue)
    return out


#: Up to this many tokens a chunk of integer / MXFP4 experts runs the pair-a-program
#: CUDA-core kernels (:mod:`~mrv2_kernels.fused_moe_gemv`) by default: at 1 and 2 tokens they
#: beat the GEMMs by 26-46% (H100, ``bench_int --magic``), at 8 they lost by 15%.
GEMV_MAX_TOKENS = 2


def _int_plan(plan: MoeTiles, per_expert: float, fp4: bool, cuda: bool,
              tokens: int = 0) -> MoeTiles:
    """The integer experts' tiles on the GPU (``bench_int --sweep`` / ``--magic``, an H100,
    2026-12-05). Qwen3-30B-A3B's layer as 4-bit GPTQ: each step's weight tile scaled before
    its dot (``int_fold``; 9-19% faster at 1-64 tokens) and, from half a pair per expert on,
    64 intermediate / 128 hidden features per program (209 -> 176 µs at 8 tokens, 472 -> 384
    at 64); its integers made floats from their bits (``int_magic``) measured no faster.
    MXFP4 (gpt-oss-20b's layer): the codes made floats from their bits (``int_magic``:
    141.7 -> 115.4 µs at 1 token, 509 -> 425 at 8, 702 -> 613 at 64) and, from 1 pair per
    expert on, 64 intermediate features per program, with 128 hidden ones below 8 pairs (425
    -> 404 at 8 tokens, 613 -> 563 at 64); neither its 64-/128-wide folded steps (the scales
    in the weights, bit-built or not) nor other slices beat one group a step there. From
    64-row tiles (256 tokens on) they do: K steps of 64 and 64 hidden features a program (983
    -> 859 µs at 256 tokens; 128-row tiles with 32 intermediate features and 4 stages: 6,745
    -> 1,928 µs at 1,024, where the dequantized path, :mod:`~mrv2_kernels.mxfp4_dense`, takes
    over where its scratch fits)."""
    if not cuda:
        return plan
    magic = magic_by_default()  # (MRV2_INT_MAGIC=0: the conversions and GEMMs, as before)
    if tokens <= GEMV_MAX_TOKENS and magic:
        plan = plan._replace(int_gemv=True)
    if fp4:
        if magic:
            plan = plan._replace(int_magic=True)
            if plan.block_m == 16 and per_expert >= 1:
                plan = plan._replace(block_n1=64, block_n2=128 if per_expert < 8 else 64)
            elif plan.block_m >= 64:
                wide = plan.block_m > 64
                plan = plan._replace(block_n1=32 if wide else 64, block_n2=64,
                                     block_k1=MXFP4_WIDE_STEP, block_k2=MXFP4_WIDE_STEP,
                                     num_stages=4 if wide else 3)
        return plan
    plan = plan._replace(int_fold=True)
    if plan.block_m == 16 and per_expert >= 0.5:
        plan = plan._replace(block_n1=64, block_n2=128)
    return plan


#: The widest default K step of MXFP4 experts (a power of two; its scales folded into the
#: weights where it spans groups of 32, :func:`~mrv2_kernels.fused_moe_int._int_tile`); 0: one
#: group a step (measured no slower: :func:`_int_plan`). Explicit ``block_k1`` / ``block_k2``
#: override it.
MXFP4_MAX_STEP = 0
#: MXFP4's K step with tiles of 64 rows or more (:func:`_int_plan`): two groups, folded.
MXFP4_WIDE_STEP = 64


def _fused_moe_int(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor, ints: IntExperts,
                   valid_tokens: torch.Tensor | None, epilogue: Epilogue,
                   chunk_tokens: int = 8192, overrides: dict[str, Any] | None = None,
                   dense: bool | None = None) -> torch.Tensor:
    """:func:`fused_moe_triton` of integer experts, chunk after chunk: the default tiles (or
    ``overrides``, :class:`MoeTiles` fields) with K steps that divide the group size (a step
    in one group) or, MXFP4, powers of two up to the plan's that the pack divides (the scales
    folded into the weights where a step spans groups: :func:`~mrv2_kernels.fused_moe_int.
    _int_tile`)."""
    num_tokens, hidden = x.shape
    inter, pack = check_int_args(w13, w2, ints, hidden)
    epilogue = check_epilogue(w13, w13.new_empty(w13.shape[0], hidden, 0), epilogue)
    if x.dtype not in _KERNEL_DTYPES or x.dim() != 2:
        raise ValueError(f"x must be [T, H] fp32/bf16/fp16, got {x.dtype} {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [{num_tokens}, K]")
    ints = ints._replace(
        w13_scale=ints.w13_scale.contiguous(), w2_scale=ints.w2_scale.contiguous(),
        w13_zeros=None if ints.w13_zeros is None else ints.w13_zeros.contiguous(),
        w2_zeros=None if ints.w2_zeros is None else ints.w2_zeros.contiguous())
    top_k = topk_ids.shape[1]
    out = _empty((num_tokens, hidden), x.dtype, x.device)
    if num_tokens == 0:
        return out
    if top_k == 0:
        return out.zero_()
    x = x.contiguous()
    rule = use_dense if ints.fp4 else use_int_dense
    if dense is not False and (dense or not overrides and rule(num_tokens, w13, w2, pack,
                                                               x.dtype)):
        # a large step: the experts dequantized to x's dtype, then the unquantized GEMMs
        d13 = dequantize_experts(w13, ints.w13_scale, ints.w13_zeros, ints, x.dtype)
        d2 = dequantize_experts(w2, ints.w2_scale, ints.w2_zeros, ints, x.dtype)
        return fused_moe_triton(x, d13, d2, topk_weights, topk_ids, valid_tokens=valid_tokens,
                                epilogue=epilogue, chunk_tokens=chunk_tokens)
    # the largest power of two dividing G; MXFP4 steps may span groups where asked for
    step = ints.group_size & -ints.group_size
    if ints.fp4 and MXFP4_MAX_STEP:
        step = max(step, MXFP4_MAX_STEP)
    overrides = overrides or {}
    for start in range(0, num_tokens, chunk_tokens):
        stop = min(start + chunk_tokens, num_tokens)
        plan = _int_plan(moe_tiles(stop - start, top_k, w13.shape[0], hidden, inter,
                                   x.device), (stop - start) * top_k / w13.shape[0],
                         ints.fp4, x.is_cuda, stop - start)._replace(**overrides)
        # (_int_plan's MXFP4 steps of two groups from 64-row tiles on)
        wide = (ints.fp4 and plan.int_magic and plan.block_m >= 64
                and plan.block_k1 == plan.block_k2 == MXFP4_WIDE_STEP)
        if plan.int_gemv and gemv_fits(ints):
            gt = GemvTiles()
            gt = gt._replace(**{f: overrides[o] for f, o in (
                ("block_n1", "block_n1"), ("block_n2", "block_n2"), ("block_k", "block_k1"),
                ("num_warps", "num_warps"), ("num_stages", "num_stages")) if o in overrides})
            counters = _arrival_counters(x.device, (stop - start) * cdiv(hidden, gt.block_n2))
            if counters is not None:  # (None: a capture found too few; the GEMMs instead)
                fused_moe_gemv(x[start:stop], w13, w2, topk_weights[start:stop],
                               topk_ids[start:stop], out[start:stop], ints, counters, gt,
                               valid_tokens, start, epilogue)
                continue
        k1, k2 = (plan.block_k1 if "block_k1" in overrides or wide
                  else min(plan.block_k1, step),
                  plan.block_k2 if "block_k2" in overrides or wide
                  else min(plan.block_k2, step))
        if min(k1, k2) < max(16, pack) or any(k & (k - 1) for k in (k1, k2)) or (
                not ints.fp4 and ints.group_size % max(k1, k2)):
            raise ValueError(f"group_size {ints.group_size} with K steps {k1} / {k2}: each "
                             "must be a power of two >= 16 that divides it (MXFP4: any)")
        _moe_chunk(x[start:stop], w13, w2, topk_weights[start:stop], topk_ids[start:stop],
                   out[start:stop], plan._replace(block_k1=k1, block_k2=k2), None,
                   valid_tokens, start, ints, epilogue)
    return out


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: tuple[int, int] | list[int] = DEFAULT_BLOCK,
    valid_tokens: torch.Tensor | None = None,
    int_experts: IntExperts | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """The routed experts of ``x`` (see the module contract; biases and the activation:
    ``w13_bias`` ``[E, 2I]`` and ``w2_bias`` ``[E, H]`` added to the fp32 products,
    ``activation`` one of :data:`ACTIVATIONS`; integer weights: ``int_experts``,
    :mod:`~mrv2_kernels.fused_moe_int`; FP8 weights with their scales:
    :mod:`~mrv2_kernels.fused_moe_fp8`): :func:`fused_moe_triton` when :func:`use_triton` says
    so (fp32/bf16/fp16 ``x``; FP8: a power-of-two block K), else :func:`fused_moe_ref` (which
    loops over the experts present, on the host: fine on the CPU, not for CUDA graphs).
    ``valid_tokens`` (int32 ``[1]``, on ``x``'s device): rows from ``valid_tokens[0]`` on are
    padding, not computed (their output rows are unspecified)."""
    epi = Epilogue(activation, swiglu_limit, w13_bias, w2_bias)
    if int_experts is not None:
        if use_triton(x) and x.dtype in _KERNEL_DTYPES:
            return fused_moe_triton(x, w13, w2, topk_weights, topk_ids,
                                    valid_tokens=valid_tokens, int_experts=int_experts,
                                    epilogue=epi)
        return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, valid_tokens=valid_tokens,
                             int_experts=int_experts, epilogue=epi)
    fp8 = w13_scale is not None or w2_scale is not None
    bk = int(block[1]) if fp8 else 1
    if use_triton(x) and x.dtype in _KERNEL_DTYPES and bk > 0 and bk & (bk - 1) == 0:
        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale,
                                w2_scale=w2_scale, block=block, valid_tokens=valid_tokens,
                                epilogue=epi)
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale,
                         w2_scale=w2_scale, block=block, valid_tokens=valid_tokens,
                         epilogue=epi)
