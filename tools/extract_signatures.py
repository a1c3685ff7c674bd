"""Record the public call signatures of another project's Python API as JSON.

pc-compat mirrors the public API of Colossal-AI and haiscale. This tool writes
down the facts the mirror has to match: for each target, the parameter names,
their kinds and the source text of their defaults. It reads the other
project's source from a git object store (``git show``) or a plain directory
and parses it with :mod:`ast`; nothing of it is imported or executed.

A target is a public module path (the import users write) and a name in it:
``Booster`` (its ``__init__``), ``Booster.save_model`` (a method) or
``launch`` (a function). Re-exports (``from .x import Name``, star imports,
``Name = Other``) are followed to the defining file. A class without its own
``__init__`` takes the one of its first base defined in the same source, or
its dataclass fields.

    python tools/extract_signatures.py --git-dir DIR [--commit REV] -o out.json
    python tools/extract_signatures.py --haiscale --src-dir DIR \
        --manual out.json -o out.json
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

Json = dict[str, object]
FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef
DefinitionNode = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class Target:
    """``name`` in public module ``module``; ``Class.method`` names a method.
    ``alternatives`` are other public modules to look in when ``module`` does
    not provide the name (the result then says where it was found)."""

    module: str
    name: str
    alternatives: tuple[str, ...] = ()


def _targets(module: str, *names: str) -> list[Target]:
    return [Target(module, name) for name in names]


_BOOSTER_METHODS = (
    "boost",
    "backward",
    "execute_pipeline",
    "no_sync",
    "enable_lora",
    "load_model",
    "save_model",
    "load_optimizer",
    "save_optimizer",
    "save_lr_scheduler",
    "load_lr_scheduler",
)
_COORDINATOR_METHODS = ("print_on_master", "is_master", "block_all", "destroy", "on_master_only")

COLOSSALAI_TARGETS: tuple[Target, ...] = (
    *_targets("colossalai", "launch", "launch_from_torch"),
    *_targets("colossalai.accelerator", "get_accelerator"),
    *_targets("colossalai.booster", "Booster", *(f"Booster.{m}" for m in _BOOSTER_METHODS)),
    *_targets(
        "colossalai.booster.plugin",
        "TorchDDPPlugin",
        "TorchFSDPPlugin",
        "LowLevelZeroPlugin",
        "GeminiPlugin",
        "HybridParallelPlugin",
        "MoeHybridParallelPlugin",
        "Plugin.prepare_dataloader",
        "GeminiPlugin.prepare_dataloader",
        "HybridParallelPlugin.prepare_dataloader",
    ),
    *_targets("colossalai.booster.plugin.dp_plugin_base", "DPPluginBase.prepare_dataloader"),
    Target(
        "colossalai.booster.checkpoint_io", "GeneralCheckpointIO", ("colossalai.checkpoint_io",)
    ),
    *_targets(
        "colossalai.cluster",
        "DistCoordinator",
        *(f"DistCoordinator.{m}" for m in _COORDINATOR_METHODS),
        "ProcessGroupMesh",
    ),
    *_targets("colossalai.lazy", "LazyInitContext"),
    *_targets("colossalai.logging", "get_dist_logger", "disable_existing_loggers"),
    *_targets(
        "colossalai.nn.lr_scheduler",
        "CosineAnnealingLR",
        "CosineAnnealingWarmupLR",
        "ExponentialLR",
        "ExponentialWarmupLR",
        "FlatAnnealingLR",
        "FlatAnnealingWarmupLR",
        "FlatAnnealingWarmmupLR",
        "LambdaLR",
        "LinearWarmupLR",
        "MultiStepLR",
        "MultiStepWarmupLR",
        "MultiplicativeLR",
        "OneCycleLR",
        "PolynomialLR",
        "PolynomialWarmupLR",
        "StepLR",
    ),
    *_targets(
        "colossalai.nn.optimizer",
        "CPUAdam",
        "DistributedAdaFactor",
        "DistributedCAME",
        "DistributedLamb",
        "FusedAdam",
        "FusedLAMB",
        "FusedSGD",
        "HybridAdam",
        "Lamb",
        "Lars",
    ),
    *_targets("colossalai.shardformer", "ShardConfig", "ShardFormer"),
    *_targets("colossalai.utils", "get_current_device", "set_seed"),
    *_targets(
        "colossalai.zero",
        "GeminiAdamOptimizer",
        "GeminiDDP",
        "GeminiOptimizer",
        "LowLevelZeroOptimizer",
        "zero_model_wrapper",
        "zero_optim_wrapper",
    ),
    Target("colossalai.zero", "ColoInitContext", ("colossalai.legacy.zero.gemini",)),
    *_targets(
        "colossalai.zero.gemini", "ChunkManager", "GeminiManager", "search_chunk_configuration"
    ),
)

HAISCALE_TARGETS: tuple[Target, ...] = (
    *_targets("haiscale.cpu_offload", "CPUOffload"),
    *_targets("haiscale.ddp", "DistributedDataParallel"),
    *_targets("haiscale.fsdp", "FullyShardedDataParallel"),
    *_targets(
        "haiscale.pipeline",
        "GPipe",
        "Interleaved1F1B",
        "PipeDream",
        "SequentialModel",
        "make_subgroups",
        "partition",
    ),
)

# Bases whose __init__ takes no arguments: a class that inherits only these
# and has no __init__ of its own is called with none.
_NO_ARGUMENT_BASES = frozenset({"object", "ABC", "abc.ABC"})


class SourceTree(Protocol):
    def paths(self) -> frozenset[str]: ...

    def read(self, path: str) -> str: ...


class GitTree:
    """The files of one commit in a git object store (bare or not)."""

    def __init__(self, git_dir: Path, commit: str) -> None:
        self.git_dir = git_dir
        self.commit = self._git("rev-parse", "--verify", f"{commit}^{{commit}}").strip()
        listing = self._git("ls-tree", "-r", "--name-only", "-z", self.commit)
        self._paths = frozenset(p for p in listing.split("\0") if p)

    def _git(self, *args: str) -> str:
        return subprocess.run(
            ["git", f"--git-dir={self.git_dir}", *args],
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    def paths(self) -> frozenset[str]:
        return self._paths

    def read(self, path: str) -> str:
        return self._git("show", f"{self.commit}:{path}")


class DirectoryTree:
    """The ``.py`` files under a plain directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._paths = frozenset(p.relative_to(root).as_posix() for p in root.rglob("*.py"))

    def paths(self) -> frozenset[str]:
        return self._paths

    def read(self, path: str) -> str:
        return (self.root / path).read_text(encoding="utf-8")


