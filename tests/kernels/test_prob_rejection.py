"""probabilistic_rejection: Triton (interpreted on CPU) equals the torch reference token for
token; the reference's structure (accepted drafts, bonus, one-hot residual = the sampler's own
sample) holds; and the emitted tokens follow the target distribution in law (chi-square)."""

from __future__ import annotations

import dataclasses
import math
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

from mrv2_kernels.gumbel import gumbel_sample_ref, uniform_hash_ref
from mrv2_kernels.prob_rejection import (
    _uniform_at_ref,
    acceptance_uniform_ref,
    probabilistic_rejection,
    probabilistic_rejection_ref,
    probabilistic_rejection_triton,
)
from mrv2_kernels.spec_decode import strict_rejection_ref

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

I32 = torch.int32
I64 = torch.int64
F32 = torch.float32
NEG_INF = float("-inf")

IMPLS: dict[str, Callable[..., None]] = {
    "ref": probabilistic_rejection_ref,
    "triton": probabilistic_rejection_triton,
    "dispatch": probabilistic_rejection,
}


# ----------------------------------------------------------------------------- random cases


ARG_FIELDS = ("logits", "temperature", "seeds", "positions", "target", "cu", "input_ids",
              "logits_indices")


@dataclasses.dataclass
class Case:
    logits: torch.Tensor
    temperature: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    target: torch.Tensor
    cu: torch.Tensor
    input_ids: torch.Tensor
    logits_indices: torch.Tensor
    draft_probs: torch.Tensor | None
    kinds: list[str]
    width: int

    def args(self) -> tuple:
        return tuple(getattr(self, f) for f in ARG_FIELDS)

    def to(self, device: str) -> Case:
        moved = {f: getattr(self, f).to(device) for f in ARG_FIELDS}
        q = None if self.draft_probs is None else self.draft_probs.to(device)
        return dataclasses.replace(self, draft_probs=q, **moved)

    def drafts(self, b: int) -> list[int]:
        r0, r1 = int(self.cu[b]), int(self.cu[b + 1])
        return [int(self.input_ids[int(self.logits_indices[r]) + 1]) for r in range(r0, r1 - 1)]


