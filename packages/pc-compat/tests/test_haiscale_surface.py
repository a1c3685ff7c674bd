"""The haiscale edge against haiscale's published call shapes
(``signatures/haiscale.json``: ``CPUOffload`` from its source, the rest from
the calls of published haiscale programs, each parameter seen there by name
or by position). Every name exists under ``pc_compat.haiscale``; every
parameter seen by name is taken by name; every positional one has a
positional place at the edge."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from pc_compat.surface import resolve, signatures

ENTRIES = signatures("haiscale")


def _label(entry: dict[str, Any]) -> str:
    return f"{entry['module']}.{entry['name']}"


@pytest.mark.parametrize("entry", ENTRIES, ids=_label)
def test_every_call_shape_is_taken(entry: dict[str, Any]) -> None:
    edge = resolve(entry)
    assert edge is not None, f"{_label(entry)} is not mirrored under pc_compat.haiscale"
    ours = dict(inspect.signature(edge).parameters)
    if entry["kind"] == "method":
        ours.pop(next(iter(ours)))
    kinds = inspect.Parameter
    positional = [
        p for p in ours.values() if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
    ]
    takes_any = any(p.kind is kinds.VAR_POSITIONAL for p in ours.values())
    for index, spec in enumerate(entry["parameters"] or []):
        if spec["name"] is None:
            assert takes_any or index < len(positional), (
                f"{_label(entry)}: a call passes argument {index} by position; the edge takes "
                f"{len(positional)} positional arguments"
            )
        else:
            assert spec["name"] in ours or any(
                p.kind is kinds.VAR_KEYWORD for p in ours.values()
            ), (
                f"{_label(entry)}: {spec['name']!r} is passed by name in haiscale programs; the "
                "edge does not take it"
            )


def test_ddp_takes_device_ids() -> None:
    from pc_compat.haiscale.ddp import DistributedDataParallel

    assert "device_ids" in inspect.signature(DistributedDataParallel).parameters
