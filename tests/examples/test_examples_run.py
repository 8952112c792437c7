"""The examples run as the README runs them (``python examples/NAME.py``, on the CPU, the default
SmolLM2 model) and print what they say they print."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(name: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, str(EXAMPLES / name)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_offline_generate() -> None:
    out = _run("offline_generate.py")
    assert "Q: What is the capital of France?\nA: " in out and "Paris" in out
    assert "Q: Name three primary colors.\nA: " in out


def test_private_plugin() -> None:
    """The relabelled checkpoint loads through the plugin registered in code, and its
    ModelState (the counting one) prepared the steps: one per generated token."""
    out = _run("private_plugin.py")
    assert out.rstrip().endswith("(8 steps prepared)"), out


def test_runner_from_config() -> None:
    out = _run("runner_from_config.py")
    assert "4" in out, out


def test_every_example_has_a_test() -> None:
    """A new example joins this file (or a test file of its own, as the latent cache one)."""
    covered = {"offline_generate.py", "private_plugin.py", "runner_from_config.py",
               "private_latent_cache_plugin.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == covered
