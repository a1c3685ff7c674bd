"""The generated surface test: every public name of Colossal-AI that the
edge mirrors (``signatures/colossalai.json``, extracted from Colossal-AI's
source at a pinned commit) exists under ``pc_compat.colossalai``, takes
every parameter of the original at the original's position and with the
original's default, and either hands each one to an owner (pc, the edge, or
"no effect" with a reason) or refuses the whole name with a reason when it
is called. ``docs/compat-surface.md`` holds the counts; it must be current."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

from pc_compat.surface import (
    NOT_GIVEN,
    REFUSED,
    default_value,
    original_signature,
    resolve,
    signatures,
    surface_rows,
    surface_table,
)

ENTRIES = signatures("colossalai")
for _entry in ENTRIES:  # import every mirrored module: its refusals register themselves
    resolve(_entry)
DOCS = Path(__file__).resolve().parents[3] / "docs" / "compat-surface.md"


def _label(entry: dict[str, Any]) -> str:
    return f"{entry['module']}.{entry['name']}"


def _same(edge: Any, original: Any) -> bool:
    if isinstance(original, float) or isinstance(edge, float):
        return isinstance(edge, int | float) and float(edge) == float(original)
    if isinstance(original, tuple | list):
        return (
            isinstance(edge, tuple | list)
            and len(edge) == len(original)
            and all(_same(e, o) for e, o in zip(edge, original, strict=True))
        )
    return bool(type(edge) is type(original) and edge == original) or (
        isinstance(edge, torch.dtype | torch.device) and edge == original
    )


@pytest.mark.parametrize("entry", ENTRIES, ids=_label)
def test_every_parameter_is_taken_with_the_originals_default(entry: dict[str, Any]) -> None:
    edge = resolve(entry)
    assert edge is not None, f"{_label(entry)} is not mirrored under pc_compat"
    ours = dict(inspect.signature(edge).parameters)
    if entry["kind"] == "method":  # the class's function: its self is not the original's
        ours.pop(next(iter(ours)))
    theirs = original_signature(entry["module"], entry["name"]).parameters
    positional = [n for n, p in ours.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    for index, (name, parameter) in enumerate(theirs.items()):
        kind = parameter.kind
        if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            assert any(p.kind is kind for p in ours.values()), (
                f"{_label(entry)}: the original takes {kind.description} (*{name}); the edge "
                "does not"
            )
            continue
        assert name in ours, f"{_label(entry)}: parameter {name!r} is missing at the edge"
        if kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            assert positional.index(name) == index, (
                f"{_label(entry)}: {name!r} is positional argument {index} in the original, "
                f"{positional.index(name)} at the edge"
            )
        if parameter.default is not inspect.Parameter.empty:
            ours_default = ours[name].default
            spec = next(p for p in entry["parameters"] if p["name"] == name)
            assert _same(ours_default, parameter.default) or spec["default"] == (
                "field(default_factory=dict)"
            ), (
                f"{_label(entry)}: {name} defaults to {ours_default!r} at the edge, "
                f"{spec['default']} in the original"
            )


@pytest.mark.parametrize("entry", [e for e in ENTRIES if _label(e) in REFUSED], ids=_label)
def test_refused_names_say_why_when_called(entry: dict[str, Any]) -> None:
    edge = resolve(entry)
    required = [
        p
        for p in original_signature(entry["module"], entry["name"]).parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
    ]
    target = edge
    if "." in entry["name"]:  # a method: called on a made instance is not needed
        target = getattr(edge, "__func__", edge)
        args: list[Any] = [None] * len(required)
        args.insert(0, None)
    else:
        args = [None] * len(required)
    with pytest.raises(ValueError, match=entry["name"].split(".")[-1]) as error:
        target(*args)
    assert REFUSED[_label(entry)] in str(error.value)


def test_every_parameter_has_an_owner() -> None:
    rows = surface_rows()
    orphans = [f"{r.name}({p})" for r in rows for p in r.orphans]
    assert not orphans, f"parameters no owner takes [Note: edges from signatures]: {orphans}"


def test_defaults_are_read_not_run() -> None:
    assert default_value("2 ** 16") == 65536
    assert default_value("torch.device('cpu')") == torch.device("cpu")
    assert default_value(None) is NOT_GIVEN
    with pytest.raises(ValueError, match="does not evaluate"):
        default_value("__import__('os').system('true')")


def test_the_docs_counts_are_current() -> None:
    table = surface_table()
    text = DOCS.read_text()
    assert table in text, (
        f"{DOCS} does not hold the current surface table; regenerate it with "
        "`python -m pc_compat.surface` and paste the output:\n" + table
    )
