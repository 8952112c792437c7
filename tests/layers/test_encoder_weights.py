"""``load_encoder_weights`` / ``under_prefixes``: the copy loop every vision encoder's
``load_weights`` runs — names mapped and skipped, buffers only when asked, a conversion before
the shape check, and errors naming the checkpoint tensor raised before it is copied."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mrv2.layers.weights import load_encoder_weights, under_prefixes


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 4)
        self.register_buffer("scale", torch.ones(4))


def test_maps_skips_and_converts() -> None:
    torch.manual_seed(0)
    tower = _Tower()
    w, b, s = torch.randn(4, 3), torch.randn(4), torch.randn(4)
    target = under_prefixes(("model.tower.", "tower."), strip="model.",
                            skip=lambda n: n.endswith(".unused"))
    assert target("model.tower.proj.weight") == "tower.proj.weight"
    assert target("tower.x.unused") is None and target("lm_head.weight") is None

    def name(ckpt: str) -> str | None:
        rest = target(ckpt)
        return None if rest is None else rest.removeprefix("tower.")

    loaded = load_encoder_weights(
        tower, [("model.tower.proj.weight", w.reshape(2, 6)), ("tower.proj.bias", b),
                ("tower.scale", s), ("model.language_model.x", torch.zeros(1)),
                ("tower.head.unused", torch.zeros(1))],
        name, "test tower", buffers=True,
        convert=lambda n, t: t.reshape(4, 3) if n == "proj.weight" else t)
    assert loaded == {"proj.weight", "proj.bias", "scale"}
    assert torch.equal(tower.proj.weight, w) and torch.equal(tower.proj.bias, b)
    assert torch.equal(tower.scale, s)


def test_errors_name_the_tensor_and_copy_nothing_of_it() -> None:
    tower = _Tower()
    before = tower.proj.weight.detach().clone()
    same = under_prefixes(("tower.",), strip="tower.")
    with pytest.raises(ValueError, match=r"tower\.nope: no parameter 'nope' in the test "
                                         r"tower \(check depth\)"):
        load_encoder_weights(tower, [("tower.nope", torch.zeros(1))], same, "test tower",
                             hint="depth")
    with pytest.raises(ValueError, match=r"tower\.proj\.weight: shape \(3, 4\) != parameter "
                                         r"proj\.weight shape \(4, 3\)"):
        load_encoder_weights(tower, [("tower.proj.weight", torch.randn(3, 4))], same, "t")
    assert torch.equal(tower.proj.weight, before)
    with pytest.raises(ValueError, match="no parameter 'scale'"):  # buffers only when asked
        load_encoder_weights(tower, [("tower.scale", torch.ones(4))], same, "t")
