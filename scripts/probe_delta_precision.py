"""The chunked delta rule's error against the token-serial reference by products' precision
(GPU machine): a fp32 40-token sequence (the chunk-split test's inputs) and a bf16 one of 300
tokens, each chunked kernel run with ``dot_precision`` ``ieee`` / ``tf32x3`` / ``tf32``; prints
the outputs' and final states' largest absolute differences.

Usage: python scripts/probe_delta_precision.py
"""

from __future__ import annotations

import torch

from mrv2_kernels.chunk_delta_rule import chunk_gated_delta_rule_triton
from mrv2_kernels.linear_attention import gated_delta_rule_ref


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(40)
    for dtype, t, hv, dk, dv in ((torch.float32, 40, 2, 8, 4), (torch.float32, 300, 4, 128, 128),
                                 (torch.bfloat16, 300, 4, 128, 128)):
        q = torch.randn(t, 1, dk, device=dev, generator=gen).to(dtype)
        k = torch.randn(t, 1, dk, device=dev, generator=gen).to(dtype)
        v = torch.randn(t, hv, dv, device=dev, generator=gen).to(dtype)
        g = -(torch.rand(t, hv, device=dev, generator=gen) * 0.7 + 0.01)
        beta = torch.sigmoid(torch.randn(t, hv, device=dev, generator=gen)).to(dtype)
        state = torch.randn(1, hv, dk, dv, device=dev, generator=gen) * 0.5
        meta = (torch.tensor([0, t], dtype=torch.int32, device=dev),
                torch.tensor([t], dtype=torch.int32, device=dev),
                torch.zeros(1, dtype=torch.int32, device=dev))
        want_state = state.clone()
        want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *meta, dk ** -0.5, True)
        for prec in ("ieee", "tf32x3", "tf32"):
            for chunk in (16, 64):
                got_state = state.clone()
                got = chunk_gated_delta_rule_triton(q, k, v, g, beta, got_state, *meta,
                                                    dk ** -0.5, True, chunk=chunk,
                                                    dot_precision=prec)
                out_err = float((got.float() - want.float()).abs().max())
                state_err = float((got_state - want_state).abs().max())
                print(f"{str(dtype):15s} T={t:4d} K={dk:3d} chunk {chunk:2d} {prec:7s} "
                      f"out {out_err:9.2e}  state {state_err:9.2e}")


if __name__ == "__main__":
    main()
