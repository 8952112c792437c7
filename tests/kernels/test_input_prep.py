"""prepare_inputs / post_update: Triton (interpreted on CPU) against the torch reference."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

try:
    import mrv2_kernels  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from mrv2_kernels import (
    post_update,
    post_update_ref,
    post_update_triton,
    prepare_inputs,
    prepare_inputs_ref,
    prepare_inputs_triton,
    use_triton,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

I32 = torch.int32
I64 = torch.int64


@dataclass
class Case:
    """One random state table plus one scheduled step on it."""

    token_ids: torch.Tensor
    num_computed: torch.Tensor
    block_table: torch.Tensor
    block_size: int
    idx_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    num_reqs: int
    num_batch: int
    num_tokens_pad: int
    num_block_cols: int
    out_cols: int


def make_case(
    seed: int,
    block_size: int,
    num_reqs: int = 4,
    num_batch: int = 6,
    pad_tokens: int = 5,
    rows: int = 6,
    max_model_len: int = 64,
    max_qlen: int = 24,
    allow_empty: bool = False,
) -> Case:
    """Random table; ``num_reqs`` requests on distinct rows, padded to ``num_batch`` entries."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = -(-max_model_len // block_size) + 1
    token_ids = torch.randint(1, 100_000, (rows, max_model_len), generator=g, dtype=I32)
    num_computed = torch.randint(0, max_model_len // 2, (rows,), generator=g, dtype=I32)
    block_table = torch.randint(1, 5_000, (rows, max_blocks), generator=g, dtype=I32)
    req_rows = torch.randperm(rows, generator=g)[:num_reqs]
    qlens = []
    for row in req_rows.tolist():
        room = max_model_len - int(num_computed[row])
        lo = 0 if allow_empty else 1
        qlens.append(int(torch.randint(lo, min(room, max_qlen) + 1, (1,), generator=g)))
    if allow_empty and num_reqs > 1:
        qlens[1] = 0
    n = sum(qlens)
    # Padding entries hold junk that the ops must ignore.
    junk_rows = torch.randint(0, rows, (num_batch - num_reqs,), generator=g)
    idx_mapping = torch.cat([req_rows, junk_rows]).to(I32)
    qsl = torch.tensor([0, *torch.tensor(qlens, dtype=I64).cumsum(0).tolist()], dtype=I32)
    qsl = torch.cat([qsl, torch.full((num_batch - num_reqs,), n + 3, dtype=I32)])
    cols = int(torch.randint(1, max_blocks + 1, (1,), generator=g))
    return Case(
        token_ids.to(DEVICE),
        num_computed.to(DEVICE),
        block_table.to(DEVICE),
        block_size,
        idx_mapping.to(DEVICE),
        qsl.to(DEVICE),
        num_reqs,
        num_batch,
        n + pad_tokens,
        cols,
        max_blocks + 2,
    )


def poisoned_outputs(c: Case) -> dict[str, torch.Tensor]:
    """Output buffers filled with junk so unwritten elements show up."""
    t, b = c.num_tokens_pad, c.num_batch
    return {
        "input_ids": torch.full((t,), -7, dtype=I32, device=DEVICE),
        "positions": torch.full((t,), 777, dtype=I64, device=DEVICE),
        "slot_mapping": torch.full((t,), 777, dtype=I64, device=DEVICE),
        "seq_lens": torch.full((b,), -7, dtype=I32, device=DEVICE),
        "block_table_out": torch.full((b, c.out_cols), 777, dtype=I32, device=DEVICE),
    }


def run_prepare(fn: object, c: Case, **kw: int) -> dict[str, torch.Tensor]:
    o = poisoned_outputs(c)
    fn(  # type: ignore[operator]
        c.idx_mapping,
        c.query_start_loc,
        c.num_reqs,
        c.token_ids,
        c.num_computed,
        c.block_table,
        c.block_size,
        o["input_ids"],
        o["positions"],
        o["slot_mapping"],
        o["seq_lens"],
        o["block_table_out"],
        c.num_block_cols,
        **kw,
    )
    return o


def loop_expected(c: Case) -> dict[str, torch.Tensor]:
    """The spec written as a plain Python loop (independent of the vectorized reference)."""
    o = poisoned_outputs(c)
    o = {k: v.cpu() for k, v in o.items()}
    tok, nc, bt = c.token_ids.cpu(), c.num_computed.cpu(), c.block_table.cpu()
    idx, qsl = c.idx_mapping.cpu().tolist(), c.query_start_loc.cpu().tolist()
    o["input_ids"][:] = 0
    o["positions"][:] = 0
    o["slot_mapping"][:] = -1
    for i in range(c.num_batch):
        o["seq_lens"][i] = 0
        for col in range(c.num_block_cols):
            o["block_table_out"][i, col] = 0
    for i in range(c.num_reqs):
        row = idx[i]
        for t in range(qsl[i], qsl[i + 1]):
            p = int(nc[row]) + t - qsl[i]
            o["input_ids"][t] = tok[row, p]
            o["positions"][t] = p
            o["slot_mapping"][t] = int(bt[row, p // c.block_size]) * c.block_size + (
                p % c.block_size
            )
        o["seq_lens"][i] = int(nc[row]) + qsl[i + 1] - qsl[i]
        for col in range(c.num_block_cols):
            o["block_table_out"][i, col] = bt[row, col]
    return o


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k].cpu(), b[k].cpu()), f"{k}:\n{a[k]}\n!=\n{b[k]}"


