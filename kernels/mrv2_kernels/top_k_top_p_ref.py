"""Plain-torch specification of :mod:`mrv2_kernels.top_k_top_p` (a full sort of every row):
the filter, the order keys its kernels compare, and each row's threshold key, with the
argument checks both paths share."""

from __future__ import annotations

import torch

__all__ = ["check_filter_args", "check_temperature", "order_keys", "scaled",
           "top_k_top_p_keys_ref", "top_k_top_p_ref"]


def check_filter_args(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the argument unless ``logits`` is ``[B, V]`` (``V >= 1``,
    rows contiguous) and ``top_k`` / ``top_p`` are ``[B]``."""
    if logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError(f"logits must be 2-D with contiguous rows, got {tuple(logits.shape)}")
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one column")
    n = logits.shape[0]
    for name, t in (("top_k", top_k), ("top_p", top_p)):
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(t.shape)}")


def top_k_top_p_ref(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Plain-torch specification of :func:`~mrv2_kernels.top_k_top_p.top_k_top_p` (a full
    sort of every row)."""
    check_filter_args(logits, top_k, top_p)
    x = logits.float()
    vocab = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab)).long()
    kth = sorted_x.gather(1, (k - 1)[:, None])
    sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    p = top_p.float()[:, None]
    kept = (~(mass_before >= p) | (p >= 1.0)) & (sorted_x > float("-inf"))
    # Whole tie groups: keep every value >= the smallest value the sorted rule keeps.
    cut = torch.where(kept, sorted_x, float("inf")).amin(dim=-1, keepdim=True)
    sorted_x = sorted_x.masked_fill(sorted_x < cut, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)


def order_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys with the order of the fp32 values ``x`` (signed compare; ``-0.0`` shares
    ``+0.0``'s key): the keys the kernels compare, and
    :func:`~mrv2_kernels.top_k_top_p.top_k_top_p_keys` returns."""
    b = x.float().view(torch.int32)
    key = torch.where(b < 0, b ^ 0x7FFFFFFF, b)
    return torch.where(x == 0, 0, key)


def scaled(logits: torch.Tensor, temperature: torch.Tensor | None) -> torch.Tensor:
    """``logits`` as float32, divided by ``temperature`` (``[B]``) when given."""
    x = logits.float()
    return x if temperature is None else x / temperature.float().view(-1, 1)


def _active(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows a filter may cut (the kernel's ``kact | pact``): top-k below the number of finite
    values, or top-p below 1 over at least one finite value."""
    finite = (x > float("-inf")).sum(dim=1)
    return ((top_k >= 1) & (top_k < finite)) | ((top_p < 1.0) & (finite > 0))


def top_k_top_p_keys_ref(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
    temperature: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch specification of
    :func:`~mrv2_kernels.top_k_top_p.top_k_top_p_keys`: the least order key the
    reference keeps in each row; ``-2**31`` for rows no filter cuts, ``2**31`` for rows it
    empties (``top_p <= 0``)."""
    x = scaled(logits, temperature)
    kept = torch.isfinite(top_k_top_p_ref(x, top_k, top_p))
    keys = torch.where(kept, order_keys(x).long(), 2**31).amin(dim=1)
    return torch.where(_active(x, top_k, top_p), keys, -(2**31))


def check_temperature(logits: torch.Tensor, temperature: torch.Tensor | None) -> None:
    """Raise ``ValueError`` unless ``temperature`` is None or float32 ``[B]``."""
    if temperature is not None and (temperature.shape != (logits.shape[0],)
                                    or temperature.dtype != torch.float32):
        raise ValueError(f"temperature must be float32 of shape ({logits.shape[0]},), got "
                         f"{temperature.dtype} {tuple(temperature.shape)}")
