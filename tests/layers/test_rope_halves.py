"""The core's interleaved-to-halves row reorder that families with GPT-J-style RoPE (ERNIE,
Llama 4, Cohere, GLM's partial rotary, DeepSeek's MLA) load their q/k rows through, against a
plain per-head permutation written out here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrv2.layers import qk_rows_to_halves, rope_heads_to_halves


def _by_hand(rows: torch.Tensor, head_dim: int, rotary: int, leading: bool) -> torch.Tensor:
    out = rows.clone()
    for h in range(rows.shape[0] // head_dim):
        lo = h * head_dim + (0 if leading else head_dim - rotary)
        part = rows[lo:lo + rotary]
        out[lo:lo + rotary] = torch.cat([part[0::2], part[1::2]])
    return out


@pytest.mark.parametrize(("rotary", "leading"), [(None, False), (4, False), (4, True)])
def test_heads_to_halves_is_the_per_head_permutation(rotary: int | None, leading: bool) -> None:
    rows = torch.randn(3 * 8, 5)
    view = rows.t().contiguous().t()  # (not contiguous: a checkpoint's view)
    got = rope_heads_to_halves(view, 8, rotary, leading)
    assert torch.equal(got, _by_hand(rows, 8, rotary or 8, leading))
    assert torch.equal(view, rows)  # (a new tensor: the input is left as it was)
    fp8 = rows.to(torch.float8_e4m3fn)  # moved as bytes
    assert torch.equal(rope_heads_to_halves(fp8, 8, rotary, leading).view(torch.uint8),
                       _by_hand(fp8.view(torch.uint8), 8, rotary or 8, leading))
    with pytest.raises(ValueError, match="whole heads of 8 rows"):
        rope_heads_to_halves(rows[:-1], 8)


def test_qk_rows_move_q_and_k_and_leave_v() -> None:
    qkv = SimpleNamespace(q_size=16, kv_size=8, head_dim=8)
    rows = torch.randn(32, 3)
    want = torch.cat([_by_hand(rows[:16], 8, 8, False), _by_hand(rows[16:24], 8, 8, False),
                      rows[24:]])
    assert torch.equal(qk_rows_to_halves(qkv, rows.clone()), want)