@pytest.mark.parametrize("block_size", [4, 16])
def test_ref_matches_python_loop(block_size: int) -> None:
    c = make_case(seed=block_size, block_size=block_size)
    assert_same(run_prepare(prepare_inputs_ref, c), loop_expected(c))


@pytest.mark.parametrize(
    ("seed", "block_size", "kw"),
    [
        (0, 4, {}),
        (1, 16, {}),
        (2, 4, {"allow_empty": True}),
        (3, 16, {"num_reqs": 6, "num_batch": 6, "pad_tokens": 0}),
        (4, 4, {"num_reqs": 0, "num_batch": 3, "pad_tokens": 9}),
    ],
)
def test_prepare_inputs_triton_matches_ref(seed: int, block_size: int, kw: dict) -> None:
    c = make_case(seed=seed, block_size=block_size, **kw)
    want = run_prepare(prepare_inputs_ref, c)
    assert_same(run_prepare(prepare_inputs_triton, c), want)
    if kw.get("num_reqs", 4):
        assert (want["input_ids"][: int(c.query_start_loc[c.num_reqs])] != 0).all()


def test_prepare_inputs_small_tiles() -> None:
    """Requests longer than a tile and block tables wider than a tile loop correctly."""
    c = make_case(seed=5, block_size=4, num_reqs=3, num_batch=4, pad_tokens=19, max_qlen=40)
    assert int((c.query_start_loc[1:4] - c.query_start_loc[:3]).max()) > 8
    c.num_block_cols = c.block_table.shape[1]
    want = loop_expected(c)
    assert_same(run_prepare(prepare_inputs_triton, c, block_t=8, block_c=4), want)


def test_prepare_inputs_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    c = make_case(seed=6, block_size=16)
    want = loop_expected(c)
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    assert use_triton(c.token_ids)
    assert_same(run_prepare(prepare_inputs, c), want)
    monkeypatch.setenv("MRV2_KERNELS", "torch")
    assert use_triton(c.token_ids) == (DEVICE == "cuda")
    assert_same(run_prepare(prepare_inputs, c), want)


def _big_stride_table(rows: int, width: int, stride: int) -> torch.Tensor:
    """A ``[rows, width]`` int32 view whose last row starts past element ``2**31``."""
    try:
        base = torch.empty(stride * (rows - 1) + width, dtype=I32, device=DEVICE)
    except (RuntimeError, MemoryError) as e:  # pragma: no cover - depends on the host
        pytest.skip(f"cannot reserve the sparse table: {e}")
    return base.as_strided((rows, width), (stride, 1))


def test_int64_offsets() -> None:
    """row * stride beyond int32 (token table) and slot ids beyond int32 (big block ids)."""
    stride, width, block_size = 2**30 + 7, 32, 16
    token_ids = _big_stride_table(3, width, stride)
    assert 2 * stride > 2**31
    g = torch.Generator().manual_seed(7)
    token_ids.copy_(torch.randint(1, 1000, (3, width), generator=g, dtype=I32).to(DEVICE))
    num_computed = torch.tensor([5, 3, 9], dtype=I32, device=DEVICE)
    num_tokens = torch.tensor([6, 4, 10], dtype=I32, device=DEVICE)
    block_table = torch.tensor([[1, 2], [3, 4], [2**28 + 1, 2**28 + 5]], dtype=I32, device=DEVICE)
    idx = torch.tensor([2, 1], dtype=I32, device=DEVICE)
    qsl = torch.tensor([0, 10, 11], dtype=I32, device=DEVICE)
    c = Case(token_ids, num_computed, block_table, block_size, idx, qsl, 2, 2, 12, 2, 2)
    want = loop_expected(c)
    assert int(want["slot_mapping"][0]) > 2**32
    assert_same(run_prepare(prepare_inputs_triton, c), want)
    assert_same(run_prepare(prepare_inputs_ref, c), want)

    sampled = torch.tensor([[1234, 4321], [5678, 8765]], dtype=I64, device=DEVICE)
    n = torch.tensor([2, 1], dtype=I32, device=DEVICE)
    d = torch.tensor([3, 0], dtype=I32, device=DEVICE)
    post_update_triton(idx, qsl, 2, sampled, n, d, token_ids, num_computed, num_tokens)
    assert token_ids[2, 16:18].tolist() == [1234, 4321] and int(token_ids[1, 4]) == 5678
    assert num_computed.tolist() == [5, 4, 17] and num_tokens.tolist() == [6, 5, 18]


