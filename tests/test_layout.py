"""The package's layout rules: every package is shipped, modules stay small, stages import downward."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
KVRAG = ROOT / "kvrag"
MAX_LINES = 400
# A stage may import the stages before it, never the ones after (the facade and front ends sit on top).
ORDER = ["config", "errors", "prompt", "model", "codec", "storage", "indexing", "loading", "fusion", "generation",
         "query", "chat", "rag", "repair", "bench", "serve", "cli"]
# The one deliberate exception: a FuseConfig checks its mode against the selector registry, imported when the
# check runs, so that mode names are spelled in one place and `import kvrag.config` stays light.
ALLOWED_UPWARD = {("kvrag/config.py", "kvrag.fusion.selectors.base")}


def test_every_package_under_kvrag_is_shipped():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in KVRAG.rglob("__init__.py")}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"


def test_no_module_exceeds_the_size_limit():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in KVRAG.rglob("*.py")}
    long = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_every_module_opens_with_a_docstring():
    bare = [str(p.relative_to(ROOT)) for p in KVRAG.rglob("*.py")
            if ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not bare, f"modules without a contract docstring: {bare}"


def _stage(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "kvrag" or len(parts) < 2:
        return None
    name = parts[1]
    return ORDER.index(name) if name in ORDER else None


def _leaf(module: str) -> bool:
    """A module that imports nothing of kvrag (atomic writes, checksums) may be used by any stage."""
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    if not path.is_file():
        return False
    return not any(isinstance(n, ast.ImportFrom) and (n.module or "").startswith("kvrag")
                   for n in ast.walk(ast.parse(path.read_text())))


def test_stages_import_downward_only():
    upward = []
    for path in KVRAG.rglob("*.py"):
        name = str(path.relative_to(ROOT))
        here = _stage(".".join(path.relative_to(ROOT).with_suffix("").parts))
        if here is None:
            continue
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree)
                       if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                       for n in ast.walk(block)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or not node.module or id(node) in typing_only:
                continue
            there = _stage(node.module)
            if (there is not None and there > here and not _leaf(node.module)
                    and (name, node.module) not in ALLOWED_UPWARD):
                upward.append(f"{name} imports {node.module}")
    assert not upward, "\n".join(upward)


def test_importing_kvrag_loads_no_framework_and_no_torch():
    import subprocess

    code = ("import kvrag, kvrag.config, sys; "
            "print(sorted(m for m in ('torch', 'langchain_core', 'llama_index') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
