"""Stages import downward only: no module of kvrag imports a package of a later stage.

Every module of the ``kvrag`` package (``kvrag/``, whose folders are its subpackages) is parsed with `ast`, nothing
imported, and every ``import``/``from ... import`` is checked: at module level, inside functions and under ``if
TYPE_CHECKING:`` alike. An import of a package's ``__init__`` (``from kvrag.fusion import Selector``) counts as
that package; ``from kvrag import X`` counts as the submodule ``kvrag.X`` where there is one and as the root
package (the facade) otherwise. The stage order follows docs/architecture.md; imports within one stage are allowed.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]

_FOUNDATION, _FACADE, _FRONT_END = 0, 9, 10
# kvrag's top-level modules and subpackages, by stage (docs/architecture.md's package table).
STAGE: dict[str, int] = {
    # foundation: configuration, errors, the prompt layout, lazy exports, atomic files, the model
    "kvrag.config": _FOUNDATION,
    "kvrag.errors": _FOUNDATION,
    "kvrag.prompt": _FOUNDATION,
    "kvrag.lazy": _FOUNDATION,
    "kvrag.atomic_files": _FOUNDATION,
    "kvrag.embedder": _FOUNDATION,
    "kvrag.mean_pooled": _FOUNDATION,
    "kvrag.native_bert": _FOUNDATION,
    "kvrag.byte_lru": _FOUNDATION,
    "kvrag.sizes": _FOUNDATION,
    "kvrag.user_cache": _FOUNDATION,
    "kvrag.trusted_paths": _FOUNDATION,
    "kvrag.model": _FOUNDATION,
    # the storage format, and its optional Triton decoder (which checks itself against the CPU one)
    "kvrag.codec": 1,
    "kvrag.kernels": 1,
    "kvrag.storage": 2,
    "kvrag.indexing": 3,  # a sibling of the question-time stages, not under them (`QUESTION_TIME`)
    "kvrag.loading": 4,
    "kvrag.fusion": 5,
    "kvrag.generation": 6,
    "kvrag.query": 7,
    "kvrag.chat": 8,
    # the facade: `KVRag` (with its flat-prompt answers), index repair, and the root package that re-exports them
    "kvrag": _FACADE,
    "kvrag.rag": _FACADE,
    "kvrag.backend": _FACADE,  # the interface the adapters and the server take: `KVRag` or a passage cache
    "kvrag.prompt_answers": _FACADE,
    "kvrag.repair": _FACADE,
    "kvrag.passages": _FACADE,  # answers without an index, over a passage cache
    # front ends
    "kvrag.serve": _FRONT_END,
    "kvrag.cli": _FRONT_END,
    "kvrag.bench": _FRONT_END,
    # adapters over the public API
    "kvrag.integrations": _FRONT_END + 1,
}


# question-time stages: they share storage and the foundation with indexing but never import it
QUESTION_TIME = ("kvrag.loading", "kvrag.fusion", "kvrag.generation", "kvrag.query", "kvrag.chat")


def _package_dirs() -> dict[str, Path]:
    """``kvrag``'s folder: every subpackage is a folder in it (pyproject maps none in from elsewhere)."""
    mapped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"].get("package-dir", {})
    assert not mapped, f"packages mapped in from other folders: {mapped}; keep the folder the import path"
    return {"kvrag": ROOT / "kvrag"}


@functools.cache
def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module's dotted name -> (its file, whether it is a package's ``__init__``)."""
    found = {}
    for package, folder in _package_dirs().items():
        for path in sorted(folder.rglob("*.py")):
            parts = [*package.split("."), *path.relative_to(folder).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _unit(module: str) -> str:
    """The entry of `STAGE` a module belongs to: ``kvrag`` itself or ``kvrag.<first component>``."""
    return ".".join(module.split(".")[:2])


def import_targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The kvrag names an import statement of ``module`` imports: a submodule where ``from package import name``
    names one, else the package (or module) itself; ``import kvrag.x`` as written.
    """
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        package = module if _modules()[module][1] else module.rpartition(".")[0]
        if node.level:  # relative: resolve against the importing module's package
            base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            source = ".".join([*base, *([node.module] if node.module else [])])
        else:
            source = node.module or ""
        names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in _modules() else source
                 for alias in node.names]
    return [name for name in names if name.split(".")[0] == "kvrag"]


@functools.cache
def _imports(module: str) -> tuple[tuple[str, int], ...]:
    """The kvrag modules ``module`` imports, each with its line, wherever in the file the import is."""
    path = _modules()[module][0]
    return tuple((name, node.lineno) for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
                 if isinstance(node, (ast.Import, ast.ImportFrom)) for name in import_targets(module, node))


def _violations() -> list[str]:
    upward = []
    for module in _modules():
        here = STAGE[_unit(module)]
        for imported, line in sorted(set(_imports(module)), key=lambda item: (item[1], item[0])):
            there = STAGE.get(_unit(imported))
            if there is not None and there > here:
                upward.append(f"{module} -> {imported} (line {line})")
    return upward


def test_every_module_and_import_has_a_stage() -> None:
    units = {_unit(module) for module in _modules()}
    units |= {_unit(imported) for module in _modules() for imported, _ in _imports(module)}
    missing = sorted(units - STAGE.keys())
    assert not missing, f"give these a stage in STAGE (tests/test_layering.py): {missing}"


def test_no_module_imports_a_later_stage() -> None:
    upward = _violations()
    assert not upward, "imports of a later stage:\n" + "\n".join(upward)


def test_question_time_never_imports_indexing() -> None:
    reaching = [f"{module} -> {imported} (line {line})" for module in _modules() if _unit(module) in QUESTION_TIME
                for imported, line in _imports(module) if _unit(imported) == "kvrag.indexing"]
    assert not reaching, "question-time modules importing kvrag.indexing:\n" + "\n".join(reaching)


if __name__ == "__main__":
    print("\n".join(_violations()) or "no upward imports")