# ----------------------------------------------------------------------------- post_update


@dataclass
class Update:
    """One post-sampling update: per-request inputs (plus one junk padding entry) and a table."""

    idx: torch.Tensor
    qsl: torch.Tensor
    num_reqs: int
    sampled: torch.Tensor
    num_sampled: torch.Tensor
    num_drafts: torch.Tensor
    token_ids: torch.Tensor
    num_computed: torch.Tensor
    num_tokens: torch.Tensor

    def args(self) -> tuple:
        return (
            self.idx,
            self.qsl,
            self.num_reqs,
            self.sampled,
            self.num_sampled,
            self.num_drafts,
            self.token_ids,
            self.num_computed,
            self.num_tokens,
        )

    def clone(self) -> Update:
        return Update(*(a.clone() if isinstance(a, torch.Tensor) else a for a in self.args()))


def make_update(
    seed: int,
    num_reqs: int = 6,
    rows: int = 8,
    max_model_len: int = 64,
    width: int = 4,
    spec: bool = True,
) -> Update:
    """Random table and step. With ``spec``: request 0 accepts all its drafts, 1 none, 2 has
    ``n = 0``, 3 accepts all and ends at ``max_model_len`` (its last token falls off), the rest
    random. Without: ``d = 0`` and ``n`` in {0, 1} (request 0 ends at ``max_model_len``)."""
    g = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(1, 100_000, (rows, max_model_len), generator=g, dtype=I32)
    num_computed = torch.randint(0, max_model_len - 20, (rows,), generator=g, dtype=I32)
    num_tokens = torch.randint(1, max_model_len, (rows,), generator=g, dtype=I32)
    req_rows = torch.randperm(rows, generator=g)[:num_reqs]
    qlens = torch.randint(width, 12, (num_reqs,), generator=g)
    if spec:
        drafts = torch.randint(0, width, (num_reqs,), generator=g)
        drafts[[0, 1, 3]] = width - 1
        n = (torch.rand(num_reqs, generator=g) * (drafts + 2)).long().clamp(max=drafts + 1)
        n[0], n[1], n[2], n[3] = drafts[0] + 1, 1, 0, drafts[3] + 1
        end_row = req_rows[3]
    else:
        drafts = torch.zeros(num_reqs, dtype=I64)
        n = (torch.rand(num_reqs, generator=g) < 0.7).long()
        n[:2], n[2] = 1, 0
        end_row = req_rows[0]
    end = int((req_rows == end_row).nonzero())
    num_computed[end_row] = max_model_len - int(qlens[end])
    # Consistent state for the row that reaches the end: every position is a known token.
    num_tokens[end_row] = max_model_len
    qsl = torch.cat([torch.zeros(1, dtype=I64), qlens.cumsum(0)]).to(I32)
    sampled = torch.randint(1, 100_000, (num_reqs, width), generator=g, dtype=I64)
    # A junk padding entry pointing at a live row, with a token to write.
    idx = torch.cat([req_rows, req_rows[:1]]).to(I32)
    qsl = torch.cat([qsl, qsl[-1:] + 4])
    sampled = torch.cat([sampled, torch.full((1, width), 99, dtype=I64)])
    n = torch.cat([n, torch.ones(1, dtype=I64)]).to(I32)
    drafts = torch.cat([drafts, torch.zeros(1, dtype=I64)]).to(I32)
    return Update(
        idx.to(DEVICE),
        qsl.to(DEVICE),
        num_reqs,
        sampled.to(DEVICE),
        n.to(DEVICE),
        drafts.to(DEVICE),
        token_ids.to(DEVICE),
        num_computed.to(DEVICE),
        num_tokens.to(DEVICE),
    )


