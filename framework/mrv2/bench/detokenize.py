"""``mrv2 bench detokenize``: incremental detokenizers, CPU time per token and exactness.

Three ways to turn output ids into streamed text, fed one id at a time as the engine does:

* ``window``: ``IncrementalDetokenizer(decode_stream=False)``, windows decoded in Python (two
  ``Tokenizer.decode`` calls per token); the engine's former implementation, and what a
  tokenizer without a Rust backend still gets.
* ``DecodeStream``: ``tokenizers.decoders.DecodeStream`` used raw, one ``step`` per id.
* ``mrv2``: ``IncrementalDetokenizer`` as the engine uses it (``DecodeStream`` plus held
  byte-fallback runs and a flush).

Cost: microseconds per token over an output of ``--tokens`` ids of mixed text (English, accents,
CJK, emoji, code), median of ``--repeats`` runs. Exactness: over ``--cases`` random and
adversarial id sequences (random ids, byte-fallback-heavy ids, text with multi-byte characters
cut at random points, special tokens inserted, ``skip_special_tokens`` on and off) the share
whose concatenated deltas equal ``Tokenizer.decode``, and the number of cases where a delta held
a U+FFFD the full text lacks or the decoder raised. Tokenizers: a byte-level BPE (GPT-2 / Llama-3
/ Qwen style) and a sentencepiece-style BPE with ``<0xNN>`` byte fallback (Llama-2 / Mistral
style), both trained here in a second; ``--tokenizer DIR`` adds real ones.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mrv2.engine.detokenizer import IncrementalDetokenizer
from mrv2.engine.tokenizer import Tokenizer

CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Hello world, hello tokenizer! Stop here: STOP and END.",
    "naïve café — 東京 は 日本 の 首都 です 😀 🇫🇷 👍🏽",
    "def f(x):\n    return x + 1  # two  spaces\n\n",
]
SPECIALS = ["<unk>", "<s>", "</s>", "<|end|>"]
TEXT = (
    "The capital of France is Paris, and the capital of Japan is Tokyo (東京). Naïve café "
    "owners say “bonjour” 😀 to everyone 👍🏽, while the code reads def f(x): return x + 1. "
    "가나다라 — 🇫🇷 done.\n"
)
# Pieces of adversarial text: multi-byte characters, combining marks, flags, runs of spaces.
_PIECES = ["😀", "東京", " naïve", "👍🏽", " é", "\u0301", " the", "가", "\n", "  ", "🇫🇷", "x",
           "Paris", " 🎉", "ß", "\t"]


# -- tokenizers built in code (no downloads) ----------------------------------------------------


def wrap(raw: Any) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` as the engine's ``Tokenizer``, with SPECIALS' roles named."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=["<|end|>"],
    )
    return Tokenizer(hf)


def byte_level_bpe() -> Tokenizer:
    """GPT-2 style: byte-level BPE, so characters split over several tokens."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, show_progress=False, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(CORPUS, trainer)
    return wrap(raw)


