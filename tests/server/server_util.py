"""Constants shared by the server tests (conftest.py builds the server)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mrv2.engine.engine import LLMEngine

API_KEY = "sk-test"
MODEL = "tiny"
ENGINE_KWARGS: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4, max_model_len=64,
                     num_gpu_blocks_override=512, max_num_seqs=128, seed=0)


@dataclass
class Served:
    url: str
    engine: LLMEngine
    model_dir: Path
