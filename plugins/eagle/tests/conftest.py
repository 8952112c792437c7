"""Fixtures: the tiny targets and their random-weight EAGLE heads (session-wide)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mrv2.testing import make_tiny_checkpoint
from mrv2_eagle.testing import write_eagle3_head, write_eagle_head

#: The targets: Qwen3 with 3 layers (EAGLE-3's default aux layers (2, 1, 0): layer 0's input is
#: the embedding), Llama with 4 (aux layers named by the head, out of order).
TARGETS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3ForCausalLM", {"num_hidden_layers": 3, "tie_word_embeddings": False}),
    "llama": ("LlamaForCausalLM", {"num_hidden_layers": 4}),
}
#: EAGLE-3 aux layer ids written into the head's config (None: the default).
AUX_IDS: dict[str, list[int] | None] = {"qwen3": None, "llama": [3, 1, 2]}


@pytest.fixture(scope="session")
def target_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("targets")
    return {name: make_tiny_checkpoint(root / name, arch, seed=3, **kw)
            for name, (arch, kw) in TARGETS.items()}


@pytest.fixture(scope="session")
def head_dirs(target_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
              ) -> dict[tuple[str, str], Path]:
    """``(target, method) -> head directory``: EAGLE-1 style for Qwen3, EAGLE-2 style (input
    norm, no fc bias) for Llama; EAGLE-3 heads with reduced vocabularies (Llama's with an
    embedding of its own)."""
    root = tmp_path_factory.mktemp("heads")
    heads: dict[tuple[str, str], Path] = {}
    for i, (name, target) in enumerate(sorted(target_dirs.items())):
        heads[(name, "eagle")] = write_eagle_head(root / f"{name}-eagle", target, seed=10 + i,
                                                  eagle1=name == "qwen3")
        heads[(name, "eagle3")] = write_eagle3_head(root / f"{name}-eagle3", target,
                                                    seed=20 + i, aux_ids=AUX_IDS[name],
                                                    own_embedding=name == "llama")
    return heads
