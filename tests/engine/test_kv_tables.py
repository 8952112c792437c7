"""Block tables of their own for sliding-window layers: the layout the runner plans
(:func:`mrv2.runner.kv_tables.plan_tables`), the tensors its tables share, and the prefix
cache's hits through a sliding table (:class:`mrv2.engine.block_tables.BlockTables`). The
scheduler's use of them is checked by ``test_scheduler_property.py``, the engine's by
``test_sliding_window_models.py``."""

from __future__ import annotations

import pytest
import torch

from mrv2.contract.kv_cache import LatentKVSpec, PagedKVSpec
from mrv2.contract.params import SamplingParams
from mrv2.engine.block_manager import BlockManager, hash_block
from mrv2.engine.block_tables import BlockTables, table_key
from mrv2.engine.request import Request
from mrv2.plugins import get_plugin_manager
from mrv2.runner.kv_cache import KVCaches
from mrv2.runner.kv_tables import (
    MAX_TABLES,
    SLIDING_TABLES_ENV_VAR,
    KVTableLayout,
    plan_tables,
    without_windows,
)


def specs(*windows: int | None) -> dict[int, PagedKVSpec]:
    return {i: PagedKVSpec(2, 8, w) for i, w in enumerate(windows)}


def test_layouts() -> None:
    # gpt-oss: alternating sliding (128) and full layers -> two tables of 2, tensors shared
    gpt_oss = plan_tables(specs(128, None, 128, None), 16, 131072)
    assert gpt_oss == KVTableLayout((None, 128), (1, 0, 1, 0), (0, 0, 1, 1))
    # Gemma 3: five sliding layers per full one -> the full table, then sliding ones of 2
    gemma = plan_tables(specs(*([512] * 5 + [None]) * 2), 16, 32768)
    assert gemma.windows == (None, 512, 512, 512, 512, 512)
    assert gemma.num_slots == 2 and gemma.layer_tables[5] == 0 and gemma.layer_tables[11] == 0
    assert sorted(zip(gemma.layer_tables, gemma.layer_slots, strict=True)) == sorted(
        {(t, j) for t in range(6) for j in range(2)})  # every (table, slot) once: no padding
    # sliding layers only (Mistral): one table that frees
    assert plan_tables(specs(64, 64, 64), 16, 4096) == KVTableLayout((64,), (0, 0, 0), (0, 1, 2))
    # a padded last table: 2 full, 3 sliding -> tables of 2, the last sliding one half empty
    padded = plan_tables(specs(None, 8, None, 8, 8), 4, 1024)
    assert padded.windows == (None, 8, 8) and padded.num_slots == 2


@pytest.mark.parametrize("case", ["no window", "short max_model_len", "layouts differ",
                                  "too many tables", "switched off", "lone sliding layer"])
def test_one_table_where_it_saves_nothing(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    layer_specs: dict[int, PagedKVSpec | LatentKVSpec] = dict(specs(None, 32))
    max_model_len = 4096
    if case == "no window":
        layer_specs = dict(specs(None, None))
    elif case == "short max_model_len":
        max_model_len = 32  # the window is the whole context
    elif case == "layouts differ":
        layer_specs[1] = PagedKVSpec(4, 8, 32)
    elif case == "too many tables":
        layer_specs = dict(specs(None, *[32] * MAX_TABLES))
    elif case == "switched off":
        monkeypatch.setenv(SLIDING_TABLES_ENV_VAR, "0")
    else:  # one sliding layer padded to a table of 9 costs more than it frees at 64 tokens
        layer_specs = dict(specs(*[None] * 9, 32))
        max_model_len = 64
    assert plan_tables(layer_specs, 16, max_model_len) == KVTableLayout.single(len(layer_specs))


def test_drafter_layers_read_table_0() -> None:
    assert without_windows(specs(8, None)) == specs(None, None)


def test_shared_tensors_and_block_bytes() -> None:
    layer_specs = specs(16, None, 16, None)
    registries = get_plugin_manager().registries
    one = KVCaches(layer_specs, registries, torch.device("cpu"), None)
    two = KVCaches(layer_specs, registries, torch.device("cpu"), None)
    two.layout = plan_tables(layer_specs, 4, 1024)
    per_layer = layer_specs[0].bytes_per_block(4, torch.float32)
    assert one.bytes_per_block(4, torch.float32) == 4 * per_layer
    assert two.bytes_per_block(4, torch.float32) == 2 * per_layer
    two.allocate(5, 4, torch.float32, torch.device("cpu"))
    t = two.tensors
    assert t[0] is t[1] and t[2] is t[3] and t[0] is not t[2]
    assert t[0].shape == (2, 5, 4, 2, 8)


def _request(tokens: list[int]) -> Request:
    return Request(req_id="r", prompt_token_ids=tokens, sampling_params=SamplingParams(),
                   seed=0, eos_token_ids=frozenset(), max_tokens=4)


def test_prefix_hit_through_a_sliding_table() -> None:
    """20 cached tokens (5 blocks of 4) of a (full, window 6) model: a hit needs the full
    table's blocks 0-4 and the sliding table's 3-4 (position 20 sees keys 15-20)."""
    blocks = BlockManager(32, 4)
    tables = BlockTables(blocks, (None, 6))
    tokens = list(range(2, 25))
    first = _request(tokens)
    tables.take(first, [[], []], [0, 0], 20)
    first.num_computed_tokens = 20
    hashes = first.update_block_hashes(4)
    for i in range(5):
        tables.cache(first, i, hashes[i])
    assert tables.free_outside_windows(first) == 3  # sliding blocks 0-2: out of the window
    assert first.held_from == [0, 3]
    tables.release(first)
    assert blocks.num_free_blocks == 32

    hit, held_from = tables.find_prefix(hashes[:5])
    assert held_from == [0, 3] and len(hit[0]) == len(hit[1]) == 5
    assert hit[0] == [blocks.cached_block(h) for h in hashes[:5]]
    assert hit[1][3:] == [blocks.cached_block(table_key(h, 1)) for h in hashes[3:5]]
    # without the sliding table's block 4 the hit stops where its window is still held:
    # 4 blocks (position 16 sees keys 11-16: sliding blocks 2-3; block 2 is cached too)
    del blocks._cached[table_key(hashes[4], 1)]
    hit, held_from = tables.find_prefix(hashes[:5])
    assert len(hit[0]) == 4 and held_from == [0, 2]
    # with its block 2 gone as well: 4 and 3 blocks lack it (their windows start at sliding
    # blocks 2 and 1), 2 blocks do not (position 8 sees keys 3-8: sliding blocks 0-1)
    del blocks._cached[table_key(hashes[2], 1)]
    hit, held_from = tables.find_prefix(hashes[:5])
    assert len(hit[0]) == 2 and held_from == [0, 0]

    second = _request(tokens)
    tables.take(second, hit, held_from, 12)
    assert len(second.block_ids) == len(second.extra_block_ids[0]) == 3
    assert hash_block(None, tokens[:4]) == hashes[0]
