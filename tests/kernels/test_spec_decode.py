"""ngram_propose / strict_rejection: Triton (interpreted on CPU), the torch reference and a
brute-force pure-Python spec agree."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

try:
    import mrv2_kernels  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from mrv2_kernels.spec_decode import (
    ngram_propose,
    ngram_propose_ref,
    ngram_propose_triton,
    strict_rejection,
    strict_rejection_ref,
    strict_rejection_triton,
    write_drafts,
    write_drafts_ref,
    write_drafts_triton,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

I32 = torch.int32
I64 = torch.int64


# ----------------------------------------------------------------------------- ngram_propose


def ngram_brute(seq: list[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """The spec, literally: (drafts, num_found) for one sequence."""
    t = len(seq)
    best: tuple[int, int] | None = None
    for e in range(1, t):
        length = 0
        while length < min(max_n, e) and seq[e - 1 - length] == seq[t - 1 - length]:
            length += 1
        if length >= min_n and (best is None or (length, e) > best):
            best = (length, e)
    if best is None:
        return [seq[-1]] * k, 0
    e = best[1]
    return [seq[e + j % (t - e)] for j in range(k)], k


def ngram_table(
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    idx: torch.Tensor,
    num_sampled: torch.Tensor,
    num_reqs: int,
    k: int,
    min_n: int,
    max_n: int,
    num_found: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole op by :func:`ngram_brute`: expected (token_ids, num_found)."""
    tok, found = token_ids.cpu().clone(), num_found.cpu().clone()
    width = tok.shape[1]
    for i in range(num_reqs):
        if int(num_sampled[i]) <= 0:
            found[i] = 0
            continue
        row = int(idx[i])
        t = int(num_tokens[row])
        drafts, found[i] = ngram_brute(tok[row, :t].tolist(), k, min_n, max_n)
        for j, d in enumerate(drafts):
            if t + j < width:
                tok[row, t + j] = d
    return tok, found


NGRAM: dict[str, Callable[..., None]] = {
    "ref": ngram_propose_ref,
    "triton": ngram_propose_triton,
    "dispatch": ngram_propose,
}