def post_update_loop(u: Update) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec as a plain Python loop."""
    tok, nc, nt = (
        u.token_ids.cpu().clone(),
        u.num_computed.cpu().clone(),
        u.num_tokens.cpu().clone(),
    )
    length = tok.shape[1]
    for i in range(u.num_reqs):
        row = int(u.idx[i])
        qlen = int(u.qsl[i + 1]) - int(u.qsl[i])
        if qlen == 0:  # a CUDA graph's padding request
            continue
        d, n = int(u.num_drafts[i]), int(u.num_sampled[i])
        base = int(nc[row]) + qlen - d
        nc[row] = base + max(n - 1, 0)
        for j in range(n):
            if base + j < length:
                tok[row, base + j] = int(u.sampled[i, j])
        if n > 0:
            nt[row] = min(base + n, length)
    return tok, nc, nt


def post_update_old_loop(u: Update) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pre-speculation semantics (one token per request, ``do_sample = n``)."""
    tok, nc, nt = (
        u.token_ids.cpu().clone(),
        u.num_computed.cpu().clone(),
        u.num_tokens.cpu().clone(),
    )
    for i in range(u.num_reqs):
        row = int(u.idx[i])
        new = int(nc[row]) + int(u.qsl[i + 1]) - int(u.qsl[i])
        nc[row] = new
        if int(u.num_sampled[i]) and new < tok.shape[1]:
            tok[row, new] = int(u.sampled[i, 0])
            nt[row] = new + 1
    return tok, nc, nt


POST_UPDATE = {"ref": post_update_ref, "triton": post_update_triton, "dispatch": post_update}


def run_update(impl: str, u: Update, monkeypatch: pytest.MonkeyPatch) -> Update:
    u = u.clone()
    if impl == "dispatch":
        monkeypatch.setenv("MRV2_KERNELS", "triton")
    POST_UPDATE[impl](*u.args())
    return u


def assert_table(u: Update, want: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(u.token_ids.cpu(), want[0])
    assert torch.equal(u.num_computed.cpu(), want[1])
    assert torch.equal(u.num_tokens.cpu(), want[2])


@pytest.mark.parametrize(("seed", "width"), [(0, 4), (1, 3)])
@pytest.mark.parametrize("impl", ["ref", "triton", "dispatch"])
def test_post_update_spec(
    seed: int, width: int, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    u = make_update(seed, width=width)
    want = post_update_loop(u)
    got = run_update(impl, u, monkeypatch)
    assert_table(got, want)
    # The constructed cases did what they claim.
    length = u.token_ids.shape[1]
    rows = u.idx.cpu().tolist()
    d = u.num_drafts.cpu().tolist()
    before_nc = u.num_computed.cpu()
    for i, accepted in ((0, d[0]), (1, 0), (2, 0)):
        qlen = int(u.qsl[i + 1]) - int(u.qsl[i])
        assert int(want[1][rows[i]]) == int(before_nc[rows[i]]) + qlen - d[i] + accepted
    assert int(want[2][rows[2]]) == int(u.num_tokens[rows[2]])  # n = 0: num_tokens untouched
    end = rows[3]  # accepted everything, the last sampled token would land at max_model_len
    assert int(want[1][end]) == length and int(want[2][end]) == length
    assert int(want[0][end, length - 1]) == int(u.sampled[3, width - 2])
    assert (got.token_ids != u.token_ids).sum() >= 1  # something was written


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_post_update_without_drafts_is_the_old_update(
    impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    u = make_update(2, width=1, spec=False)
    want = post_update_old_loop(u)
    assert_table(run_update(impl, u, monkeypatch), want)
    assert_table(run_update(impl, u, monkeypatch), post_update_loop(u))
    # Wider sampled rows: the extra columns are ignored when n <= 1.
    wide = u.clone()
    wide.sampled = torch.cat([u.sampled, torch.full_like(u.sampled, -5)], dim=1)
    assert_table(run_update(impl, wide, monkeypatch), want)


def test_post_update_no_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    u = make_update(3)
    u.num_reqs = 0
    for impl in ("ref", "triton"):
        assert_table(run_update(impl, u, monkeypatch), post_update_loop(u))


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_post_update_padding_requests_change_nothing(
    impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode graph's sampling tail updates its whole padded size: the padding requests have
    empty queries and stale ``idx_mapping`` entries, here pointing at live rows of the same
    batch with a token to write; the table must come out as from the real requests alone."""
    u = make_update(4, spec=False)
    b = u.num_reqs
    padded = u.clone()
    padded.num_reqs = b + 3
    padded.idx = torch.cat([u.idx[:b], u.idx[:3]])
    padded.qsl = torch.cat([u.qsl[: b + 1], u.qsl[b : b + 1].repeat(3)])
    padded.sampled = torch.cat([u.sampled[:b], torch.full((3, u.sampled.shape[1]), 7,
                                                          dtype=I64, device=u.sampled.device)])
    padded.num_sampled = torch.cat([u.num_sampled[:b], torch.ones_like(u.num_sampled[:3])])
    padded.num_drafts = torch.cat([u.num_drafts[:b], torch.zeros_like(u.num_drafts[:3])])
    want = post_update_loop(u)
    assert int(u.num_sampled[0]) == 1  # a padding entry shares its row with a sampling request
    assert_table(run_update(impl, padded, monkeypatch), want)
