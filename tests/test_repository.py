"""Repository rules: file size limit, README and CI in step, runner free of model families."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 1300
SKIP_SUFFIXES = {".json", ".txt", ".lock", ".csv", ".jsonl"}


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return [ROOT / line for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]


def test_no_file_over_the_line_limit() -> None:
    too_long = []
    for path in _tracked_files():
        if path.suffix in SKIP_SUFFIXES or not path.is_file():
            continue
        try:
            lines = path.read_text().count("\n")
        except UnicodeDecodeError:
            continue
        if lines > MAX_LINES:
            too_long.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert not too_long, f"files over {MAX_LINES} lines, split them: {too_long}"


def test_test_modules_have_distinct_names() -> None:
    """pytest imports test files without packages by their basename: two ``test_x.py`` in
    different folders stop the whole run at collection (it happened: a plugin's model test
    and the server's parser test of the same family)."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in _tracked_files():
        if path.suffix == ".py" and path.name.startswith("test_") and path.is_file():
            if path.name in seen and not (path.parent / "__init__.py").exists():
                clashes.append(f"{seen[path.name].relative_to(ROOT)} and "
                               f"{path.relative_to(ROOT)}")
            seen.setdefault(path.name, path)
    assert not clashes, f"test modules with one name: {clashes}"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", readme, re.S)
    commands = [line.strip() for block in blocks for line in block.splitlines() if line.strip()]
    test_commands = [c for c in commands if "test" in c]
    assert test_commands, "README must give the test command"
    assert test_commands[0] in ci, f".ci/run must run the README's `{test_commands[0]}`"


def test_runner_imports_no_model_family() -> None:
    for path in (ROOT / "framework" / "mrv2" / "runner").glob("*.py"):
        text = path.read_text()
        assert not re.search(r"mrv2_(qwen|llama|glm|deepseek)|Qwen|Llama", text), path.name


def test_kernels_do_not_import_the_core() -> None:
    for path in (ROOT / "kernels" / "mrv2_kernels").glob("*.py"):
        assert not re.search(r"^\s*(from|import) mrv2\b", path.read_text(), re.M), path.name
