"""lora_apply: the Triton shrink/expand (interpreted on CPU) against the torch reference."""

from __future__ import annotations

import os

import pytest
import torch

from mrv2_kernels.lora import _lora_apply_cpu, lora_apply_ref, lora_apply_triton, shrink_split

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)


def _case(seed: int, t: int, k: int, n: int, rank: int, num_slots: int, dtype: torch.dtype,
          slot_values: list[int]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(dtype)
    y = torch.randn(t, n, generator=g).to(dtype)
    a = (torch.randn(num_slots, rank, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(num_slots, n, rank, generator=g).to(dtype)
    pick = torch.randint(0, len(slot_values), (t + 3,), generator=g)
    slots = torch.tensor(slot_values, dtype=torch.int32)[pick]
    return tuple(v.to(DEVICE) for v in (x, y, a, b, slots))


@pytest.mark.parametrize(("t", "k", "n", "rank", "num_slots", "slot_values"), [
    (37, 48, 40, 8, 3, [-1, 0, 1, 2]),    # mixed adapters and plain rows, ragged tiles
    (5, 32, 96, 16, 2, [1]),              # every row one adapter (a decode batch)
    (20, 64, 24, 12, 2, [-1]),            # no adapter: y untouched
    (17, 40, 33, 3, 4, [3, -1]),          # a rank below the tile, odd output width
])
def test_matches_reference(t: int, k: int, n: int, rank: int, num_slots: int,
                           slot_values: list[int]) -> None:
    x, y, a, b, slots = _case(t + n, t, k, n, rank, num_slots, torch.float32, slot_values)
    want = lora_apply_ref(x, y.clone(), a, b, slots)
    got = lora_apply_triton(x, y.clone(), a, b, slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = slots[:t] < 0
    assert torch.equal(got[plain], y[plain])  # rows without an adapter: not written
    if (~plain).any():
        assert not torch.allclose(got[~plain], y[~plain])  # the update reached the others


@pytest.mark.parametrize(("k", "split_k"), [(160, 3), (96, 2), (40, 5), (544, 16)])
def test_split_k_sums_its_chunks(k: int, split_k: int) -> None:
    """The shrink split over K (a decode batch's grid on CUDA): chunks of whole ``block_k``
    steps, a ragged last one, more splits asked than chunks exist, mixed slots."""
    x, y, a, b, slots = _case(k + split_k, 6, k, 40, 8, 3, torch.float32, [-1, 0, 1, 2])
    want = lora_apply_ref(x, y.clone(), a, b, slots)
    got = lora_apply_triton(x, y.clone(), a, b, slots, split_k=split_k)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = slots[:6] < 0
    assert torch.equal(got[plain], y[plain])


def test_default_split_fills_a_decode_batch() -> None:
    assert shrink_split(1, 1024, 16, 64, on_cuda=True) == 8
    assert shrink_split(1, 12288, 16, 64, on_cuda=True) == 64
    assert shrink_split(256, 4096, 16, 64, on_cuda=True) == 4
    assert shrink_split(8192, 4096, 16, 64, on_cuda=True) == 1
    assert shrink_split(1, 4096, 16, 64, on_cuda=False) == 1
    with pytest.raises(ValueError, match="split_k"):
        x, y, a, b, slots = _case(0, 2, 32, 8, 4, 1, torch.float32, [0])
        lora_apply_triton(x, y, a, b, slots, split_k=0)


def test_slot_rows_use_their_own_adapter() -> None:
    """Each row's update is its slot's (against a per-row product), on strided inputs."""
    x, y, a, b, slots = _case(7, 9, 32, 48, 4, 3, torch.float32, [0, 1, 2, -1])
    x = torch.cat([x, x], dim=1)[:, ::2]  # a non-contiguous view of the same values
    got = lora_apply_triton(x, y.clone(), a, b, slots)
    for i in range(9):
        s = int(slots[i])
        want = y[i] if s < 0 else y[i] + (x[i] @ a[s].t()) @ b[s].t()
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-5)


def test_bad_shapes_name_what_is_wrong() -> None:
    x, y, a, b, slots = _case(1, 4, 16, 16, 4, 2, torch.float32, [0])
    with pytest.raises(ValueError, match="do not chain"):
        lora_apply_ref(x, y, a[:, :, :8], b, slots)
    with pytest.raises(ValueError, match="slots"):
        lora_apply_triton(x, y, a, b, slots[:2])


@pytest.mark.parametrize("slot_values", [[2], [-1], [0, 1, -1]])
def test_the_cpu_path_is_the_reference(slot_values: list[int]) -> None:
    """The CPU's path (dense products for a batch on one slot) gives the reference's values."""
    x, y, a, b, slots = (t.cpu() for t in _case(5, 11, 24, 20, 4, 3, torch.float32,
                                                  slot_values))
    want = lora_apply_ref(x, y.clone(), a, b, slots)
    torch.testing.assert_close(_lora_apply_cpu(x, y.clone(), a, b, slots), want, rtol=1e-6,
                               atol=1e-6)