@dataclass(frozen=True)
class Definition:
    module: str  # the dotted module whose file holds the node
    path: str
    node: DefinitionNode


def _statements(body: Sequence[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements in source order, including those under
    ``if``/``try`` (conditional imports and definitions)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            yield from _statements(stmt.body)
            yield from _statements(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            yield from _statements(stmt.body)
            for handler in stmt.handlers:
                yield from _statements(handler.body)
            yield from _statements(stmt.orelse)
            yield from _statements(stmt.finalbody)


def _decorator_names(node: DefinitionNode) -> list[str]:
    names = []
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        names.append(ast.unparse(target))
    return names


def _is_overload(node: DefinitionNode) -> bool:
    return any(name in ("overload", "typing.overload") for name in _decorator_names(node))


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any(name in ("dataclass", "dataclasses.dataclass") for name in _decorator_names(node))


def _dataclass_kw_only(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        if isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith("dataclass"):
            for keyword in decorator.keywords:
                if keyword.arg == "kw_only" and isinstance(keyword.value, ast.Constant):
                    return bool(keyword.value.value)
    return False


def _parameter(name: str, kind: str, default: ast.expr | None) -> Json:
    return {
        "name": name,
        "kind": kind,
        "default": None if default is None else ast.unparse(default),
    }


def _function_parameters(node: FunctionNode, drop_first: bool) -> list[Json]:
    args = node.args
    positional = [*args.posonlyargs, *args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
    defaults.extend(args.defaults)
    result: list[Json] = []
    for index, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        kind = "positional_only" if index < len(args.posonlyargs) else "positional_or_keyword"
        if drop_first and index == 0:
            continue  # self / cls
        result.append(_parameter(arg.arg, kind, default))
    if args.vararg is not None:
        result.append(_parameter(args.vararg.arg, "var_positional", None))
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        result.append(_parameter(arg.arg, "keyword_only", kw_default))
    if args.kwarg is not None:
        result.append(_parameter(args.kwarg.arg, "var_keyword", None))
    return result


def _dataclass_fields(node: ast.ClassDef) -> Iterator[tuple[str, ast.expr | None]]:
    """(name, default) of the fields a dataclass's generated __init__ takes."""
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        annotation = ast.unparse(stmt.annotation)
        if annotation.split("[")[0] in ("ClassVar", "typing.ClassVar", "KW_ONLY"):
            continue
        value = stmt.value
        if isinstance(value, ast.Call) and ast.unparse(value.func) in (
            "field",
            "dataclasses.field",
        ):
            excluded = any(
                k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
                for k in value.keywords
            )
            if excluded:
                continue
            if not any(k.arg in ("default", "default_factory") for k in value.keywords):
                value = None
        yield stmt.target.id, value


class Extractor:
    def __init__(self, tree: SourceTree) -> None:
        self.tree = tree
        self._parsed: dict[str, ast.Module] = {}

    # -- modules and names ------------------------------------------------

    def module_path(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for candidate in (f"{base}/__init__.py", f"{base}.py"):
            if candidate in self.tree.paths():
                return candidate
        return None

    def _parse(self, path: str) -> ast.Module:
        if path not in self._parsed:
            self._parsed[path] = ast.parse(self.tree.read(path), filename=path)
        return self._parsed[path]

    @staticmethod
    def _absolute(module: str, path: str, stmt: ast.ImportFrom) -> str:
        if stmt.level == 0:
            return stmt.module or ""
        parts = module.split(".")
        if not path.endswith("__init__.py"):
            parts = parts[:-1]  # a plain module's package
        if stmt.level > 1:
            parts = parts[: len(parts) - (stmt.level - 1)]
        if stmt.module:
            parts.append(stmt.module)
        return ".".join(parts)

    def resolve(
        self, module: str, name: str, seen: frozenset[tuple[str, str]] = frozenset()
    ) -> Definition | None:
        """The class or function that ``from module import name`` binds, when
        it is defined in this source; ``None`` otherwise."""
        key = (module, name)
        if key in seen:
            return None
        seen = seen | {key}
        path = self.module_path(module)
        if path is None:
            return None
        star_sources: list[str] = []
        for stmt in _statements(self._parse(path).body):
            if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                if stmt.name == name and not _is_overload(stmt):
                    return Definition(module, path, stmt)
            elif isinstance(stmt, ast.ImportFrom):
                source = self._absolute(module, path, stmt)
                for alias in stmt.names:
                    if alias.name == "*":
                        star_sources.append(source)
                    elif (alias.asname or alias.name) == name:
                        return self.resolve(source, alias.name, seen)
            elif (
                isinstance(stmt, ast.Assign)
                and isinstance(stmt.value, ast.Name)
                and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
            ):
                return self.resolve(module, stmt.value.id, seen)  # Name = Other
        for source in star_sources:
            found = self.resolve(source, name, seen)
            if found is not None:
                return found
        return None

    # -- classes ------------------------------------------------------------

    def _bases(self, cls: Definition) -> Iterator[tuple[str, Definition | None]]:
        assert isinstance(cls.node, ast.ClassDef)
        for base in cls.node.bases:
            text = ast.unparse(base)
            found = self.resolve(cls.module, base.id) if isinstance(base, ast.Name) else None
            if found is not None and not isinstance(found.node, ast.ClassDef):
                found = None
            yield text, found

    @staticmethod
    def _own_method(cls: ast.ClassDef, name: str) -> FunctionNode | None:
        """The class body's definition of ``name``: the first one, looking
        under ``if``/``try`` too (version-gated methods), ``@overload``
        stubs skipped."""
        for stmt in _statements(cls.body):
            if (
                isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef)
                and stmt.name == name
                and not _is_overload(stmt)
            ):
                return stmt
        return None

    def find_method(
        self, cls: Definition, name: str, *, dataclass_init: bool = False
    ) -> tuple[Definition, FunctionNode | None] | None:
        """The class (and method) that provides ``name`` for ``cls``: its own
        definition, else its in-source bases in order, depth first. With
        ``dataclass_init``, a dataclass without its own ``__init__`` provides
        one (the method is then ``None``)."""
        assert isinstance(cls.node, ast.ClassDef)
        own = self._own_method(cls.node, name)
        if own is not None:
            return cls, own
        if dataclass_init and _is_dataclass(cls.node):
            return cls, None
        for _, base in self._bases(cls):
            if base is not None:
                found = self.find_method(base, name, dataclass_init=dataclass_init)
                if found is not None:
                    return found
        return None

    def _external_bases(self, cls: Definition) -> list[str]:
        """Bases of ``cls`` and of its in-source ancestors not defined here."""
        result: list[str] = []
        for text, base in self._bases(cls):
            if base is None:
                result.append(text)
            else:
                result.extend(self._external_bases(base))
        return result

    def _collect_fields(self, cls: Definition, fields: dict[str, Json]) -> None:
        """Dataclass fields in the order the generated __init__ takes them:
        base dataclasses' first (in reverse base order), a redefined field
        keeping its first position and taking its new default and kind."""
        assert isinstance(cls.node, ast.ClassDef)
        for _, base in reversed(list(self._bases(cls))):
            if (
                base is not None
                and isinstance(base.node, ast.ClassDef)
                and _is_dataclass(base.node)
            ):
                self._collect_fields(base, fields)
        kind = "keyword_only" if _dataclass_kw_only(cls.node) else "positional_or_keyword"
        for name, default in _dataclass_fields(cls.node):
            fields[name] = _parameter(name, kind, default)

    def _dataclass_parameters(self, cls: Definition) -> list[Json]:
        fields: dict[str, Json] = {}
        self._collect_fields(cls, fields)
        return list(fields.values())

    # -- targets ------------------------------------------------------------

    def extract(self, target: Target) -> Json | None:
        for module in (target.module, *target.alternatives):
            found = self._extract_from(module, target.name)
            if found is not None:
                return found
        return None

    def _extract_from(self, module: str, name: str) -> Json | None:
        owner_name, _, method_name = name.partition(".")
        defn = self.resolve(module, owner_name)
        if defn is None:
            return None
        entry: Json = {"module": module, "name": name}
        if method_name:
            if not isinstance(defn.node, ast.ClassDef):
                return None
            found = self.find_method(defn, method_name)
            if found is None:
                return None
            holder, method = found
            assert isinstance(holder.node, ast.ClassDef)
            assert method is not None  # dataclass_init was not asked for
            static = "staticmethod" in _decorator_names(method)
            qualified = f"{holder.node.name}.{method.name}"
            entry.update(kind="method", file=holder.path, definition=qualified)
            entry["parameters"] = _function_parameters(method, drop_first=not static)
            decorators = _decorator_names(method)
        elif isinstance(defn.node, ast.ClassDef):
            entry.update(kind="class")
            found = self.find_method(defn, "__init__", dataclass_init=True)
            if found is None:
                external = self._external_bases(defn)
                entry.update(file=defn.path, definition=f"{defn.node.name} (no __init__ in source)")
                no_arguments = all(b in _NO_ARGUMENT_BASES for b in external)
                entry["parameters"] = [] if no_arguments else None
                if external:
                    entry["external_bases"] = external
            else:
                holder, init = found
                assert isinstance(holder.node, ast.ClassDef)
                entry["file"] = holder.path
                if init is None:
                    entry["definition"] = f"{holder.node.name} (dataclass fields)"
                    entry["parameters"] = self._dataclass_parameters(holder)
                else:
                    entry["definition"] = f"{holder.node.name}.__init__"
                    entry["parameters"] = _function_parameters(init, drop_first=True)
            decorators = _decorator_names(defn.node)
        else:
            entry.update(kind="function", file=defn.path, definition=defn.node.name)
            entry["parameters"] = _function_parameters(defn.node, drop_first=False)
            decorators = _decorator_names(defn.node)
        if decorators:
            entry["decorators"] = decorators
        return entry


def _key(entry: Json) -> tuple[str, str]:
    return str(entry["module"]), str(entry["name"])


def build_document(
    tree: SourceTree,
    targets: Sequence[Target],
    source: str,
    commit: str | None,
    manual: Json | None = None,
) -> Json:
    extractor = Extractor(tree)
    signatures: list[Json] = []
    missing: list[str] = []
    relocated: list[Json] = []
    for target in targets:
        entry = extractor.extract(target)
        requested = f"{target.module}:{target.name}"
        if entry is None:
            missing.append(requested)
            continue
        if entry["module"] != target.module:
            relocated.append(
                {"requested": requested, "found": f"{entry['module']}:{entry['name']}"}
            )
        signatures.append(entry)

    document: Json = {"source": source, "commit": commit}
    if manual is not None:
        # Hand-written entries fill the targets this source lacks; keys the
        # tool does not own (provenance notes, source lists) are kept.
        extracted = {_key(e) for e in signatures}
        manual_entries = manual.get("signatures", [])
        assert isinstance(manual_entries, list)
        for entry in manual_entries:
            assert isinstance(entry, dict)
            provenance = str(entry.get("provenance", ""))
            if provenance.startswith("by hand") and _key(entry) not in extracted:
                signatures.append(entry)
                extracted.add(_key(entry))
        missing = [m for m in missing if tuple(m.split(":", 1)) not in extracted]
        owned = {"source", "commit", "signatures", "missing", "relocated"}
        document.update({k: v for k, v in manual.items() if k not in owned})
    document["signatures"] = sorted(signatures, key=_key)
    document["missing"] = sorted(missing)
    if relocated:
        document["relocated"] = sorted(relocated, key=lambda r: str(r["requested"]))
    return document


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Extract public call signatures from Python source, without importing it."
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--git-dir", type=Path, help="git directory to read the source from")
    where.add_argument("--src-dir", type=Path, help="plain directory to read the source from")
    parser.add_argument("--commit", default="HEAD", help="revision to read with --git-dir (HEAD)")
    parser.add_argument(
        "--haiscale",
        action="store_true",
        help="extract haiscale's targets instead of Colossal-AI's",
    )
    parser.add_argument("--source", help="the 'source' field (hpcaitech/ColossalAI or haiscale)")
    parser.add_argument(
        "--manual",
        type=Path,
        help="JSON whose 'by hand' signatures fill targets the source lacks "
        "(it may be the output file itself)",
    )
    parser.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    args = parser.parse_args(argv)

    tree: SourceTree
    commit: str | None
    if args.git_dir is not None:
        git_tree = GitTree(args.git_dir, args.commit)
        tree, commit = git_tree, git_tree.commit
    else:
        tree, commit = DirectoryTree(args.src_dir), None
    targets = HAISCALE_TARGETS if args.haiscale else COLOSSALAI_TARGETS
    source = args.source or ("haiscale" if args.haiscale else "hpcaitech/ColossalAI")
    manual: Json | None = None
    if args.manual is not None and args.manual.is_file():
        loaded = json.loads(args.manual.read_text(encoding="utf-8"))
        assert isinstance(loaded, dict)
        manual = loaded

    document = build_document(tree, targets, source, commit, manual)
    text = json.dumps(document, indent=2, ensure_ascii=False) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
