"""Block tables of their own for sliding-window and chunked-attention layers: the layout the
runner plans (:func:`mrv2.runner.kv_tables.plan_tables`), the tensors its tables share, what
a chunked table frees and when, and the prefix cache's hits through a sliding or chunked
table (:class:`mrv2.engine.block_tables.BlockTables`). The
scheduler's use of them is checked by ``test_scheduler_property.py``, the engine's by
``test_sliding_window_models.py``."""

from __future__ import annotations

import pytest
import torch

from mrv2.contract.kv_cache import (
    AttentionChunk,
    LatentKVSpec,
    PagedKVSpec,
    first_query_past,
    first_visible,
)
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
    blocks_per_request,
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
    elif case == "layouts differ":  # (paged KV of other shapes shares through pages)
        layer_specs[1] = LatentKVSpec(32)
    elif case == "too many tables":
        layer_specs = dict(specs(None, *[32] * MAX_TABLES))
    elif case == "switched off":
        monkeypatch.setenv(SLIDING_TABLES_ENV_VAR, "0")
    else:  # one sliding layer padded to a table of 9 costs more than it frees at 64 tokens
        layer_specs = dict(specs(*[None] * 9, 32))
        max_model_len = 64
    assert plan_tables(layer_specs, 16, max_model_len) == KVTableLayout.single(len(layer_specs))


def chunked(*chunks: int | None) -> dict[int, PagedKVSpec]:
    return {i: PagedKVSpec(2, 8, None, c) for i, c in enumerate(chunks)}


def test_chunked_layouts() -> None:
    """Llama 4 Scout's pattern (three chunked layers of 8,192 per full one) at 131,072
    tokens: the full table, then chunked ones of as many layers, each holding a chunk's 512
    blocks of 16; a chunk and a sliding window of the same size never share a table."""
    scout = plan_tables(chunked(*([8192] * 3 + [None]) * 4), 16, 131072)
    chunk = AttentionChunk(8192)
    assert scout.windows == (None, chunk, chunk, chunk)
    assert scout.layer_tables[3::4] == (0,) * 4 and scout.num_slots == 4
    assert blocks_per_request(scout.windows, 16, 131072) == 8192 + 3 * 512
    assert blocks_per_request((AttentionChunk(10), 10), 4, 1000) == 4 + 4  # (10: straddles)
    mixed = {**chunked(None, 64), 2: PagedKVSpec(2, 8, 64), 3: PagedKVSpec(2, 8, 64)}
    layout = plan_tables(mixed, 16, 4096)
    assert layout.windows == (None, AttentionChunk(64), 64, 64)  # (tables of one layer)
    sixty_four = 64
    assert AttentionChunk(64) != sixty_four and sixty_four != AttentionChunk(64)
    assert len({64, AttentionChunk(64)}) == 2 and AttentionChunk(64) == AttentionChunk(64)