def build_case(
    seed: int,
    kinds: list[str],
    width: int = 4,
    vocab: int = 24,
    full_q: bool = True,
    dtype: torch.dtype = F32,
    pad_cols: int = 0,
) -> Case:
    """Requests of the given kinds: ``empty`` (no logits rows), ``nodraft`` (one row),
    ``accept`` (p close to q: all accepted almost surely), ``reject`` (the draft is masked out
    of p: rejected at once), ``greedy`` (temperature 0, a prefix of the drafts equal to the
    argmax), ``random`` (random q and drafts), ``mixed`` (random, one greedy row), ``own``
    (flat logits, each draft the sampler's own sample at its row: a rejection must then emit
    another token)."""
    g = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=g))

    counts = [{"empty": 0, "nodraft": 1, "accept": width}.get(k, randint(2, width + 1))
              for k in kinds]
    qlens = [c + randint(0, 3) for c in counts]
    qsl = [0]
    for ql in qlens:
        qsl.append(qsl[-1] + ql)
    cu = [0]
    for c in counts:
        cu.append(cu[-1] + c)
    n = cu[-1]
    input_ids = torch.randint(0, vocab, (qsl[-1] + 2,), generator=g, dtype=I32)
    logits_indices = torch.tensor(
        [qsl[b + 1] - counts[b] + j for b in range(len(kinds)) for j in range(counts[b])],
        dtype=I32,
    )
    logits = torch.randn(n, vocab, generator=g) * 2
    for r in range(n):  # top-k masks on some rows
        if randint(0, 3) == 0:
            keep = randint(2, vocab // 2)
            logits[r, logits[r].argsort(descending=True)[keep:]] = NEG_INF
    temperature = torch.zeros(n, dtype=F32)
    seeds = torch.zeros(n, dtype=I64)
    positions = torch.zeros(n, dtype=I64)
    q = torch.full((n, vocab), float("nan"), dtype=F32)  # poison: rows never read stay NaN
    drafts: dict[int, int] = {}
    for b, kind in enumerate(kinds):
        r0, c = cu[b], counts[b]
        t = 0.0 if kind == "greedy" else 0.5 + torch.rand(1, generator=g).item()
        temperature[r0 : r0 + c] = t
        seeds[r0 : r0 + c] = int(torch.randint(-(2**62), 2**62, (1,), generator=g))
        positions[r0 : r0 + c] = randint(0, 5000) + torch.arange(c)
        if kind == "mixed" and c > 2:
            temperature[r0 + 1] = 0.0
        for j in range(c - 1):
            r = r0 + j
            if kind == "accept":
                top = int(logits[r].argmax())
                logits[r, top] += 6.0
                x = logits[r] / t
                if full_q:
                    q[r] = torch.softmax(x + 0.1 * torch.randn(vocab, generator=g), 0)
                    drafts[r] = int(torch.multinomial(q[r], 1, generator=g))
                else:
                    drafts[r] = top
            elif kind == "reject":
                drafts[r] = randint(0, vocab)
                logits[r, drafts[r]] = NEG_INF
                q[r] = 0.1 * torch.softmax(torch.randn(vocab, generator=g), 0)
                q[r, drafts[r]] += 0.9
            elif kind == "own":
                logits[r] *= 0.2
            elif kind in ("random", "mixed"):
                q[r] = torch.softmax(1.5 * torch.randn(vocab, generator=g), 0)
                drafts[r] = int(torch.multinomial(q[r], 1, generator=g))
    logits = logits.to(dtype)
    target = torch.empty(n, dtype=I64)
    gumbel_sample_ref(logits, seeds, positions, temperature < 1e-5, target, temperature)
    for b, kind in enumerate(kinds):
        if kind == "own":
            for r in range(cu[b], cu[b] + counts[b] - 1):
                drafts[r] = int(target[r])
                q[r] = 0.2 * torch.softmax(torch.randn(vocab, generator=g), 0)
                q[r, drafts[r]] += 0.8
        if kind == "greedy" and counts[b] > 1:  # a prefix of the drafts is the argmax
            r0, c = cu[b], counts[b]
            prefix = randint(0, c)
            for j in range(c - 1):
                tok = int(target[r0 + j])
                drafts[r0 + j] = tok if j < prefix else (tok + 1 + randint(0, vocab - 1)) % vocab
    for r, d in drafts.items():
        input_ids[int(logits_indices[r]) + 1] = d
    if pad_cols:  # strided rows
        wide = torch.full((n, vocab + pad_cols), 5.0, dtype=dtype)
        wide[:, :vocab] = logits
        logits = wide[:, :vocab]
        wide_q = torch.full((n, vocab + pad_cols), float("nan"), dtype=F32)
        wide_q[:, :vocab] = q
        q = wide_q[:, :vocab]
    return Case(logits, temperature, seeds, positions, target, torch.tensor(cu, dtype=I32),
                input_ids, logits_indices, q if full_q else None, kinds, width)


def run(impl: str, case: Case, **kw: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run one implementation into poisoned buffers (one spare row, checked untouched)."""
    c = case.to(DEVICE)
    b = len(case.kinds)
    out = torch.full((b + 1, case.width), 777, dtype=I64, device=DEVICE)
    num_out = torch.full((b + 1,), -7, dtype=I32, device=DEVICE)
    IMPLS[impl](*c.args(), b, out, num_out, c.draft_probs, **kw)
    assert out[b].tolist() == [777] * case.width and int(num_out[b]) == -7
    return out[:b].cpu(), num_out[:b].cpu()


def check_structure(case: Case, out: torch.Tensor, num_out: torch.Tensor) -> None:
    """What holds whatever the noise: accepted drafts, then the final token, then -1; kinds
    behave as built; a one-hot residual is the sampler's own sample when that is not the draft;
    a full-q residual has p > q; greedy requests follow the strict rule."""
    for b, kind in enumerate(case.kinds):
        r0, r1 = int(case.cu[b]), int(case.cu[b + 1])
        m, drafts, row = int(num_out[b]), case.drafts(b), out[b].tolist()
        if r1 == r0:
            assert m == 0 and row == [-1] * case.width
            continue
        assert 1 <= m <= len(drafts) + 1 and row[m:] == [-1] * (case.width - m)
        assert row[: m - 1] == drafts[: m - 1]
        last, j = row[m - 1], m - 1
        tgt = int(case.target[r0 + j])
        if j == len(drafts):  # all accepted: the bonus
            assert last == tgt
            continue
        if float(case.temperature[r0 + j]) < 1e-5:  # greedy row rejected: the argmax
            assert last == tgt and drafts[j] != tgt
        elif case.draft_probs is None:
            assert last != drafts[j]
            if tgt != drafts[j]:
                assert last == tgt
        else:
            x = case.logits[r0 + j].double() / float(case.temperature[r0 + j])
            p = torch.softmax(x, 0)
            assert p[last] > case.draft_probs[r0 + j, last].double() - 1e-6
        if kind == "greedy":
            assert case.target[r0 : r0 + m].tolist() == row[:m]
    for b, kind in enumerate(case.kinds):
        if kind == "reject":
            assert int(num_out[b]) == 1
        if kind == "nodraft":
            assert int(num_out[b]) == 1 and int(out[b, 0]) == int(case.target[case.cu[b]])


KINDS = ["accept", "random", "empty", "reject", "greedy", "nodraft", "mixed", "accept",
         "own", "random", "greedy", "own"]


@pytest.mark.parametrize("full_q", [True, False], ids=["full_q", "one_hot"])
@pytest.mark.parametrize(
    ("seed", "kw"),
    [(0, {"block_v": 8}), (1, {"block_v": 16}), (2, {"width": 3, "vocab": 17, "block_v": 8})],
)
def test_triton_matches_reference(seed: int, kw: dict, full_q: bool) -> None:
    kw = dict(kw)
    block_v = kw.pop("block_v")
    case = build_case(seed, KINDS, full_q=full_q, **kw)
    want = run("ref", case)
    check_structure(case, *want)
    counts = (case.cu[1:] - case.cu[:-1]).tolist()
    accept_all = [int(want[1][b]) == counts[b] for b, k in enumerate(KINDS) if k == "accept"]
    assert any(accept_all), "no all-accepted request"
    own_rejected = [int(want[1][b]) < counts[b] for b, k in enumerate(KINDS) if k == "own"]
    assert any(own_rejected), "no rejected own-sample draft"
    got = run("triton", case, block_v=block_v)
    assert torch.equal(got[1], want[1]), f"{got[1]}\n!=\n{want[1]}"
    assert torch.equal(got[0], want[0]), f"{got[0]}\n!=\n{want[0]}"


@pytest.mark.parametrize("full_q", [True, False], ids=["full_q", "one_hot"])
def test_bf16_strided_rows(full_q: bool) -> None:
    case = build_case(3, ["random", "accept", "reject", "greedy", "mixed"], width=4, vocab=20,
                      full_q=full_q, dtype=torch.bfloat16, pad_cols=3)
    want = run("ref", case)
    check_structure(case, *want)
    got = run("triton", case, block_v=16)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_reference_structure_many_cases() -> None:
    """The reference alone, on more random cases (cheap): structure and rejections seen."""
    rejected_sampled = 0
    for seed in range(10, 30):
        for full_q in (True, False):
            case = build_case(seed, KINDS, width=5, vocab=12, full_q=full_q)
            out, num_out = run("ref", case)
            check_structure(case, out, num_out)
            for b, kind in enumerate(KINDS):
                if kind == "random" and int(num_out[b]) < int(case.cu[b + 1] - case.cu[b]):
                    rejected_sampled += 1
    assert rejected_sampled > 10


def test_dominating_q_and_out_of_range_drafts() -> None:
    """Outside the contract, still defined and equal on both paths: a ``q`` >= ``p``
    everywhere (not normalized) leaves an empty residual, so a rejection emits the row's
    target sample; a draft outside ``[0, V)`` has ``p = q = 0``: rejected."""
    kinds = ["random", "own", "random", "mixed", "own", "random"]
    for full_q in (True, False):
        case = build_case(9, kinds, width=4, vocab=16, full_q=full_q)
        if case.draft_probs is not None:
            case.draft_probs.fill_(1.0)
        bad = [int(case.logits_indices[int(case.cu[b])]) + 1 for b in (2, 5)]
        case.input_ids[bad[0]], case.input_ids[bad[1]] = 16, -3
        want = run("ref", case)
        if not full_q:
            check_structure(case, *want)
        assert want[1][2] == 1 and want[1][5] == 1
        if full_q:
            rejected = [b for b in range(len(kinds)) if want[1][b] < case.cu[b + 1] - case.cu[b]]
            assert len(rejected) >= 3
            for b in rejected:
                j = int(want[1][b]) - 1
                assert want[0][b, j] == case.target[int(case.cu[b]) + j]
        got = run("triton", case, block_v=8)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_greedy_only_equals_strict_rejection() -> None:
    kinds = ["greedy", "empty", "greedy", "nodraft", "greedy", "greedy"]
    for full_q in (True, False):
        case = build_case(5, kinds, width=4, full_q=full_q)
        want_out = torch.full((len(kinds), 4), 9, dtype=I64)
        want_num = torch.full((len(kinds),), 9, dtype=I32)
        strict_rejection_ref(case.target, case.cu, case.input_ids, case.logits_indices,
                             len(kinds), want_out, want_num)
        for impl in ("ref", "triton"):
            out, num_out = run(impl, case, **({"block_v": 32} if impl == "triton" else {}))
            assert torch.equal(out, want_out) and torch.equal(num_out, want_num)


def test_more_rows_than_width() -> None:
    """Past the precondition (a request owns more than ``S`` rows) both paths check only the
    first ``S - 1`` drafts and stay inside the row."""
    case = build_case(6, ["accept", "random", "greedy"], width=4, vocab=16)
    case.width = 2
    want = run("ref", case)
    assert torch.equal(run("triton", case, block_v=16)[0], want[0])
    assert want[1][0] == 2 and want[0][0, 1] == case.target[int(case.cu[0]) + 1]


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_no_rows(impl: str) -> None:
    out = torch.full((3, 2), 777, dtype=I64, device=DEVICE)
    num_out = torch.full((3,), -7, dtype=I32, device=DEVICE)
    logits = torch.zeros((0, 5), device=DEVICE)
    e64 = torch.zeros(0, dtype=I64, device=DEVICE)
    cu = torch.zeros(4, dtype=I32, device=DEVICE)
    args = (logits, logits[:, 0], e64, e64, e64, cu, e64.to(I32), e64.to(I32))
    IMPLS[impl](*args, 3, out, num_out)
    assert out.tolist() == [[-1, -1]] * 3 and num_out.tolist() == [0, 0, 0]
    IMPLS[impl](*args, 0, out[:0], num_out[:0])


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    case = build_case(7, ["random", "accept", "nodraft"], width=3, vocab=16)
    want = run("ref", case)
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    got = run("dispatch", case)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    monkeypatch.setenv("MRV2_KERNELS", "torch")
    got = run("dispatch", case)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    ("name", "edit"),
    [
        ("logits", lambda a: a.update(logits=a["logits"].to(I32))),
        ("logits", lambda a: a.update(logits=a["logits"][:, 0])),
        ("temperature", lambda a: a.update(temperature=a["temperature"].double())),
        ("seeds", lambda a: a.update(seeds=a["seeds"].to(I32))),
        ("positions", lambda a: a.update(positions=a["positions"][:2])),
        ("target_sampled", lambda a: a.update(target_sampled=a["target_sampled"][:1])),
        ("cu_num_logits", lambda a: a.update(cu_num_logits=a["cu_num_logits"][:2])),
        ("input_ids", lambda a: a.update(input_ids=a["input_ids"].float())),
        ("out", lambda a: a.update(out=a["out"].to(I32))),
        ("num_out", lambda a: a.update(num_out=a["num_out"][:1])),
        ("draft_probs", lambda a: a.update(draft_probs=a["draft_probs"][:, :3])),
        ("draft_probs", lambda a: a.update(draft_probs=a["draft_probs"].half())),
    ],
)
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_argument_errors(impl: str, name: str, edit: Callable[[dict], None]) -> None:
    case = build_case(8, ["random", "random"], width=3, vocab=8)
    names = ["logits", "temperature", "seeds", "positions", "target_sampled", "cu_num_logits",
             "input_ids", "logits_indices"]
    a: dict = dict(zip(names, case.args(), strict=True))
    a.update(num_reqs=2, out=torch.zeros((2, 3), dtype=I64), num_out=torch.zeros(2, dtype=I32),
             draft_probs=case.draft_probs)
    edit(a)
    with pytest.raises(ValueError, match=name):
        IMPLS[impl](**a)


def test_acceptance_uniform_is_the_hash_at_its_index() -> None:
    """The acceptance stream is the gumbel hash itself, at index 2**31 - 1."""
    seeds = torch.tensor([0, 1, -5, 2**40 + 3], dtype=I64)
    positions = torch.tensor([0, 7, 123456, 2**33], dtype=I64)
    assert torch.equal(_uniform_at_ref(seeds, positions, 9), uniform_hash_ref(seeds, positions,
                                                                             10)[:, 9])
    u = acceptance_uniform_ref(seeds, positions)
    assert torch.equal(u, _uniform_at_ref(seeds, positions, 2**31 - 1))
    assert bool(((u > 0) & (u < 1)).all())


# ----------------------------------------------------------------------------- in law

# Goodness of fit: Pearson's chi-square statistic of the counts of the emitted token against
# the target distribution, over a fixed range of seeds (so the test is deterministic), with the
# p-value from the closed-form chi-square survival function below (scipy is not a dependency).
# A correct sampler fails a given seed range with probability 1e-4.
P_THRESHOLD = 1e-4
TRIALS = 20000


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square with integer ``df``: the regularized upper gamma
    Q(df / 2, x / 2) in closed form (a finite sum for even ``df``; erfc plus a finite sum for
    odd ``df``)."""
    h = x / 2
    if df % 2 == 0:
        term = total = 1.0
        for i in range(1, df // 2):
            term *= h / i
            total += term
        return math.exp(-h) * total
    total = math.erfc(math.sqrt(h))
    term = math.sqrt(h) * math.exp(-h) / math.gamma(1.5)  # h^(i - 1/2) e^-h / Gamma(i + 1/2)
    for i in range(1, (df - 1) // 2 + 1):
        total += term
        term *= h / (i + 0.5)
    return total


def test_chi2_sf_known_values() -> None:
    for df, x95 in [(1, 3.841459), (2, 5.991465), (3, 7.814728), (6, 12.59159), (7, 14.06714)]:
        assert chi2_sf(x95, df) == pytest.approx(0.05, rel=1e-5)
    assert chi2_sf(29.87750, 7) == pytest.approx(1e-4, rel=1e-4)  # the df = 7 critical value
    assert chi2_sf(27.85634, 6) == pytest.approx(1e-4, rel=1e-4)


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom); tokens outside the support of ``p`` must not occur."""
    counts = torch.bincount(tokens, minlength=p.shape[0]).double()
    support = p > 0
    assert counts[~support].sum() == 0, "a token outside the target's support"
    expected = p[support] * tokens.shape[0]
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def assert_in_law(tokens: torch.Tensor, p: torch.Tensor) -> None:
    stat, df = chi_square(tokens, p)
    assert chi2_sf(stat, df) > P_THRESHOLD, f"chi2 {stat:.1f} (df {df}): not ~ {p.tolist()}"


def logits_of(p: list[float], temperature: float) -> torch.Tensor:
    """Logits whose softmax at ``temperature`` is ``p`` (zeros become -inf)."""
    return torch.tensor(p, dtype=torch.float64).log().mul(temperature).float()


@dataclasses.dataclass
class Trials:
    out: torch.Tensor  # [M, S]
    num_out: torch.Tensor  # [M]
    target: torch.Tensor  # [M, S]
    drafts: torch.Tensor  # [M, k]


def trials(
    p: list[list[float]],
    temperature: float,
    q: list[list[float]] | None,
    fixed: list[int | None],
    seed_base: int,
) -> Trials:
    """TRIALS independent requests at one fixed prefix: row j's target distribution is
    ``p[j]`` (k + 1 rows); draft j is ``fixed[j]`` or, when None, drawn from ``q[j]``; each
    request has its own seed. Runs the reference once over the whole batch."""
    k, m = len(p) - 1, TRIALS
    s = k + 1
    g = torch.Generator().manual_seed(seed_base)
    drafts = torch.empty((m, k), dtype=I64)
    for j in range(k):
        f = fixed[j]
        if f is None:
            assert q is not None
            drafts[:, j] = torch.multinomial(torch.tensor(q[j]), m, replacement=True, generator=g)
        else:
            drafts[:, j] = f
    logits = torch.stack([logits_of(row, temperature) for row in p]).repeat(m, 1)
    n = m * s
    temp = torch.full((n,), temperature, dtype=F32)
    seeds = (seed_base * 1_000_003 + torch.arange(m, dtype=I64)).repeat_interleave(s)
    positions = (1000 + torch.arange(s, dtype=I64)).repeat(m)
    input_ids = torch.cat([torch.zeros((m, 1), dtype=I64), drafts], 1).reshape(-1)
    input_ids = torch.cat([input_ids, torch.zeros(1, dtype=I64)])
    draft_probs = None
    if q is not None:
        rows = torch.tensor(q + [[float("nan")] * len(q[0])], dtype=F32)  # bonus row: ignored
        draft_probs = rows.repeat(m, 1)
    target = torch.empty(n, dtype=I64)
    gumbel_sample_ref(logits, seeds, positions, torch.zeros(n, dtype=torch.bool), target, temp)
    out = torch.full((m, s), 777, dtype=I64)
    num_out = torch.full((m,), -7, dtype=I32)
    probabilistic_rejection_ref(logits, temp, seeds, positions, target,
                                torch.arange(m + 1, dtype=I32) * s, input_ids,
                                torch.arange(n, dtype=I64), m, out, num_out, draft_probs)
    return Trials(out, num_out, target.view(m, s), drafts)


def binomial_ok(hits: int, n: int, prob: float) -> bool:
    """``hits`` within 4.5 standard deviations of ``n * prob`` (two-sided p ~ 7e-6)."""
    return abs(hits - n * prob) < 4.5 * math.sqrt(n * prob * (1 - prob))


P0 = [0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05, 0.0]  # the last token is masked (top-k)
Q0 = [0.05, 0.10, 0.30, 0.05, 0.20, 0.05, 0.15, 0.10]  # q != p, mass on the masked token
P1 = [0.05, 0.40, 0.05, 0.20, 0.10, 0.10, 0.05, 0.05]
Q1 = [0.30, 0.05, 0.05, 0.30, 0.10, 0.05, 0.10, 0.05]
BONUS = [0.125] * 8


def test_in_law_full_draft_distribution() -> None:
    t = trials([P0, P1], 0.7, [Q0], [None], seed_base=1)
    assert_in_law(t.out[:, 0], torch.tensor(P0, dtype=torch.float64))
    accept_rate = sum(min(a, b) for a, b in zip(P0, Q0, strict=True))
    assert binomial_ok(int((t.num_out == 2).sum()), TRIALS, accept_rate)


def test_in_law_one_hot_draft() -> None:
    t = trials([P0, P1], 1.3, None, [1], seed_base=2)  # p(d) = 0.20
    assert_in_law(t.out[:, 0], torch.tensor(P0, dtype=torch.float64))
    assert binomial_ok(int((t.num_out == 2).sum()), TRIALS, P0[1])


def test_in_law_second_position() -> None:
    """Given the first draft (fixed, p = 0.30) was accepted, the second token ~ p_1, with a
    one-hot q at row 0 (given as a full distribution) and a random q_1 at row 1."""
    one_hot = [1.0] + [0.0] * 7
    t = trials([P0, P1, BONUS], 0.9, [one_hot, Q1], [0, None], seed_base=3)
    first_ok = t.num_out >= 2
    assert binomial_ok(int(first_ok.sum()), TRIALS, P0[0])
    assert (t.out[first_ok, 0] == 0).all() and (t.out[~first_ok, 0] != 0).all()
    assert_in_law(t.out[first_ok, 1], torch.tensor(P1, dtype=torch.float64))


WRONG: dict[str, Callable[[Trials], torch.Tensor]] = {
    # the token at a rejection sampled from p (the row's target sample) instead of the residual
    "residual_from_p": lambda t: torch.where(t.num_out == 1, t.target[:, 0], t.out[:, 0]),
    # every draft accepted
    "no_rejection": lambda t: t.drafts[:, 0],
}


@pytest.mark.parametrize("one_hot", [False, True], ids=["full_q", "one_hot"])
@pytest.mark.parametrize("wrong", sorted(WRONG))
def test_in_law_has_power(wrong: str, one_hot: bool) -> None:
    """The same harness rejects deliberately wrong samplers: the statistic is past the
    threshold."""
    if one_hot:
        t = trials([P0, P1], 1.3, None, [1], seed_base=2)
    else:
        t = trials([P0, P1], 0.7, [Q0], [None], seed_base=1)
    tokens = WRONG[wrong](t)
    p = torch.tensor(P0, dtype=torch.float64)
    if wrong == "no_rejection" and not one_hot:
        p[-1] = 1e-12  # q puts mass on the masked token: keep it in the statistic
    stat, df = chi_square(tokens, p)
    assert chi2_sf(stat, df) < P_THRESHOLD, f"chi2 {stat:.1f} (df {df}) passed"
