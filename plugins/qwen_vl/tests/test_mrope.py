"""M-RoPE against HF transformers, for Qwen2.5-VL and Qwen3-VL: positions (``get_rope_index``)
and the rotation (chunked and interleaved frequency layouts)."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import transformers
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf
from transformers.models.qwen3_vl import modeling_qwen3_vl as hf3

from mrv2_qwen_vl.mrope import (
    ImageGrid,
    MRopeTable,
    MRotaryEmbedding,
    frequency_components,
    get_mrope,
    mrope_positions,
    mrope_positions_ref,
)

MERGE = 2
IMAGE = 7  # placeholder token id in these tests


FAMILIES = {  # config class, HF model class (get_rope_index), rotary class
    "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, hf.Qwen2_5_VLModel, hf.Qwen2_5_VLRotaryEmbedding,
                   hf.apply_rotary_pos_emb),
    "qwen3_vl": (transformers.Qwen3VLConfig, hf3.Qwen3VLModel, hf3.Qwen3VLTextRotaryEmbedding,
                 hf3.apply_rotary_pos_emb),
}


def _hf_positions(num_tokens: int, images: list[ImageGrid], family: str
                  ) -> tuple[list[list[int]], int]:
    """HF's ``get_rope_index`` over a prompt with ``images``' placeholder tokens."""
    config_cls, model_cls, _, _ = FAMILIES[family]
    config = config_cls(vision_config={"spatial_merge_size": MERGE})
    types_ = torch.zeros(1, num_tokens, dtype=torch.int32)
    for g in images:
        types_[0, g.offset: g.offset + g.length] = 1
    model = types.SimpleNamespace(
        config=config,
        get_vision_position_ids=lambda *a, **k: model_cls.get_vision_position_ids(None, *a, **k))
    grid = torch.tensor([[g.t, g.h * MERGE, g.w * MERGE] for g in images]) if images else None
    ids = torch.full((1, num_tokens), 3)
    pos, delta = model_cls.get_rope_index(model, ids, types_, image_grid_thw=grid)
    return pos[:, 0].tolist(), int(delta)


CASES: list[list[ImageGrid]] = [
    [],
    [ImageGrid(3, 1, 2, 3)],  # 6 tokens, wider than tall
    [ImageGrid(0, 1, 4, 2)],  # at the very start, taller than wide
    [ImageGrid(2, 1, 2, 2), ImageGrid(9, 1, 3, 5)],  # two images of different sizes
]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("images", CASES, ids=["text", "one", "first", "two"])
def test_positions_match_hf(images: list[ImageGrid], family: str) -> None:
    num_tokens = max([g.offset + g.length for g in images], default=0) + 4
    want, delta = _hf_positions(num_tokens, images, family)
    got, shift = mrope_positions_ref(num_tokens, images)
    assert got == want
    assert shift == delta  # decode tokens: 1-D position + delta in all three components


def test_device_positions_match_the_reference() -> None:
    """Several rows, tokens inside, between and after images, decode positions past the
    prompt and a row without images; unused slots of the table never match."""
    table = MRopeTable(max_rows=6, max_items=3, device=torch.device("cpu"))
    rows_images = {1: CASES[3], 4: CASES[1], 2: []}
    for row, images in rows_images.items():
        table.set_row(row, images)
    positions, rows, want = [], [], []
    for row, images in rows_images.items():
        n = 30
        ref, _ = mrope_positions_ref(n, images)
        for p in torch.randperm(n, generator=torch.Generator().manual_seed(row))[:17].tolist():
            positions.append(p)
            rows.append(row)
            want.append([ref[c][p] for c in range(3)])
    got = mrope_positions(torch.tensor(positions, dtype=torch.int32), torch.tensor(rows),
                          table)
    assert got.tolist() == torch.tensor(want).T.tolist()
    out = torch.full((3, 64), -1, dtype=torch.int64)
    assert torch.equal(mrope_positions(torch.tensor(positions), torch.tensor(rows), table, out),
                       got)
    with pytest.raises(ValueError, match="at most 3"):
        table.set_row(0, [ImageGrid(4 * i, 1, 1, 2) for i in range(4)])


def test_many_items_per_row() -> None:
    """Rows of many items (Qwen3-VL: one per video frame group, text between them) beside a
    row of one and a row rewritten with fewer: every position of each, decode positions
    included, equals the reference (the items found by binary search over the table)."""
    table = MRopeTable(max_rows=3, max_items=48, device=torch.device("cpu"))
    groups = [ImageGrid(3 + 9 * k, 1, 2, 3) for k in range(40)]  # 3 text tokens between
    table.set_row(2, groups[:40])
    table.set_row(0, groups)
    table.set_row(1, [ImageGrid(5, 1, 4, 1)])
    table.set_row(2, groups[:7])  # (its stale slots reset)
    cases = {0: groups, 1: [ImageGrid(5, 1, 4, 1)], 2: groups[:7]}
    for row, images in cases.items():
        n = max(g.offset + g.length for g in images) + 6
        got = mrope_positions(torch.arange(n), torch.full((n,), row), table)
        assert got.tolist() == mrope_positions_ref(n, images)[0]


def _text_config(family: str, section: list[int], **extra: Any) -> Any:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    if family == "qwen3_vl":
        rope["mrope_interleaved"] = True
    config = FAMILIES[family][0](text_config={
        "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "max_position_embeddings": 128, "rope_parameters": rope, **extra})
    return config.text_config


@pytest.mark.parametrize(("family", "section"), [
    ("qwen2_5_vl", [4, 6, 6]), ("qwen3_vl", [6, 5, 5]), ("qwen3_vl", [4, 6, 6])])
def test_rotation_matches_hf(family: str, section: list[int]) -> None:
    """Queries and keys rotated at mixed image / text positions, against HF's rotary
    embedding and ``apply_rotary_pos_emb`` (head_dim 32; Qwen3-VL's frequencies interleaved,
    ``[6, 5, 5]`` shaped like the released ``[24, 20, 20]``)."""
    config = _text_config(family, section)
    _, _, rotary_cls, apply = FAMILIES[family]
    interleaved = family == "qwen3_vl"
    rope = get_mrope(config, 32, interleaved=interleaved)
    assert isinstance(rope, MRotaryEmbedding) and rope.mrope_section == section
    assert rope.interleaved == interleaved
    ref, _ = mrope_positions_ref(24, CASES[3])
    positions = torch.tensor(ref)  # [3, 24]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(24, 2 * 32, generator=gen)
    k = torch.randn(24, 1 * 32, generator=gen)
    cos, sin = rotary_cls(config)(q, positions[:, None, :])
    q_want, k_want = apply(q.view(1, 24, 2, 32).transpose(1, 2),
                           k.view(1, 24, 1, 32).transpose(1, 2), cos, sin)
    q_got, k_got = rope(positions, q.clone(), k.clone())
    torch.testing.assert_close(q_got.reshape(24, 2, 32), q_want[0].transpose(0, 1),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_got.reshape(24, 1, 32), k_want[0].transpose(0, 1),
                               rtol=1e-5, atol=1e-5)
    # the other layout rotates image tokens differently
    other = MRotaryEmbedding(32, 128, section, interleaved=not interleaved)
    assert not torch.allclose(other(positions, q.clone(), k.clone())[0], q_got, atol=1e-3)
    # text-only positions: M-RoPE is plain RoPE
    flat = torch.arange(24)
    plain = rope(flat, q.clone(), k.clone())
    as_3d = rope(flat.expand(3, -1), q.clone(), k.clone())
    torch.testing.assert_close(plain[0], as_3d[0], rtol=1e-6, atol=1e-6)


def test_yarn_table_reaches_the_derived_context() -> None:
    """M-RoPE with YaRN (Qwen2.5-VL's long-context recipe): the table reaches
    ``original_max_position_embeddings * factor`` past ``max_position_embeddings``, its rows
    below the same as a table of ``max_position_embeddings`` rows."""
    config = _text_config("qwen2_5_vl", [4, 6, 6])
    config.rope_parameters = {**config.rope_parameters, "rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 128}
    rope = get_mrope(config, 32)
    table = rope._table(torch.device("cpu"))
    assert table.shape[0] == 512 and rope.max_position == 128
    short = MRotaryEmbedding(32, 128, [4, 6, 6], 10000.0, rope.scaling)
    assert torch.equal(table[:128], short._table(torch.device("cpu")))


def test_interleaved_layout() -> None:
    """The released Qwen3-VL ``[24, 20, 20]`` over 64 frequencies: t h w repeated 20 times,
    then t t t t (HF's ``recomposition_frequencies``)."""
    got = frequency_components([24, 20, 20], interleaved=True).tolist()
    assert got == [0, 1, 2] * 20 + [0] * 4
    assert frequency_components([2, 3, 3], interleaved=False).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]


def test_bad_section_names_the_field() -> None:
    with pytest.raises(ValueError, match="mrope_section"):
        MRotaryEmbedding(32, 64, [4, 4, 4])
