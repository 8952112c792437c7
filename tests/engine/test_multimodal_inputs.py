"""Multimodal inputs through the core: items on the request, embeddings spliced at placeholders.

A private ModelState turns each item's ``data`` (here: the embedding rows themselves, as an
encoder would produce them) into the rows of the placeholder tokens; HF transformers, fed the
same ``inputs_embeds``, is the oracle. Chunked prefill splits a placeholder run over steps, and
the prefix cache must tell two images apart under identical placeholder tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mrv2 import LLM, ModelState, SamplingParams, hookimpl
from mrv2.contract.batch import InputBatch
from mrv2.contract.model_state import placeholder_rows
from mrv2.contract.requests import MultiModalEmbeddings, MultiModalItem, NewRequest
from mrv2.plugins import PluginManager
from mrv2.testing import make_tiny_checkpoint

PLACEHOLDER = 3
NEW_TOKENS = 6


class SpliceState(ModelState):
    """Keeps each row's items; embeds the placeholder tokens a step computes."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.items: dict[int, list[MultiModalItem]] = {}
        self.spliced = 0

    def add_request(self, request: NewRequest, row: int) -> None:
        if request.mm_items:
            self.items[row] = request.mm_items

    def remove_request(self, req_id: str, row: int) -> None:
        self.items.pop(row, None)

    def get_mm_embeddings(self, batch: InputBatch) -> MultiModalEmbeddings | None:
        rows, parts = [], []
        for i, row in enumerate(batch.idx_mapping_cpu.tolist()):
            for item in self.items.get(row, []):
                tokens, within = placeholder_rows(batch, i, item.offset, item.length)
                if len(tokens):
                    rows.append(tokens)
                    parts.append(item.data[torch.from_numpy(within)])
        if not rows:
            return None
        self.spliced += sum(len(r) for r in rows)
        index = torch.from_numpy(np.concatenate(rows)).to(batch.input_ids.device)
        return MultiModalEmbeddings(index, torch.cat(parts).to(batch.input_ids.device))


class Plugin:
    """Registers the tiny Qwen3 under a multimodal architecture name."""

    @hookimpl
    def mrv2_register_models(self, register: Any) -> None:
        register("SpliceQwen", "mrv2_qwen.model:Qwen3ForCausalLM",
                 model_state=f"{__name__}:SpliceState")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HF checkpoint; ``<it>/splice`` is the same weights under the multimodal name."""
    hf_dir = make_tiny_checkpoint(tmp_path_factory.mktemp("hf") / "qwen3", "Qwen3ForCausalLM")
    ours = hf_dir.parent / "splice"
    shutil.copytree(hf_dir, ours)
    config = json.loads((ours / "config.json").read_text())
    config["architectures"] = ["SpliceQwen"]
    (ours / "config.json").write_text(json.dumps(config))
    return hf_dir


def _llm(ckpt: Path, **kwargs: Any) -> LLM:
    manager = PluginManager(autoload=True, allow=["qwen"], block=[])
    manager.register(Plugin(), name="splice")
    return LLM(str(ckpt.parent / "splice"), plugins=manager, device="cpu", dtype="float32",
               block_size=4, **kwargs)


def _item(seed: int, offset: int, length: int) -> MultiModalItem:
    data = torch.randn(length, 64, generator=torch.Generator().manual_seed(seed))
    return MultiModalItem("image", data, f"image-{seed}", offset, length)


def _hf_greedy(ckpt: Path, prompt: list[int], items: list[MultiModalItem]) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    embed = model.get_input_embeddings()
    with torch.no_grad():
        embeds = embed(torch.tensor(prompt))
        for item in items:
            embeds[item.offset : item.offset + item.length] = item.data
        out: list[int] = []
        for _ in range(NEW_TOKENS):
            logits = model(inputs_embeds=embeds[None]).logits[0, -1]
            out.append(int(logits.argmax()))
            embeds = torch.cat([embeds, embed(torch.tensor(out[-1:]))])
    return out


def _run(llm: LLM, requests: list[tuple[list[int], list[MultiModalItem]]]) -> list[list[int]]:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params, mm_items=items) for p, items in requests]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


def _requests() -> list[tuple[list[int], list[MultiModalItem]]]:
    image_a = [9, 4] + [PLACEHOLDER] * 6 + [11, 12, 13]
    two = [5] + [PLACEHOLDER] * 3 + [7, 8] + [PLACEHOLDER] * 5 + [2]
    return [(image_a, [_item(1, 2, 6)]),
            (two, [_item(2, 1, 3), _item(3, 6, 5)]),
            ([20, 21, 22, 23], [])]


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 5}], ids=["whole", "chunked"])
def test_embeddings_spliced_at_placeholders_match_hf(ckpt: Path, kwargs: dict[str, Any]) -> None:
    requests = _requests()
    expected = [_hf_greedy(ckpt, p, items) for p, items in requests]
    llm = _llm(ckpt, **kwargs)
    assert _run(llm, requests) == expected
    state = llm.engine.runner.model_state
    assert isinstance(state, SpliceState) and state.spliced == 6 + 3 + 5


def test_prefix_cache_tells_images_apart(ckpt: Path) -> None:
    prompt = [9, 4] + [PLACEHOLDER] * 10 + [11, 12, 13, 14, 15]
    first, other, same = _item(1, 2, 10), _item(5, 2, 10), _item(1, 2, 10)
    llm = _llm(ckpt)
    expected_other = _hf_greedy(ckpt, prompt, [other])
    assert _run(llm, [(prompt, [first])]) == [_hf_greedy(ckpt, prompt, [first])]
    assert _run(llm, [(prompt, [other])]) == [expected_other]  # same tokens, other image
    assert llm.engine.stats()["prefix_cache_hits"] == 0
    _run(llm, [(prompt, [same])])  # same image again: its blocks are found
    assert llm.engine.stats()["prefix_cache_hits"] > 0


def test_bad_placeholders_are_refused(ckpt: Path) -> None:
    llm = _llm(ckpt)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="within the 4 prompt tokens"):
        llm.engine.add_request([1, 2, 3, 4], params, mm_items=[_item(1, 2, 3)])
    with pytest.raises(ValueError, match="ordered, disjoint"):
        llm.engine.add_request([1] * 10, params, mm_items=[_item(1, 4, 3), _item(2, 2, 3)])
    with pytest.raises(ValueError, match="length >= 1"):
        MultiModalItem("image", None, "h", 0, 0)
    assert not llm.engine.has_unfinished()
