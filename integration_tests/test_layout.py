"""The monorepo's rules, checked: each package is laid out as DESIGN.md says
and imports only the layers below it, through their public names."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Each package and the pc packages it may import.
LAYERS = {
    "pc_comm": set(),
    "pc_offload": {"pc_comm"},
    "pc_chunk": {"pc_comm", "pc_offload"},
    "pc_zero": {"pc_comm", "pc_offload", "pc_chunk"},
    "pc_pipeline": {"pc_comm"},
    "pc_tensor": {"pc_comm"},
    "pc_booster": {"pc_comm", "pc_offload", "pc_chunk", "pc_zero", "pc_pipeline", "pc_tensor"},
    # The application on the library: Booster and its plugins through
    # pc_booster, the launch and health board of pc_comm, pc_tensor's policies
    # (pc-estimate counts what tensor parallelism shards), pc_chunk's
    # LazyInitContext (pc-train builds its model without memory).
    "pc_train": {"pc_comm", "pc_chunk", "pc_tensor", "pc_booster"},
}


def _project(module: str) -> Path:
    return ROOT / "packages" / module.replace("_", "-")


@pytest.mark.parametrize("module", sorted(LAYERS))
def test_package_layout(module: str) -> None:
    project = _project(module)
    distribution = module.replace("_", "-")
    assert f'name = "{distribution}"' in (project / "pyproject.toml").read_text()
    assert importlib.metadata.version(distribution)
    source = project / "src" / module
    assert (source / "py.typed").is_file()
    assert (project / "tests").is_dir()
    package = importlib.import_module(module)
    exported = package.__all__
    assert len(set(exported)) == len(exported), "duplicate names in __all__"
    missing = [name for name in exported if not hasattr(package, name)]
    assert not missing, f"{module}.__all__ names missing attributes: {missing}"
    declared = {
        dep.split(">")[0].split("=")[0].split("<")[0].strip().replace("-", "_")
        for dep in importlib.metadata.requires(distribution) or []
        if dep.startswith("pc-") and "extra ==" not in dep
    }
    assert declared == LAYERS[module], f"{module} declares {declared}"


@pytest.mark.parametrize("module", sorted(LAYERS))
def test_imports_only_lower_layers_through_public_names(module: str) -> None:
    allowed = LAYERS[module]
    for path in sorted((_project(module) / "src" / module).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if not top.startswith("pc_") or top == module:
                    continue
                assert top in allowed, f"{path}: {module} may not import {top}"
                private = [part for part in name.split(".")[1:] if part.startswith("_")]
                assert not private, f"{path}: imports private module {name}"


def _is_private(name: str) -> bool:
    """One leading underscore: ``_x``, not a dunder nor a mangled ``__x``."""
    return name.startswith("_") and not name.startswith("__")


def _sources(module: str) -> list[Path]:
    return sorted((_project(module) / "src" / module).rglob("*.py"))


@functools.cache
def _private_definitions(module: str) -> frozenset[str]:
    """The underscore names a package defines: attributes it assigns on
    ``self`` or ``cls`` (assigning ``other._x`` does not make ``_x`` ours),
    class attributes and dataclass or NamedTuple fields, functions, classes,
    variables, parameters and imports ``as _x``. Private module names do not
    count: ``os._exit`` is not a read of pc_comm/_exit.py (and
    test_imports_only_lower_layers_through_public_names refuses imports of
    private modules)."""
    defined: set[str] = set()
    for path in _sources(module):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id in {"self", "cls"}
            ):
                defined.add(node.attr)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.alias) and node.asname:
                defined.add(node.asname)
    return frozenset(name for name in defined if _is_private(name))


def _third_party_names(tree: ast.Module) -> set[str]:
    """Names a file binds by importing from outside pc (``os``, ``torch``,
    ``dist`` ...): ``os._exit`` or ``torch._C`` reads no pc package."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith("pc_"):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and not (node.module or "").startswith("pc_")
        ):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root_name(node: ast.expr) -> str | None:
    """``a`` for ``a``, ``a.b``, ``a.b.c``; None for anything else."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_reads(path: Path) -> list[tuple[int, str]]:
    """Where ``path`` reads an underscore attribute, ``x._name`` or
    ``getattr(x, "_name")`` / ``hasattr(x, "_name")``, of an object that is
    not reached from a module imported from outside pc."""
    tree = ast.parse(path.read_text())
    third_party = _third_party_names(tree)
    reads: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        receiver: ast.expr
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            receiver, name = node.value, node.attr
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Attribute):
            receiver, name = node.target.value, node.target.attr  # `x._n += 1` reads too
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "hasattr"}
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            receiver, name = node.args[0], node.args[1].value
        else:
            continue
        if _is_private(name) and _root_name(receiver) not in third_party:
            reads.append((node.lineno, name))
    return sorted(reads)


@pytest.mark.parametrize("module", sorted(LAYERS))
def test_reads_no_other_packages_underscore_attributes(module: str) -> None:
    """DESIGN.md, rule 7: a layer never reads another's underscore attributes.
    A read of ``x._name`` is refused when ``_name`` is defined nowhere in the
    reading package but is defined in another pc package; names no pc package
    defines (``module._parameters``, ``tensor._base`` ...) are not ours to police."""
    own = _private_definitions(module)
    violations: list[str] = []
    for path in _sources(module):
        for line, name in _private_reads(path):
            if name in own:
                continue
            owners = [
                other.replace("_", "-")
                for other in sorted(LAYERS)
                if other != module and name in _private_definitions(other)
            ]
            if owners:
                where = path.relative_to(ROOT)
                violations.append(f"{where}:{line}: reads {'/'.join(owners)}'s {name}")
    print("\n".join(violations))
    assert not violations, (
        f"{module} reads underscore attributes of other pc packages; ask the package "
        "that owns each for a public name instead:\n" + "\n".join(violations)
    )


# pc-booster keeps one module per plugin in plugins/, each with its own test
# file; these modules there are shared helpers, not plugins (layout.py holds
# ParallelLayout, the process groups some plugins are given).
PLUGIN_MODULES = ROOT / "packages" / "pc-booster" / "src" / "pc_booster" / "plugins"
HELPER_MODULES = {
    "common", "rules", "hybrid_options", "hybrid_pipeline", "hybrid_state", "layout",
    "optimizations", "sharded",
}  # fmt: skip


def test_each_plugin_module_has_its_test_file() -> None:
    plugins = sorted(
        path.stem
        for path in PLUGIN_MODULES.glob("*.py")
        if not path.stem.startswith("_") and path.stem not in HELPER_MODULES
    )
    tests = ROOT / "packages" / "pc-booster" / "tests"
    missing = [
        f"{(tests / f'test_plugin_{plugin}.py').relative_to(ROOT)} (for plugins/{plugin}.py)"
        for plugin in plugins
        if not (tests / f"test_plugin_{plugin}.py").is_file()
    ]
    assert not missing, (
        f"each plugin module needs its own test file; missing: {missing}. A module "
        f"that is a helper, not a plugin, belongs in HELPER_MODULES ({sorted(HELPER_MODULES)})."
    )
