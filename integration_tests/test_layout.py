"""The monorepo's rules, checked: each package is laid out as DESIGN.md says
and imports only the layers below it, through their public names."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
from pathlib import Path

import pytest
import structure

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
    "common", "rules", "hybrid_options", "gemini_options", "hybrid_pipeline", "hybrid_state",
    "layout", "optimizations", "sharded", "experts", "hybrid_experts_state", "fsdp_tp", "tp_state",
    "pipeline_tp",
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


# -- structure: one owner per concern [issue 41] ----------------------------------------

# The packages whose modules are held to MODULE_LINES (the application and
# the layers built most recently; the lower layers' few long modules are
# each one algorithm: the chunk, the shared-memory ring, ZeRO's optimizer).
SHORT_MODULES = ("pc_booster", "pc_compat", "pc_train")
MODULE_LINES = 600
FUNCTION_LINES, LONG_FUNCTIONS_ALLOWED = 80, 3
BOOSTER_LINES = 250
# Writes structure.foreign_writes flags that are on objects pc made itself:
# the tensor materialise_ builds and then swaps into the lazy one's place.
OWN_OBJECT_WRITES = {("packages/pc-chunk/src/pc_chunk/lazy.py", "update on __dict__")}


@pytest.mark.parametrize("package", structure.all_packages())
def test_no_import_circle_between_a_packages_modules(package: str) -> None:
    """Imports inside functions count (a circle deferred is still one);
    imports under ``if TYPE_CHECKING:`` never run and do not."""
    found = structure.circles(structure.import_graph(package))
    assert not found, (
        f"{package}: modules that import each other, directly or around a circle: {found}. "
        "Move what both need into a module below them (docs/architecture.md)."
    )


# Circles that only annotation imports close, still to be cut (issue 53:
# the hybrid plugin composed from strategies that depend on a small
# interface, not on the plugin; the rules apart from the Plugin class).
# A circle not listed here, or one that grew, fails.
ANNOTATION_CIRCLES = {
    ("pc_booster.plugin", "pc_booster.rules"),
    (
        "pc_booster.plugins.experts",
        "pc_booster.plugins.hybrid",
        "pc_booster.plugins.hybrid_experts_state",
        "pc_booster.plugins.hybrid_pipeline",
        "pc_booster.plugins.hybrid_state",
        "pc_booster.plugins.pipeline_tp",
    ),
}


@pytest.mark.parametrize("package", structure.all_packages())
def test_no_import_circle_counting_annotation_imports(package: str) -> None:
    """The same, counting the imports under ``if TYPE_CHECKING:`` too."""
    found = structure.circles(structure.import_graph(package, annotations=True))
    unknown = [c for c in found if tuple(sorted(c)) not in ANNOTATION_CIRCLES]
    assert not unknown, (
        f"{package}: modules that import each other, counting imports for annotations: "
        f"{unknown}. Move what both need into a module below them (pc_train.shape holds "
        "ModelShape for this reason)."
    )


def test_modules_of_the_application_layers_are_short() -> None:
    long = {
        str(path.relative_to(ROOT)): lines
        for package in SHORT_MODULES
        for path, lines in structure.module_lines(package).items()
        if lines > MODULE_LINES
    }
    assert not long, f"modules over {MODULE_LINES} lines: {long}; split them by concern."


def test_few_long_functions() -> None:
    long = [
        f"{path.relative_to(ROOT)}: {name} ({lines} lines)"
        for path, name, lines in structure.long_functions(FUNCTION_LINES)
    ]
    assert len(long) <= LONG_FUNCTIONS_ALLOWED, (
        f"{len(long)} functions over {FUNCTION_LINES} lines (at most "
        f"{LONG_FUNCTIONS_ALLOWED}): {long}"
    )


@pytest.mark.parametrize("package", structure.all_packages())
def test_no_class_changes_or_private_state_on_objects_pc_does_not_own(package: str) -> None:
    """DEVELOPERS.md: never change a user's object behind their back. No
    ``x.__class__ =``, no ``x.__dict__`` writes, no ``_pc...`` attributes
    set on an ``x`` that is not the method's own ``self``: a registry or a
    wrapper object holds what pc needs to remember."""
    writes = [
        write
        for write in structure.foreign_writes(package)
        if (write.split(":")[0], write.split(": ", 1)[1]) not in OWN_OBJECT_WRITES
    ]
    assert not writes, f"{package} writes on objects it does not own: {writes}"


def test_booster_is_a_small_front() -> None:
    path = ROOT / "packages" / "pc-booster" / "src" / "pc_booster" / "booster.py"
    lines = len(path.read_text().splitlines())
    assert lines < BOOSTER_LINES, (
        f"booster.py has {lines} lines; Booster delegates (checkpoints: pc_booster.checkpoint)."
    )


def test_the_structure_checks_can_fail(tmp_path: Path) -> None:
    """Each check above on a small tree that breaks it."""
    source = tmp_path / "packages" / "pc-demo" / "src" / "pc_demo"
    source.mkdir(parents=True)
    (source / "__init__.py").write_text("")
    (source / "a.py").write_text("def f():\n    from pc_demo import b\n")
    (source / "b.py").write_text(
        "from pc_demo.a import f\n"
        "def g(x, opt):\n    x.__class__ = int\n    opt.__dict__['k'] = 1\n"
        "    setattr(x, '_pc_tag', 1)\n    self_like = x\n    self_like._pc_other = 2\n"
        "def long():\n" + "    pass\n" * 90
    )
    old = structure.PACKAGES, structure.ROOT, structure.PORTED
    structure.PACKAGES, structure.ROOT = tmp_path / "packages", tmp_path
    structure.PORTED = tmp_path / "ported"
    try:
        assert structure.circles(structure.import_graph("pc_demo")) == [["pc_demo.a", "pc_demo.b"]]
        writes = structure.foreign_writes("pc_demo")
        assert len(writes) == 4, writes
        assert [name for _, name, _ in structure.long_functions(FUNCTION_LINES)] == ["long"]
    finally:
        structure.PACKAGES, structure.ROOT, structure.PORTED = old
