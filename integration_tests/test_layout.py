"""The monorepo's rules, checked: each package is laid out as DESIGN.md says
and imports only the layers below it, through their public names."""

from __future__ import annotations

import ast
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
