"""kvrag's modules import each other at their tops, without cycles; the few imports inside functions say why.

Every module of the package is parsed with `ast` (nothing imported). A module's imports are its edges, at module
level and inside functions alike; those under ``if TYPE_CHECKING:`` never run and are left out. The graph must have
no cycle: a cycle is what an import hidden inside a function usually holds apart. An import inside a function is
allowed only for a reason a reader can check (an optional dependency, a library slow to import that one path needs,
the command line's dispatch), so there are fewer than `MAX_DEFERRED` of them and each carries a comment on its line
or the line above.
"""

from __future__ import annotations

import ast
import functools

from test_layering import _modules, import_targets

MAX_DEFERRED = 20
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _resolve(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The kvrag modules an import statement names (`import_targets`, ``import kvrag.x.y``'s name inside a module
    taken as its module).
    """
    found = []
    for name in import_targets(module, node):
        while name not in _modules() and "." in name:
            name = name.rpartition(".")[0]
        if name in _modules():
            found.append(name)
    return found


@functools.cache
def _statements() -> tuple[tuple[str, int, bool, tuple[str, ...]], ...]:
    """Every import statement outside ``if TYPE_CHECKING:``: (module, line, inside a function, kvrag targets)."""
    found = []
    for module, (path, _) in _modules().items():
        pending: list[tuple[ast.AST, bool]] = [(ast.parse(path.read_text(), filename=str(path)), False)]
        while pending:
            node, in_function = pending.pop()
            for child in ast.iter_child_nodes(node):
                if _is_type_checking(child):
                    continue
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    found.append((module, child.lineno, in_function, tuple(_resolve(module, child))))
                pending.append((child, in_function or isinstance(child, _FUNCTIONS)))
    return tuple(found)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle() -> None:
    graph: dict[str, set[str]] = {module: set() for module in _modules()}
    for module, _, _, targets in _statements():
        graph[module].update(target for target in targets if target != module)
    cycles = _cycles(graph)
    assert not cycles, "import cycles (imports inside functions included):\n" + "\n".join(map(" ".join, cycles))


def test_few_imports_inside_functions_each_with_its_reason() -> None:
    deferred = [(module, line) for module, line, in_function, _ in _statements() if in_function]
    assert len(deferred) < MAX_DEFERRED, f"{len(deferred)} imports inside functions: {deferred}"
    silent = []
    for module, line in deferred:
        lines = _modules()[module][0].read_text().splitlines()
        statement, above = lines[line - 1], lines[line - 2] if line > 1 else ""
        if "#" not in statement and "#" not in above:
            silent.append(f"{module}:{line}")
    assert not silent, "imports inside functions without a comment saying why: " + ", ".join(silent)
