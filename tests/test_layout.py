"""The package's layout rules: every package is shipped, modules stay small (stages import downward:
`test_layering`)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
KVRAG = ROOT / "kvrag"
MAX_LINES = 400


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


def test_importing_kvrag_loads_no_framework_and_no_torch():
    import subprocess

    code = ("import kvrag, kvrag.config, sys; "
            "print(sorted(m for m in ('torch', 'langchain_core', 'llama_index') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_index_folders_file_names_are_spelled_in_one_module():
    """Only `kvrag.storage.index_layout` names the files of an index folder in code (messages may mention them)."""
    from kvrag.storage.index_layout import IndexLayout

    names = {IndexLayout.MANIFEST, IndexLayout.DB, IndexLayout.VECTORS, IndexLayout.INDEX_LOCK,
             IndexLayout.WRITER_LOCK, IndexLayout.CODEC, IndexLayout.CHUNKS, IndexLayout.FITTED}
    home = ROOT / "kvrag" / "storage" / "index_layout.py"
    spelled = []
    for path in sorted((ROOT / "kvrag").rglob("*.py")):
        if path == home:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            operands = [node.right] if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) else []
            operands += node.args if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "joinpath" else []
            spelled += [f"{path.relative_to(ROOT)}:{node.lineno} {o.value!r}" for o in operands
                        if isinstance(o, ast.Constant) and o.value in names]
    assert not spelled, "index file names joined onto paths outside IndexLayout:\n" + "\n".join(spelled)
