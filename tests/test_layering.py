"""The core's import order, checked: no package imports one above it, no module circle.

``LAYERS`` is the one place the order is written down (CONTRIBUTING.md shows it): a module of
``mrv2.<part>`` may import ``mrv2.<other>`` only where ``other`` sits at or below ``part``. Every
import counts, also those inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "framework" / "mrv2"

#: Lowest first. ``contract`` is the step contract every layer above builds on.
LAYERS = [
    "registry",      # what plugins registered (imports nothing of mrv2)
    "logs",          # the mrv2 command's logging (imports nothing of mrv2)
    "config_compat", # vLLM's compilation / optimization arguments (imports nothing of mrv2)
    "config_sections",  # the config's smaller pydantic sections (imports nothing of mrv2)
    "config",        # pydantic settings (on config_compat, config_sections)
    "config_cli",    # the engine's CLI flags (on config)
    "distributed",   # tensor-parallel group, collectives, step channel (nothing of mrv2)
    "contract",      # params, requests, batch, state table, KV specs, ModelState, Speculator
    "attention",     # attention backends
    "layers",        # shared model layers
    "model_loader",  # checkpoints, model building
    "lora",          # LoRA adapters: reading them, slots on the linear layers
    "sample",        # the sampler, rejection, logprobs
    "spec_decode",   # speculators shipped with the core
    "hookspecs",     # hook specifications
    "defaults",      # the core's own plugin
    "plugins",       # the plugin manager
    "runner",        # the step path
    "executor",      # one runner, or rank 0's runner and its tensor-parallel workers
    "testing",       # helpers for tests of mrv2 and its plugins
    "testing_quant", # GPTQ / AWQ checkpoint writers for tests (imports nothing of mrv2)
    "testing_checkpoints",  # FP8 / MTP / LoRA checkpoint writers for tests (on testing)
    "engine",        # scheduler, block manager, engine loop, LLM
    "testing_engine",  # helpers for tests that run the engine (tokens at each TP size)
    "bench",         # benchmarks
    "entrypoints",   # CLI and server
    "__init__",      # the package's public names
]


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_package(module: str) -> bool:
    return (ROOT.parent / Path(*module.split(".")) / "__init__.py").is_file()


def _imports(path: Path, module: str) -> set[str]:
    """Every ``mrv2`` module ``path`` imports (``from mrv2 import x``: ``mrv2.x`` if a module)."""
    found: set[str] = set()
    package = module if _is_package(module) else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "mrv2")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            if base.split(".")[0] != "mrv2":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (ROOT.parent / Path(*sub.split("."))).with_suffix(".py").is_file()
                found.add(sub if is_module or _is_package(sub) else base)
    return found


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        graph[module] = {m for m in _imports(path, module) if m != module}
    return graph


def test_every_part_of_the_core_has_a_layer() -> None:
    parts = {_part(m) for m in _graph()}
    assert parts <= set(LAYERS), f"add these to LAYERS: {sorted(parts - set(LAYERS))}"


def test_no_package_imports_a_higher_one() -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = [
        f"{module} ({_part(module)}) imports {target} ({_part(target)})"
        for module, targets in _graph().items() for target in targets
        if rank[_part(target)] > rank[_part(module)]
    ]
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_no_import_circle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in graph:
                continue
            if state.get(target) == 1:
                circle = stack[stack.index(target):] + [target]
                pytest.fail("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_guards_catch_what_they_guard(tmp_path: Path) -> None:
    """An upward import and a circle, planted in copies of two modules, are reported."""
    text = "from mrv2.runner.runner import Runner\n"
    tree = ast.parse(text)
    assert isinstance(tree.body[0], ast.ImportFrom)
    fake = tmp_path / "p.py"
    fake.write_text(text)
    assert _imports(fake, "mrv2.contract.p") == {"mrv2.runner.runner"}
    rank = {name: i for i, name in enumerate(LAYERS)}
    assert rank["runner"] > rank["contract"]  # so the planted import would be refused
    fake.write_text("from mrv2 import hookspecs\nfrom . import batch\n")
    assert _imports(fake, "mrv2.contract.p") == {"mrv2.hookspecs", "mrv2.contract.batch"}