def run_ngram(
    impl: str,
    token_ids: torch.Tensor,
    num_tokens: torch.Tensor,
    idx: torch.Tensor,
    num_sampled: torch.Tensor,
    num_reqs: int,
    k: int,
    min_n: int,
    max_n: int,
    **kw: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one implementation on copies (``num_found`` poisoned); check against the brute force."""
    tok = token_ids.clone().to(DEVICE)
    found = torch.full((idx.shape[0],), -7, dtype=I32, device=DEVICE)
    args = (num_tokens.to(DEVICE), idx.to(DEVICE), num_sampled.to(DEVICE), num_reqs, k, min_n)
    want = ngram_table(token_ids, num_tokens, idx, num_sampled, num_reqs, k, min_n, max_n, found)
    NGRAM[impl](tok, *args, max_n, found, **kw)
    assert torch.equal(found.cpu(), want[1]), f"{found}\n!=\n{want[1]}"
    assert torch.equal(tok.cpu(), want[0])
    return tok.cpu(), found.cpu()


def one_row(seq: list[int], width: int = 32, fill: int = 999) -> tuple[torch.Tensor, ...]:
    """A 2-row table whose row 1 holds ``seq`` (then ``fill``); one active request on it."""
    tok = torch.full((2, width), fill, dtype=I32)
    tok[0] = torch.arange(width, dtype=I32) + 500
    tok[1, : len(seq)] = torch.tensor(seq, dtype=I32)
    num_tokens = torch.tensor([width // 2, len(seq)], dtype=I32)
    return tok, num_tokens, torch.tensor([1], dtype=I32), torch.tensor([1], dtype=I32)


def drafts_of(impl: str, seq: list[int], k: int, min_n: int, max_n: int) -> tuple[list, int]:
    tok, nt, idx, ns = one_row(seq)
    out, found = run_ngram(impl, tok, nt, idx, ns, 1, k, min_n, max_n)
    assert torch.equal(out[0], tok[0])  # other rows untouched
    return out[1, len(seq) : len(seq) + k].tolist(), int(found[0])


IMPLS = ["ref", "triton"]


@pytest.mark.parametrize("impl", IMPLS)
def test_ngram_repeating_sequence_continues_the_period(impl: str) -> None:
    seq = [5, 6, 7, 8] * 3 + [5, 6]  # last 3: 8 5 6, found ending at e = 6 and e = 10
    assert drafts_of(impl, seq, k=6, min_n=1, max_n=3) == ([7, 8, 5, 6, 7, 8], 6)
    # Period 1: a run of one token keeps proposing it.
    assert drafts_of(impl, [3, 4, 4, 4], k=3, min_n=2, max_n=3) == ([4, 4, 4], 3)


@pytest.mark.parametrize("impl", IMPLS)
def test_ngram_no_match(impl: str) -> None:
    assert drafts_of(impl, [11, 12, 13, 14, 15], k=3, min_n=1, max_n=3) == ([15, 15, 15], 0)
    assert drafts_of(impl, [42], k=2, min_n=1, max_n=2) == ([42, 42], 0)  # T = 1


def test_ngram_empty_active_row_reads_nothing_before_it() -> None:
    """An active request with no tokens (T = 0) proposes nothing and copies its row's first
    entry, as the reference does: the kernel's fallback source T - 1 was -1, a read before
    the row (row 0: before the table; here a poison row) written into the row's drafts."""
    buf = torch.full((3, 8), -1, dtype=I32, device=DEVICE)  # row 0: poison before the table
    tok = buf[1:]
    tok.copy_(torch.arange(100, 116, dtype=I32).view(2, 8))
    nt = torch.tensor([0, 0], dtype=I32, device=DEVICE)
    idx = torch.tensor([0, 1], dtype=I32, device=DEVICE)
    ns = torch.ones(2, dtype=I32, device=DEVICE)
    want, want_found = tok.clone(), torch.zeros(2, dtype=I32, device=DEVICE)
    ngram_propose_ref(want, nt, idx, ns, 2, 3, 1, 2, want_found)
    found = torch.full((2,), -7, dtype=I32, device=DEVICE)
    ngram_propose_triton(tok, nt, idx, ns, 2, 3, 1, 2, found)
    assert found.tolist() == want_found.tolist() == [0, 0]
    assert tok[:, :3].tolist() == [[100] * 3, [108] * 3]
    assert torch.equal(tok, want) and (buf[0] == -1).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_ngram_tie_goes_to_the_most_recent(impl: str) -> None:
    seq = [1, 2, 9, 1, 2, 8, 3, 1, 2]  # [1, 2] ends at e = 2 and e = 5, both length 2
    assert drafts_of(impl, seq, k=2, min_n=1, max_n=3) == ([8, 3], 2)


@pytest.mark.parametrize("impl", IMPLS)
def test_ngram_max_n_caps_the_match(impl: str) -> None:
    seq = [7, 1, 2, 3, 40, 9, 2, 3, 41, 7, 1, 2, 3]  # e = 4: length 4; e = 8: length 2
    assert drafts_of(impl, seq, k=2, min_n=1, max_n=4) == ([40, 9], 2)
    assert drafts_of(impl, seq, k=2, min_n=1, max_n=2) == ([41, 7], 2)  # both capped at 2


@pytest.mark.parametrize("impl", IMPLS)
def test_ngram_min_n_excludes_short_matches(impl: str) -> None:
    seq = [1, 2, 3, 4, 5, 6, 3]  # only [3] recurs (e = 3, length 1)
    assert drafts_of(impl, seq, k=3, min_n=1, max_n=3) == ([4, 5, 6], 3)
    assert drafts_of(impl, seq, k=3, min_n=2, max_n=3) == ([3, 3, 3], 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_ngram_drafts_clipped_at_table_width(impl: str) -> None:
    width = 16
    base = [1, 2, 3, 4] * 4
    for t in (width - 2, width):
        tok, nt, idx, ns = one_row(base[:t], width=width)
        out, found = run_ngram(impl, tok, nt, idx, ns, 1, 4, 1, 2)
        assert int(found[0]) == 4
        assert out[1, :t].tolist() == base[:t]
        assert out[1, t:].tolist() == base[t:width]  # what fits of the period: [3, 4] or []


def random_ngram_case(
    seed: int, rows: int = 7, num_reqs: int = 5, width: int = 48, vocab: int = 3
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(1, vocab + 1, (rows, width), generator=g, dtype=I32)
    num_tokens = torch.randint(1, width + 1, (rows,), generator=g, dtype=I32)
    req_rows = torch.randperm(rows, generator=g)[:num_reqs]
    num_tokens[req_rows[0]] = width - 1  # drafts clipped after one
    num_tokens[req_rows[1]] = 1
    num_sampled = torch.randint(1, 4, (num_reqs,), generator=g, dtype=I32)
    num_sampled[2] = 0  # a mid-prompt chunk: no proposal
    idx = torch.cat([req_rows, req_rows[:1]]).to(I32)  # junk padding entry
    num_sampled = torch.cat([num_sampled, torch.ones(1, dtype=I32)])
    return tok, num_tokens, idx, num_sampled


@pytest.mark.parametrize(
    ("seed", "k", "min_n", "max_n", "kw"),
    [(0, 3, 1, 3, {}), (1, 4, 2, 4, {"block_e": 8}), (2, 1, 1, 1, {}), (3, 5, 3, 5, {})],
)
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_ngram_random(seed: int, k: int, min_n: int, max_n: int, kw: dict, impl: str) -> None:
    tok, nt, idx, ns = random_ngram_case(seed)
    out, found = run_ngram(
        impl, tok, nt, idx, ns, 5, k, min_n, max_n, **(kw if impl == "triton" else {})
    )
    row2 = int(idx[2])
    assert torch.equal(out[row2], tok[row2]) and int(found[2]) == 0  # num_sampled = 0
    assert int(found[5]) == -7  # past num_reqs: untouched


def test_ngram_long_sequence() -> None:
    """T in the thousands: the e-scan crosses many tiles; the best match is in an early one."""
    width, g = 1536, torch.Generator().manual_seed(9)
    tok = torch.randint(100, 100_000, (2, width), generator=g, dtype=I32)
    t = width - 3
    tok[1, 10:15] = tok[1, t - 5 : t]  # the only long match, near the start
    tok[1, 1000:1003] = tok[1, t - 3 : t]  # a shorter, more recent one
    nt = torch.tensor([5, t], dtype=I32)
    idx, ns = torch.tensor([1, 0], dtype=I32), torch.tensor([1, 0], dtype=I32)
    out, found = run_ngram("triton", tok, nt, idx, ns, 2, 3, 2, 5, block_e=256)
    assert found.tolist() == [3, 0]
    assert out[1, t:].tolist() == tok[1, 15:18].tolist()
    out, found = run_ngram("triton", tok, nt, idx, ns, 2, 3, 2, 3)
    assert out[1, t:].tolist() == tok[1, 1003:1006].tolist()


def test_ngram_dispatch_and_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    tok, nt, idx, ns = random_ngram_case(4)
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    run_ngram("dispatch", tok, nt, idx, ns, 5, 2, 1, 2)
    run_ngram("triton", tok, nt, idx, ns, 0, 2, 1, 2)
    monkeypatch.setenv("MRV2_KERNELS", "torch")
    run_ngram("dispatch", tok, nt, idx, ns, 5, 2, 1, 2)
    with pytest.raises(ValueError):
        run_ngram("ref", tok, nt, idx, ns, 5, 2, 3, 2)


# ----------------------------------------------------------------------------- strict_rejection


def rejection_brute(
    target: list[int],
    cu: list[int],
    input_ids: list[int],
    logits_indices: list[int],
    num_reqs: int,
    width: int,
) -> tuple[list[list[int]], list[int]]:
    outs, nums = [], []
    for b in range(num_reqs):
        r0, r1 = cu[b], cu[b + 1]
        if r1 == r0:
            outs.append([-1] * width)
            nums.append(0)
            continue
        m = 0
        while m < r1 - r0 - 1 and target[r0 + m] == input_ids[logits_indices[r0 + m] + 1]:
            m += 1
        outs.append(target[r0 : r0 + m + 1] + [-1] * (width - m - 1))
        nums.append(m + 1)
    return outs, nums


def random_rejection_case(seed: int, num_reqs: int, width: int) -> tuple:
    """Requests with 1 + (0..width-1) logits rows (request 1: none); targets equal the drafts
    for a chosen prefix: request 0 accepts all, request 2 none, others a random prefix."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, width + 1, (num_reqs,), generator=g)
    counts[0] = width
    counts[1] = 0
    counts[2] = max(2, width - 1) if width > 1 else 1  # (at most ``width`` rows per request)
    qlens = counts + torch.randint(0, 3, (num_reqs,), generator=g)  # some prompt tokens before
    qlens[1] = 2
    qsl = torch.cat([torch.zeros(1, dtype=I64), qlens.cumsum(0)])
    input_ids = torch.randint(1, 50, (int(qsl[-1]) + 2,), generator=g, dtype=I32)
    cu = torch.cat([torch.zeros(1, dtype=I64), counts.cumsum(0)])
    n = int(cu[-1])
    logits_indices = torch.cat(
        [qsl[b + 1] - counts[b] + torch.arange(int(counts[b])) for b in range(num_reqs)]
    )
    target = torch.randint(1, 50, (n + 3,), generator=g, dtype=I64)  # + junk rows
    for b in range(num_reqs):
        r0, c = int(cu[b]), int(counts[b])
        accept = {0: c - 1, 2: 0}.get(b, int(torch.randint(0, max(c, 1), (1,), generator=g)))
        drafts = input_ids[logits_indices[r0 : r0 + c - 1] + 1].to(I64)
        target[r0 : r0 + accept] = drafts[:accept]
        if accept < c - 1:
            target[r0 + accept] = drafts[accept] + 100  # force the mismatch
    return target, cu.to(I32), input_ids, logits_indices.to(I32)


REJECTION: dict[str, Callable[..., None]] = {
    "ref": strict_rejection_ref,
    "triton": strict_rejection_triton,
    "dispatch": strict_rejection,
}


@pytest.mark.parametrize(("seed", "num_reqs", "width"), [(0, 6, 4), (1, 5, 3), (2, 4, 1)])
@pytest.mark.parametrize("impl", ["ref", "triton", "dispatch"])
def test_strict_rejection(
    seed: int, num_reqs: int, width: int, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, cu, input_ids, logits_indices = random_rejection_case(seed, num_reqs, width)
    want_out, want_num = rejection_brute(
        target.tolist(),
        cu.tolist(),
        input_ids.tolist(),
        logits_indices.tolist(),
        num_reqs,
        width,
    )
    counts = (cu[1:] - cu[:-1]).tolist()
    assert want_num[0] == counts[0] and want_num[1] == 0 and want_num[2] == 1
    out = torch.full((num_reqs + 1, width), 777, dtype=I64, device=DEVICE)
    num_out = torch.full((num_reqs + 1,), -7, dtype=I32, device=DEVICE)
    if impl == "dispatch":
        monkeypatch.setenv("MRV2_KERNELS", "triton")
    REJECTION[impl](
        target.to(DEVICE),
        cu.to(DEVICE),
        input_ids.to(DEVICE),
        logits_indices.to(DEVICE),
        num_reqs,
        out,
        num_out,
    )
    assert out[:num_reqs].cpu().tolist() == want_out
    assert num_out[:num_reqs].cpu().tolist() == want_num
    assert out[num_reqs].tolist() == [777] * width and int(num_out[num_reqs]) == -7


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_strict_rejection_no_rows(impl: str) -> None:
    """Every request without logits rows (and an empty target): all -1, counts 0."""
    out = torch.full((3, 2), 777, dtype=I64, device=DEVICE)
    num_out = torch.full((3,), -7, dtype=I32, device=DEVICE)
    empty = torch.zeros(0, dtype=I64, device=DEVICE)
    cu = torch.zeros(4, dtype=I32, device=DEVICE)
    REJECTION[impl](empty, cu, empty.to(I32), empty.to(I32), 3, out, num_out)
    assert out.tolist() == [[-1, -1]] * 3 and num_out.tolist() == [0, 0, 0]
    REJECTION[impl](empty, cu, empty.to(I32), empty.to(I32), 0, out[:0], num_out[:0])


def test_strict_rejection_more_rows_than_width() -> None:
    """Past the precondition (a request owns more than ``S`` rows): both paths check only the
    first ``S - 1`` drafts and stay inside the row."""
    target, cu, input_ids, logits_indices = random_rejection_case(3, 4, 5)
    got = []
    for impl in ("ref", "triton"):
        out = torch.full((4, 3), 777, dtype=I64, device=DEVICE)
        num_out = torch.full((4,), -7, dtype=I32, device=DEVICE)
        REJECTION[impl](
            target.to(DEVICE),
            cu.to(DEVICE),
            input_ids.to(DEVICE),
            logits_indices.to(DEVICE),
            4,
            out,
            num_out,
        )
        got.append((out.tolist(), num_out.tolist()))
    assert got[0] == got[1]
    assert got[0][1][0] == 3 and got[0][0][0] == target[:3].tolist()  # accepts all it can


# ----------------------------------------------------------------------------- write_drafts


@pytest.mark.parametrize("impl", [write_drafts_ref, write_drafts_triton, write_drafts])
@pytest.mark.parametrize("table_dtype", [I32, I64])
def test_write_drafts_stores_only_the_valid_entries(
    impl: Callable[..., None], table_dtype: torch.dtype
) -> None:
    """Padding entries name live rows (as a CUDA graph's stale rows do): only valid entries
    land, whatever the order of the duplicates; everything else keeps its value."""
    gen = torch.Generator().manual_seed(3)
    table = torch.randint(0, 1000, (6, 40), generator=gen, dtype=table_dtype).to(DEVICE)
    before = table.clone()
    rows = torch.tensor([4, 1, 3, 4, 1, 4, 0, 1], dtype=I64, device=DEVICE)  # 4 and 1 repeat
    pos = torch.tensor([7, 30, 39, 7, 30, 7, 2, 30], dtype=I64, device=DEVICE)
    drafts = torch.randint(1000, 2000, (8,), generator=gen, dtype=I64).to(DEVICE)
    valid = torch.tensor([1, 1, 0, 0, 0, 0, 1, 0], dtype=torch.bool, device=DEVICE)
    impl(table, rows, pos, drafts, valid)
    expect = before.clone()
    for i in range(8):
        if valid[i]:
            expect[rows[i], pos[i]] = drafts[i].to(table_dtype)
    assert torch.equal(table.cpu(), expect.cpu())


def test_write_drafts_rejects_bad_arguments() -> None:
    table = torch.zeros(2, 4, dtype=I32, device=DEVICE)
    rows = torch.zeros(3, dtype=I64, device=DEVICE)
    with pytest.raises(ValueError, match="valid must be bool"):
        write_drafts(table, rows, rows, rows, rows.to(I32))
    with pytest.raises(ValueError, match=r"pos must be contiguous \[3\]"):
        write_drafts(table, rows, rows[:2], rows, rows.bool())
