"""pc never changes a user's model behind their back ([Note: forward hooks,
not forward assignment] in pc_tensor.hooks): no source file under
packages/*/src assigns an object's ``forward`` or writes a private
(``_name``) attribute of anything but its own instance, through an
assignment or ``setattr``. Read from the AST, so a new violation fails
here before any behaviour test could notice it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each allowed store, with why: pc's own objects written where they are made,
# and the transforms' edits of the module tree (a child or parameter put in
# place of another, by a name read from the model, which this reader cannot
# check: each is reviewed here).
ALLOWED = {
    # LazyTensor.__new__ fills in the tensor subclass it just created.
    ("packages/pc-chunk/src/pc_chunk/lazy.py", "out._inner"),
    ("packages/pc-chunk/src/pc_chunk/lazy.py", "out._record"),
    # enable_fused_normalization: a FusedRMSNorm (pc's) in place of the norm.
    ("packages/pc-booster/src/pc_booster/plugins/optimizations.py", "setattr(..., child)"),
    # expert parallelism: each expert weight replaced by this rank's shard.
    ("packages/pc-tensor/src/pc_tensor/experts.py", "setattr(..., leaf)"),
    # tensor parallelism: a parallel layer in place of a linear / embedding.
    ("packages/pc-tensor/src/pc_tensor/shard.py", "setattr(..., name)"),
    # tensor parallelism: an attention's head counts divided by tp (public
    # attributes its policy names: num_heads, num_key_value_heads, ...).
    ("packages/pc-tensor/src/pc_tensor/shard.py", "setattr(..., attribute)"),
}
OWN = {"self", "cls"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _stores(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, target) of each forbidden store in a module."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if not isinstance(sub, ast.Attribute) or not isinstance(sub.ctx, ast.Store):
                    continue
                own = isinstance(sub.value, ast.Name) and sub.value.id in OWN
                if sub.attr == "forward" or (_private(sub.attr) and not own):
                    found.append((sub.lineno, ast.unparse(sub)))
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in ("setattr", "object.__setattr__") and len(node.args) >= 2:
                key = node.args[1]
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    if key.value == "forward" or _private(key.value):
                        found.append((node.lineno, f"{name}(..., {key.value!r})"))
                else:  # a computed name: cannot be read here, so it is refused too
                    found.append((node.lineno, f"{name}(..., {ast.unparse(key)})"))
    return found


def test_no_forward_assignment_and_no_private_writes() -> None:
    problems = []
    files = sorted(ROOT.glob("packages/*/src/**/*.py"))
    assert len(files) > 100  # the packages were found
    for path in files:
        relative = path.relative_to(ROOT).as_posix()
        for line, target in _stores(ast.parse(path.read_text(), str(path))):
            if (relative, target) not in ALLOWED:
                problems.append(f"{relative}:{line}: {target}")
    assert not problems, "changes a model behind its owner's back:\n" + "\n".join(problems)


def test_the_reader_finds_each_kind_of_violation() -> None:
    source = """
model.forward = wrapped
config._attn_implementation = "x"
setattr(module, "forward", f)
setattr(module, "_hidden", 1)
setattr(module, name, value)
self._mine = 1
self.forward_count = 2
obj.__signature__ = sig
"""
    found = [target for _, target in _stores(ast.parse(source))]
    assert found == [
        "model.forward",
        "config._attn_implementation",
        "setattr(..., 'forward')",
        "setattr(..., '_hidden')",
        "setattr(..., name)",
    ]
