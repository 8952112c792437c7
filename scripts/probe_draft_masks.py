"""Host cost of structured outputs' masks with drafts (speculative decoding): ``G`` guides of a
JSON schema, each mid-answer, masks for their next token alone (``k=0``) or for it and ``k``
drafts (the grammar's own continuation, so every draft row is computed), as the engine builds
them each step (``fill_bitmasks`` / ``fill_draft_bitmasks``: a level of rows at a time on
llguidance's thread pool). Median of 15 per case; the tokenizer is a model directory's
(default: the converted default model, SmolLM2's 49K vocabulary).

    python scripts/probe_draft_masks.py [--tokenizer DIR] [--guides 1 8 64] [--drafts 0 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from mrv2.contract.params import SamplingParams, StructuredOutputsParams
from mrv2.engine.structured_outputs import StructuredOutputs, fill_bitmasks, fill_draft_bitmasks

SCHEMA = {"type": "object", "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
ANSWER = '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines", "notes"]}'


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default=str(Path.home() / ".cache/mrv2/models/"
                                               "SmolLM2-135M-Instruct"))
    p.add_argument("--guides", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--drafts", type=int, nargs="+", default=[0, 3])
    args = p.parse_args()
    hf = AutoTokenizer.from_pretrained(args.tokenizer)
    so = StructuredOutputs(hf, len(hf), [hf.eos_token_id])
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    answer = hf.encode(ANSWER, add_special_tokens=False)
    print(f"vocabulary {len(hf)}, answer {len(answer)} tokens")
    print(f"{'guides':>6} {'drafts':>6} {'ms a step':>10} {'us a mask':>10}")
    for g in args.guides:
        for k in args.drafts:
            guides, drafts = [], []
            for i in range(g):
                guide, start = so.guide(params, []), 3 + i % 10
                for token in answer[:start]:
                    guide.advance(token)
                guides.append(guide)
                drafts.append(answer[start : start + k])
            times = []
            for _ in range(15):
                outs = [np.empty((1 + len(d), so.words), dtype=np.int32) for d in drafts]
                begin = time.perf_counter()
                if k:
                    fill_draft_bitmasks(list(guides), drafts, outs)
                else:
                    fill_bitmasks(list(guides), np.empty((g, so.words), dtype=np.int32))
                times.append(time.perf_counter() - begin)
            t = statistics.median(times)
            print(f"{g:>6} {k:>6} {t * 1e3:>10.3f} {t * 1e6 / g / (1 + k):>10.1f}")


if __name__ == "__main__":
    main()