def test_first_visible_key() -> None:
    """What a query sees against a brute-force mask, for sliding windows and chunks; the
    first query past a key is the first whose first visible key is at least it."""
    for window in (1, 3, 8, AttentionChunk(1), AttentionChunk(3), AttentionChunk(8), None):
        for position in range(40):
            if window is None:
                seen = list(range(position + 1))
            elif isinstance(window, AttentionChunk):
                seen = [k for k in range(position + 1) if k // window == position // window]
            else:
                seen = [k for k in range(position + 1) if k > position - window]
            assert first_visible(position, window) == seen[0], (window, position)
        if window is not None:
            for key in range(1, 30):
                past = first_query_past(key, window)
                assert first_visible(past, window) >= key > first_visible(past - 1, window)


def test_paged_spec_refuses_bad_windows() -> None:
    """A window or chunk below 1, or both at once (a plugin may build the spec itself): a
    ValueError naming the field, before a table is planned."""
    for kwargs, message in [({"sliding_window": 0}, "sliding_window must be at least 1"),
                            ({"attention_chunk": 0}, "attention_chunk must be at least 1"),
                            ({"sliding_window": 8, "attention_chunk": 4}, "not both")]:
        with pytest.raises(ValueError, match=message):
            PagedKVSpec(2, 8, **kwargs)


def test_a_chunked_table_frees_at_chunk_boundaries() -> None:
    """Chunks of 8 over blocks of 4 (a full table, a chunked one): nothing is freed while
    the queries are in the first chunk; crossing into the next frees the first chunk's two
    blocks at once, and ``free_at`` says the count at which the next ones go; with 2 drafts
    of margin, the blocks stay until a query taken back two positions could not see them."""
    for margin, first_free in ((0, 8), (2, 10)):
        blocks = BlockManager(32, 4)
        tables = BlockTables(blocks, (None, AttentionChunk(8)), margin)
        request = _request(list(range(2, 30)))
        tables.take(request, [[], []], [0, 0], 4)
        freed_at = {}
        for computed in range(1, 27):
            tables.allocate(request, computed + 1)
            request.num_computed_tokens = computed
            if tables.may_free(request):
                freed_at[computed] = tables.free_outside_windows(request)
            held = request.held_from[1] if request.held_from else 0
            # the table holds every block from the chunk of the earliest next query on
            assert held == first_visible(computed - margin, AttentionChunk(8)) // 4
        assert freed_at == {first_free: 2, first_free + 8: 2, first_free + 16: 2}, margin
        tables.release(request)
        assert blocks.num_free_blocks == 32


def test_prefix_hit_through_a_chunked_table() -> None:
    """24 cached tokens (6 blocks of 4) of a (full, chunks of 8) model: a hit of 6 blocks
    needs the chunked table's blocks from position 24's chunk on (none of them: 24 starts a
    chunk); of 5 blocks (position 20: chunk 16-23), its block 4."""
    blocks = BlockManager(32, 4)
    tables = BlockTables(blocks, (None, AttentionChunk(8)))
    first = _request(list(range(2, 30)))
    tables.take(first, [[], []], [0, 0], 24)
    first.num_computed_tokens = 24
    hashes = first.update_block_hashes(4)
    for i in range(6):
        tables.cache(first, i, hashes[i])
    assert tables.free_outside_windows(first) == 6  # position 24 sees none of chunks 0-2
    assert first.held_from == [0, 6]
    tables.release(first)
    hit, held_from = tables.find_prefix(hashes[:6])
    assert held_from == [0, 6] and len(hit[0]) == 6 and hit[1] == [0] * 6
    hit, held_from = tables.find_prefix(hashes[:5])  # (the chunked table's block 4 is cached)
    assert held_from == [0, 4] and hit[1][4] == blocks.cached_block(table_key(hashes[4], 1))
    del blocks._cached[table_key(hashes[4], 1)]  # without it: 4 blocks (16 starts a chunk)
    hit, held_from = tables.find_prefix(hashes[:5])
    assert len(hit[0]) == 4 and held_from == [0, 4]


def test_layouts_that_differ_share_pages() -> None:
    """Gemma 4's pattern: wide global layers (4 kv heads of 16) among narrower sliding ones (2
    of 8, window 32): tables still, each slot's tensor a view of one buffer of pages as large
    as the widest layer's block, which is what a block id costs; the views address their own
    blocks (a write through one lands in the buffer at its page)."""
    layer_specs = {i: PagedKVSpec(2, 8, 32) for i in range(6)}
    layer_specs[2] = layer_specs[5] = PagedKVSpec(4, 16)
    layout = plan_tables(layer_specs, 4, 1024)
    assert layout.windows == (None, 32, 32)
    assert layout.layer_tables == (1, 1, 0, 2, 2, 0) and layout.layer_slots == (0, 1, 0, 0, 1, 1)
    caches = KVCaches(layer_specs, get_plugin_manager().registries, torch.device("cpu"), None)
    caches.layout = layout
    wide = layer_specs[2].bytes_per_block(4, torch.float32)
    assert caches.bytes_per_block(4, torch.float32) == 2 * wide
    caches.allocate(5, 4, torch.float32, torch.device("cpu"))
    t = caches.tensors
    assert t[2].shape == (2, 5, 4, 4, 16) and t[0].shape == (2, 5, 4, 2, 8)
    assert t[0].untyped_storage().data_ptr() == t[2].untyped_storage().data_ptr()
    assert t[1].untyped_storage().data_ptr() == t[5].untyped_storage().data_ptr()
    assert t[0].untyped_storage().data_ptr() != t[1].untyped_storage().data_ptr()
    t[0][1, 3, 2] = 7.0  # value of block 3, offset 2 of a narrow layer
    page = 4 * 4 * 16
    flat = t[2].as_strided((2 * 5 * page,), (1,), t[2].storage_offset())
    assert (flat[5 * page + 3 * page + 2 * 16 : 5 * page + 3 * page + 3 * 16] == 7.0).all()
    # pages that cost more than they free: a narrow sliding layer beside a wide full one
    assert plan_tables({0: PagedKVSpec(8, 64), 1: PagedKVSpec(1, 8, 32)}, 4, 64) == (
        KVTableLayout.single(2))


def test_drafter_layers_read_table_0() -> None:
    assert without_windows(specs(8, None)) == specs(None, None)
    assert without_windows(chunked(8, None)) == specs(None, None)


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