def sentencepiece_bpe(metaspace: bool = False) -> Tokenizer:
    """Llama-2 style: "▁" word markers, ``<0xNN>`` byte-fallback tokens, no leading space.

    ``metaspace=False`` decodes like Llama-2's tokenizer.json (Replace, ByteFallback, Fuse,
    Strip); ``metaspace=True`` like newer ones (ByteFallback, Metaspace).
    """
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    trained = RawTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, limit_alphabet=60, show_progress=False)
    trained.train_from_iterator(CORPUS, trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for tok in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(tok, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    raw = RawTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    raw.add_special_tokens(SPECIALS)
    if metaspace:
        raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        raw.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")]
        )
    else:
        raw.normalizer = normalizers.Sequence(
            [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        )
        raw.decoder = decoders.Sequence([
            decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ])
    return wrap(raw)


# -- the detokenizers compared ------------------------------------------------------------------

#: name -> run(tokenizer, ids, skip_special_tokens) -> the deltas, in order (errors propagate).
Runner = Callable[[Tokenizer, list[int], bool], list[str]]


def _run_ours(decode_stream: bool) -> Runner:
    def run(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
        det = IncrementalDetokenizer(tok, [], skip, decode_stream=decode_stream)
        deltas = [det.add_tokens([i]) for i in ids]
        deltas.append(det.flush())
        return deltas

    return run


def _run_decode_stream(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    from tokenizers.decoders import DecodeStream

    stream, backend = DecodeStream(skip_special_tokens=skip), tok.backend
    deltas = []
    for i in ids:
        delta = stream.step(backend, i)
        deltas.append(delta or "")
    return deltas


RUNNERS: dict[str, Runner] = {
    "window": _run_ours(decode_stream=False),
    "DecodeStream": _run_decode_stream,
    "mrv2": _run_ours(decode_stream=True),
}


# -- correctness --------------------------------------------------------------------------------


def adversarial_cases(tok: Tokenizer, n: int, seed: int = 0) -> list[tuple[list[int], bool]]:
    """``n`` (ids, skip_special_tokens) cases: random ids, byte-fallback-heavy ids, and text with
    multi-byte characters cut at random token boundaries; special tokens sprinkled in."""
    rng = random.Random(seed)
    byte_ids = sorted(tok.byte_fallback_ids)
    specials = tok.all_special_ids
    cases = []
    for k in range(n):
        kind = k % 4
        if kind == 0:  # random ids, a few past the vocabulary (a model's padded embedding)
            ids = [rng.randrange(tok.vocab_size + 4) for _ in range(rng.randrange(1, 40))]
        elif kind == 1:  # dense in byte-fallback tokens (random ids where there are none)
            ids = [rng.choice(byte_ids) if byte_ids and rng.random() < 0.6
                   else rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        else:  # text, whole (2) or a random slice of its tokens (3)
            text = "".join(rng.choice(_PIECES) for _ in range(rng.randrange(1, 15)))
            ids = tok.encode(text, add_special_tokens=False)
            if kind == 3 and len(ids) > 1:
                begin = rng.randrange(len(ids))
                ids = ids[begin : begin + rng.randrange(1, len(ids) + 1)]
        for _ in range(rng.randrange(3)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        cases.append((ids, k % 8 < 4))
    return cases


def check(run: Runner, tok: Tokenizer, cases: list[tuple[list[int], bool]]) -> dict[str, Any]:
    """Count the cases by outcome, with the smallest failing case of each kind.

    ``exact``: the deltas join to the full decode and none holds a U+FFFD the decode lacks;
    ``tail_lost``: they join to a proper prefix of it (text held back at the end never came out);
    ``wrong``: other text; ``raised``: the detokenizer raised; ``spurious_fffd``: a delta held a
    U+FFFD the decode lacks (counted within the above).
    """
    counts = {"exact": 0, "tail_lost": 0, "wrong": 0, "raised": 0, "spurious_fffd": 0}
    examples: dict[str, dict[str, Any]] = {}
    for ids, skip in cases:
        full = tok.decode(ids, skip_special_tokens=skip)
        try:
            deltas = run(tok, ids, skip)
        except Exception as e:  # counted as a failure of the detokenizer
            kind, deltas, got = "raised", [], f"{type(e).__name__}: {e}"
        else:
            got = "".join(deltas)
            bad_fffd = "\ufffd" not in full and any("\ufffd" in d for d in deltas)
            counts["spurious_fffd"] += bad_fffd
            kind = ("exact" if got == full and not bad_fffd
                    else "tail_lost" if full.startswith(got) else "wrong")
        counts[kind] += 1
        if kind != "exact" and (kind not in examples or len(ids) < len(examples[kind]["ids"])):
            examples[kind] = {"ids": ids, "skip_special_tokens": skip,
                              "tokens": tok.convert_ids_to_tokens(ids), "deltas": deltas,
                              "decode": full, "got": got}
    return {"cases": len(cases), **counts, "examples": examples}


# -- cost ---------------------------------------------------------------------------------------


def us_per_token(run: Runner, tok: Tokenizer, ids: list[int], repeats: int) -> float:
    """Median over ``repeats`` runs of the CPU time per token of ``run`` on ``ids``."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run(tok, ids, True)
        times.append(time.process_time() - start)
    return statistics.median(times) / len(ids) * 1e6


def output_ids(tok: Tokenizer, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` ids of ``TEXT`` repeated."""
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids += tok.encode(TEXT, add_special_tokens=False)
    return ids[:num_tokens]


def bench(args: argparse.Namespace) -> dict[str, Any]:
    tokenizers: dict[str, Tokenizer] = {
        "byte-level BPE": byte_level_bpe(),
        "sentencepiece <0xNN>": sentencepiece_bpe(),
    }
    for path in args.tokenizer or []:
        tokenizers[Path(path).name] = Tokenizer(path)
    rows = []
    for name, tok in tokenizers.items():
        ids = output_ids(tok, args.tokens)
        cases = adversarial_cases(tok, args.cases)
        for backend, run in RUNNERS.items():
            if backend == "DecodeStream" and tok.backend is None:
                continue  # a slow tokenizer: no Rust decoder to stream with
            rows.append({"tokenizer": name, "backend": backend,
                         "us_per_token": round(us_per_token(run, tok, ids, args.repeats), 2),
                         **check(run, tok, cases)})
    return {"tokens": args.tokens, "repeats": args.repeats, "text": TEXT, "rows": rows}


def print_table(results: dict[str, Any]) -> None:
    print(f"{results['tokens']}-token outputs of {results['text']!r} repeated, fed one id at a "
          f"time; CPU time per token, median of {results['repeats']} runs. Cases: random and "
          "adversarial ids; exact = deltas join to Tokenizer.decode")
    print(f"{'tokenizer':<22} {'backend':<13} {'us/token':>8} {'exact':>10} {'tail lost':>9} "
          f"{'wrong':>6} {'raised':>6} {'bad U+FFFD':>10}")
    for r in results["rows"]:
        exact = f"{r['exact']}/{r['cases']}"
        print(f"{r['tokenizer']:<22} {r['backend']:<13} {r['us_per_token']:>8.2f} {exact:>10} "
              f"{r['tail_lost']:>9} {r['wrong']:>6} {r['raised']:>6} {r['spurious_fffd']:>10}")
    for r in results["rows"]:
        for kind, e in r["examples"].items():
            print(f"{r['backend']} on {r['tokenizer']}, {kind}: {e['tokens']} "
                  f"(skip_special_tokens={e['skip_special_tokens']}): deltas {e['deltas']}, "
                  f"got {e['got']!r}, decode {e['decode']!r}")


def add_parser(sub: Any) -> None:
    """Register ``mrv2 bench detokenize``."""
    p = sub.add_parser("detokenize", help="incremental detokenizers: CPU us/token, exactness")
    p.add_argument("--tokens", type=int, default=512, help="output length timed")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cases", type=int, default=1000, help="correctness cases per tokenizer")
    p.add_argument("--tokenizer", action="append", metavar="DIR",
                   help="also a model directory's tokenizer (repeatable)")
    p.add_argument("--json", default=None, help="also save the results here")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run and print the table."""
    results = bench(args)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    return 0
