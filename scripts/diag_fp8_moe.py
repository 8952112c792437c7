"""GPU diagnosis of the fused MoE's FP8 path: relative error against the FP8 reference at a
GLM-4.5-Air-like layer (32 of its 128 experts) for each quantization place and batch size."""

from __future__ import annotations

import sys

sys.path.insert(0, "tests/kernels")
from test_fused_moe_fp8 import BF16, ROW, Experts, _routing, _tokens  # noqa: E402

from mrv2_kernels.fused_moe import fused_moe_ref, fused_moe_triton  # noqa: E402

ex = Experts(32, 4096, 1408, ROW, seed=0)
for tokens in (1, 16, 300):
    x = _tokens(tokens, 4096, BF16, seed=tokens)
    weights, ids = _routing(tokens, 8, 32, seed=tokens)
    want = fused_moe_ref(x, ex.w13, ex.w2, weights, ids, **ex.kw()).float()
    for fuse in (False, True):
        for act in ("kernel", "down", "epilogue"):
            for block_m in (16, 64):
                try:
                    got = fused_moe_triton(x, ex.w13, ex.w2, weights, ids, **ex.kw(),
                                           fuse_x_quant=fuse, act_quant=act, block_m=block_m)
                    rel = f"{float((got.float() - want).norm() / want.norm()):.5f}"
                except Exception as e:  # noqa: BLE001
                    rel = type(e).__name__ + ": " + str(e).splitlines()[0][:60]
                print(f"T={tokens:4d} fuse_x={fuse!s:5} act={act:8} bm={block_m:3d} rel={rel}")
got = fused_moe_triton(x, ex.w13, ex.w2, weights, ids, **ex.kw())
print("default T=300", float((got.float() - want).norm() / want.norm()))
