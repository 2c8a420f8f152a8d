"""Every kvrag module and symbol that a docstring or a doc names in backticks exists.

Two forms are resolved: a dotted name from the package root (```kvrag.query.plan```, ```kvrag.fusion.FusionInput```),
imported module by module and then looked up attribute by attribute; and ```Class.member``` for a class that kvrag
defines under one name (```KVRag.answer```, ```FuseConfig.ratio```): the member is an attribute, a dataclass field or
an annotated field of the class or its bases, or an instance attribute its methods set.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from typing import Any

import pytest

import kvrag

ROOT = Path(__file__).resolve().parents[1]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "CONTRIBUTING.md",
        ROOT / "benchmarks" / "README.md"]
DOTTED = re.compile(r"``?(kvrag(?:\.[A-Za-z_]\w*)+)(?:\(\))?``?")
MEMBER = re.compile(r"``?([A-Z]\w+)\.([a-z_]\w*)(?:\(\))?``?")


def _texts() -> list[tuple[str, str]]:
    """(where, text) of every docstring in the package's sources and of every doc."""
    found = []
    for folder in ("kvrag",):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        found.append((f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}", doc))
    found += [(str(path.relative_to(ROOT)), path.read_text()) for path in DOCS]
    return found


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


@functools.cache
def _classes() -> dict[str, list[type]]:
    """kvrag's classes by name, from every module that imports here."""
    by_name: dict[str, list[type]] = {}
    for info in pkgutil.walk_packages(kvrag.__path__, "kvrag."):
        if info.name.endswith("__main__"):  # running it is the command line
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001  (an optional dependency missing: its classes are not checked)
            continue
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and obj.__module__ == module.__name__ and obj not in by_name.get(name, []):
                by_name.setdefault(name, []).append(obj)
    return by_name


def _has_member(cls: type, member: str) -> bool:
    """An attribute, a field, or an instance attribute its methods set (``self.member``)."""
    return any(hasattr(c, member) or member in getattr(c, "__dataclass_fields__", {})
               or member in getattr(c, "__annotations__", {}) or member in getattr(c, "model_fields", {})
               or re.search(rf"self\.{member}\b", _source(c)) for c in cls.__mro__)


def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def test_every_dotted_kvrag_name_resolves():
    missing = sorted({f"{where}: {m.group(1)}" for where, text in _texts() for m in DOTTED.finditer(text)
                      if not _resolves(m.group(1))})
    assert not missing, "names that do not exist:\n" + "\n".join(missing)


@pytest.mark.filterwarnings("ignore")
def test_every_named_member_of_a_kvrag_class_exists():
    classes = _classes()
    missing = sorted({f"{where}: {m.group(1)}.{m.group(2)}" for where, text in _texts()
                      for m in MEMBER.finditer(text)
                      if len(classes.get(m.group(1), [])) == 1 and not _has_member(classes[m.group(1)][0], m.group(2))})
    assert not missing, "members that do not exist:\n" + "\n".join(missing)
