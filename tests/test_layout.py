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
