"""Facts about the source tree's structure, for test_layout.py and for
anyone who asks (``python integration_tests/structure.py`` prints them):
import circles between a package's modules, module and function lengths,
and writes of ``__class__`` / ``__dict__`` / ``_pc...`` attributes on
objects pc does not own."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "packages"


def package_sources(package: str) -> dict[str, Path]:
    """Module name -> path for every module of ``package`` (``pc_booster``)."""
    src = PACKAGES / package.replace("_", "-") / "src"
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name of a ``from ... import`` statement."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _runtime_nodes(tree: ast.Module) -> Iterator[ast.AST]:
    """Every node of ``tree`` but the bodies of ``if TYPE_CHECKING:``
    (imports for annotations only, never executed)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, ast.If)
                and isinstance(child.test, ast.Name)
                and child.test.id == "TYPE_CHECKING"
            ):
                stack.extend(child.orelse)
                continue
            stack.append(child)


def import_graph(package: str, *, annotations: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, anywhere in
    its body (imports inside functions count: they are circles deferred;
    imports under ``if TYPE_CHECKING:`` are never executed and count only
    with ``annotations``: a module that needs another's names to describe
    its own still depends on it). ``from pkg import name`` is an edge to
    ``pkg.name`` when that is a module, else to ``pkg`` (its ``__init__``)."""
    sources = package_sources(package)
    graph: dict[str, set[str]] = {name: set() for name in sources}
    for name, path in sources.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree) if annotations else _runtime_nodes(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in sources else base)
            for target in targets:
                while target and target not in sources:  # a.b.c -> the module a.b
                    target = target.rpartition(".")[0]
                if target and target != name and target.split(".")[0] == package:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def all_packages() -> list[str]:
    return sorted(
        path.name for path in PACKAGES.glob("*/src/pc_*") if (path / "__init__.py").is_file()
    )


def module_lines(package: str) -> dict[Path, int]:
    return {path: len(path.read_text().splitlines()) for path in package_sources(package).values()}


# Colossal-AI's own example programs, ported by the import rule alone
# (integration_tests/compat/examples/README.md): their functions stay as
# their authors wrote them.
PORTED = ROOT / "integration_tests" / "compat" / "examples"


def repo_python_files() -> Iterator[Path]:
    """Every Python file of the repository that pc's authors wrote:
    packages (sources and tests), integration tests, benchmarks, tools."""
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).parts
        if rel[0].startswith(".") or rel[0] in {"site", "build"} or path.is_relative_to(PORTED):
            continue
        yield path


def long_functions(limit: int = 80) -> list[tuple[Path, str, int]]:
    """(file, function, lines) for every function longer than ``limit`` lines."""
    out = []
    for path in repo_python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > limit:
                    out.append((path, node.name, length))
    return sorted(out, key=lambda row: -row[2])


def _owned(target: ast.expr) -> bool:
    """``self.x`` / ``cls.x``: the object whose method this is."""
    while isinstance(target, ast.Attribute | ast.Subscript):
        target = target.value
    return isinstance(target, ast.Name) and target.id in {"self", "cls"}


def foreign_writes(package: str) -> list[str]:
    """Where ``package`` changes an object's class (``x.__class__ = ``),
    writes its ``__dict__`` (``x.__dict__[k] = ``, ``x.__dict__.update``)
    or sets a ``_pc`` attribute on it (``x._pc_tag = ``,
    ``setattr(x, "_pc_tag", ...)``), for an ``x`` that is not ``self``:
    behaviour and state pc adds to objects a user built."""
    out = []
    for path in package_sources(package).values():
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and not _owned(target.value)
                    and (target.attr == "__class__" or target.attr.startswith("_pc"))
                ):
                    out.append(f"{where}: assigns .{target.attr}")
                if (
                    isinstance(target, ast.Subscript)
                    and isinstance(target.value, ast.Attribute)
                    and target.value.attr == "__dict__"
                    and not _owned(target.value.value)
                ):
                    out.append(f"{where}: writes __dict__")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                func = node.func
                if (
                    isinstance(func.value, ast.Attribute)
                    and func.value.attr == "__dict__"
                    and func.attr in {"update", "setdefault", "pop", "__setitem__"}
                    and not _owned(func.value.value)
                ):
                    out.append(f"{where}: {func.attr} on __dict__")
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in {"setattr", "delattr"}
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and (node.args[1].value.startswith("_pc") or node.args[1].value == "__class__")
                and not _owned(node.args[0])
            ):
                out.append(f"{where}: {node.func.id} {node.args[1].value}")
    return out


if __name__ == "__main__":
    for package in all_packages():
        for circle in circles(import_graph(package)):
            print(f"circle in {package}: {circle}")
        for path, lines in module_lines(package).items():
            if lines > 600:
                print(f"{path.relative_to(ROOT)}: {lines} lines")
        for write in foreign_writes(package):
            print(write)
    for path, name, lines in long_functions():
        print(f"{path.relative_to(ROOT)}: {name} {lines} lines")
