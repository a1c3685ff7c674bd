"""The originals' public signatures, as data, and edges built from them.

``signatures/colossalai.json`` and ``signatures/haiscale.json`` hold the
names, parameters and defaults of every public name the edge mirrors,
extracted from the originals' source at a pinned commit by
``tools/extract_signatures.py`` (facts, not code). Nothing in them is
executed: a default is read by :func:`default_value`, which knows literals,
arithmetic on numbers and a few named constants, and nothing else.

:func:`original_signature` turns one entry into an :class:`inspect.Signature`,
so that an edge class takes exactly the original's parameters with the
original's defaults [Note: edges from signatures].

[Note: edges from signatures]
An edge class over a pc class (``GeminiPlugin`` over pc-booster's) binds its
arguments to the original's signature (an unknown keyword is a TypeError, as
it would be in the original), then hands each argument to one of three
owners, listed per class in its ``Translation``:
- pc's constructor, where pc has the parameter under the same name (pc
  honours it, or refuses a value it cannot give at construction, with the
  reason, in the rules of the plugin's options);
- ``no_effect``: arguments that change nothing pc computes in the modes pc
  runs (performance hints of the original's own kernels and overlap, a
  device the plugin places by itself): accepted with any value, each with
  the reason, listed in the docs;
- ``handled``: arguments the edge translates itself (a renamed pc
  parameter, a value pc spells differently).
An argument that none of the three owns is a defect the generated surface
test reports.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import torch

__all__ = [
    "NOT_GIVEN",
    "REFUSED",
    "Translation",
    "default_value",
    "original_entry",
    "original_signature",
    "refused_class",
    "refused_function",
    "resolve",
    "signatures",
    "surface_rows",
    "surface_table",
]


class _NotGiven:
    """The default of a parameter that has none (``inspect.Parameter.empty``
    stands for it in signatures)."""

    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN: Any = _NotGiven()

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
# Named constants a default may spell, by their source text.
_NAMES: dict[str, Any] = {
    "None": None,
    "True": True,
    "False": False,
    "torch.float": torch.float32,
    "torch.float32": torch.float32,
    "torch.float16": torch.float16,
    "torch.half": torch.float16,
    "torch.bfloat16": torch.bfloat16,
    # torch.optim's sentinel for a required learning rate.
    "required": inspect.Parameter.empty,
    # Colossal-AI's lazy tensor class: pc has one lazy kind (None stands for it).
    "LazyTensor": None,
}


def _evaluate(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Tuple | ast.List):
        values = [_evaluate(element) for element in node.elts]
        return tuple(values) if isinstance(node, ast.Tuple) else values
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    text = ast.unparse(node)
    if text in _NAMES:
        return _NAMES[text]
    if (
        isinstance(node, ast.Call)
        and ast.unparse(node.func) == "torch.device"
        and len(node.args) == 1
        and not node.keywords
    ):
        return torch.device(_evaluate(node.args[0]))
    if text == "field(default_factory=dict)":
        return None  # a dataclass field's fresh dict: pc takes None for it
    raise ValueError(f"a default this reader does not evaluate: {text!r}")


def default_value(text: str | None) -> Any:
    """The value of a default written as ``text`` in the original's source
    (None: the parameter has none, :data:`NOT_GIVEN`)."""
    if text is None:
        return NOT_GIVEN
    return _evaluate(ast.parse(text, mode="eval").body)


@cache
def signatures(original: str) -> tuple[dict[str, Any], ...]:
    """Every entry of ``signatures/<original>.json`` ("colossalai", "haiscale")."""
    text = resources.files("pc_compat").joinpath(f"signatures/{original}.json").read_text()
    document = json.loads(text)
    return tuple(document["signatures"])


def original_entry(module: str, name: str) -> dict[str, Any]:
    """The entry of ``module``'s ``name`` (``"Booster.save_model"`` for a method)."""
    original = module.split(".")[0]
    for entry in signatures(original):
        if entry["module"] == module and entry["name"] == name:
            return entry
    raise AssertionError(f"no signature of {module}.{name} in signatures/{original}.json")


_KINDS = {
    "positional_only": inspect.Parameter.POSITIONAL_ONLY,
    "positional_or_keyword": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "keyword_only": inspect.Parameter.KEYWORD_ONLY,
    "var_positional": inspect.Parameter.VAR_POSITIONAL,
    "var_keyword": inspect.Parameter.VAR_KEYWORD,
}


def original_signature(module: str, name: str, *, method: bool = False) -> inspect.Signature:
    """The original's signature of ``module.name`` with its defaults
    evaluated; ``method``: with ``self`` first (for ``__init__``)."""
    entry = original_entry(module, name)
    parameters = (
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] if method else []
    )
    for spec in entry["parameters"] or []:
        kind = _KINDS[spec["kind"]]
        value = default_value(spec["default"])
        has_default = value is not NOT_GIVEN and value is not inspect.Parameter.empty
        parameters.append(
            inspect.Parameter(
                spec["name"],
                kind,
                default=value if has_default else inspect.Parameter.empty,
            )
        )
    return inspect.Signature(parameters)


@dataclass(frozen=True)
class Translation:
    """How an edge class hands the original's arguments to pc
    [Note: edges from signatures]. ``no_effect``: argument -> why it changes
    nothing pc computes; ``handled``: argument -> a function of its value
    that returns the keyword arguments it becomes for pc's constructor
    (empty: none) or raises ValueError with the reason."""

    module: str
    name: str
    no_effect: Mapping[str, str] = field(default_factory=dict)
    handled: Mapping[str, Callable[[Any], dict[str, Any]]] = field(default_factory=dict)
    # Arguments the edge translates together (one depends on another): given
    # every bound argument and the keyword arguments so far, the final ones
    # (or ValueError with the reason). Their names are listed in ``handled``.
    combine: Callable[[Mapping[str, Any], dict[str, Any]], dict[str, Any]] | None = None

    def signature(self, core: Callable[..., Any] | None = None) -> inspect.Signature:
        """The original's signature (with ``self``), then, keyword-only,
        the parameters pc's ``core`` takes that the original does not (pc's
        own options stay reachable from the edge)."""
        original = original_signature(self.module, self.name, method=True)
        if core is None:
            return original
        names = set(original.parameters)
        extras = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in inspect.signature(core).parameters.values()
            if p.name not in names
            and p.name != "self"
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        last = list(original.parameters.values())
        if last and last[-1].kind is inspect.Parameter.VAR_KEYWORD:
            return original  # the original takes any keyword already
        return original.replace(parameters=[*last, *extras])

    def to_pc(
        self, core: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """The keyword arguments for pc's ``core`` constructor from a call
        of the original's signature (bound, with its defaults)."""
        bound = self.signature(core).bind(None, *args, **kwargs)
        bound.apply_defaults()
        out: dict[str, Any] = {}
        for name, value in list(bound.arguments.items())[1:]:
            owner = self.owner(name, core)
            if owner == "edge":
                out.update(self.handled[name](value))
            elif owner == "pc":
                out[name] = value
            elif owner == "none":
                raise AssertionError(
                    f"{self.name}({name}=...): no owner for this argument of the original "
                    "[Note: edges from signatures]"
                )
        if self.combine is not None:
            out = self.combine(bound.arguments, out)
        return out

    def owner(self, name: str, core: Callable[..., Any]) -> str:
        """Who takes the original's argument ``name``: "pc", "no effect",
        "edge", or "none" (a defect)."""
        if name in self.handled:
            return "edge"
        if name in self.no_effect:
            return "no effect"
        if name in inspect.signature(core).parameters:
            return "pc"
        return "none"


# Names of the original the edge mirrors only to refuse, by "module.name":
# the reason and what to use instead (what the surface test and the docs read).
REFUSED: dict[str, str] = {}


def _refusal(module: str, name: str, reason: str) -> Callable[..., Any]:
    signature = original_signature(module, name)
    REFUSED[f"{module}.{name}"] = reason

    def refuse(*args: Any, **kwargs: Any) -> Any:
        signature.bind(*args, **kwargs)  # a call the original would refuse fails as there
        raise ValueError(f"{name}: {reason}")

    return refuse


def refused_class(module: str, name: str, reason: str) -> type:
    """A class named ``name`` with the original's constructor signature,
    whose construction raises ValueError with ``reason``."""
    refuse = _refusal(module, name, reason)

    def construct(self: Any, *args: Any, **kwargs: Any) -> None:
        refuse(*args, **kwargs)

    setattr(construct, "__signature__", original_signature(module, name, method=True))  # noqa: B010
    doc = f"Colossal-AI's ``{name}``, refused: {reason}"
    namespace = {"__init__": construct, "__doc__": doc, "__module__": f"pc_compat.{module}"}
    return type(name, (), namespace)


def refused_function(module: str, name: str, reason: str) -> Callable[..., Any]:
    """A function named ``name`` with the original's signature that raises
    ValueError with ``reason``."""
    refuse = _refusal(module, name, reason)
    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"Colossal-AI's ``{name}``, refused: {reason}"
    setattr(refuse, "__signature__", original_signature(module, name))  # noqa: B010
    return refuse


def resolve(entry: dict[str, Any]) -> Any:
    """The edge's object for a signature entry (``pc_compat.<module>``'s
    ``name``, a dotted name for a method), or None where it is missing."""
    try:
        obj: Any = importlib.import_module(f"pc_compat.{entry['module']}")
    except ModuleNotFoundError:
        return None
    for part in entry["name"].split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@dataclass(frozen=True)
class SurfaceRow:
    """One mirrored name: who takes each of the original's parameters."""

    module: str
    name: str
    # parameter -> "pc", "edge", "no effect" or "refused"
    owners: Mapping[str, str]
    # parameters the edge does not take at all (a defect)
    orphans: tuple[str, ...]
    # parameter -> why it has no effect
    reasons: Mapping[str, str]


def _row(entry: dict[str, Any]) -> SurfaceRow:
    module, name = entry["module"], entry["name"]
    names = [p["name"] for p in entry["parameters"] or []]
    edge = resolve(entry)
    if f"{module}.{name}" in REFUSED or edge is None:
        orphans = () if edge is not None else tuple(names) or ("(the name)",)
        return SurfaceRow(module, name, dict.fromkeys(names, "refused"), orphans, {})
    translation: Translation | None = getattr(edge, "TRANSLATION", None)
    core = getattr(edge, "CORE", None)
    no_effect: Mapping[str, str] = getattr(edge, "NO_EFFECT", {})
    taken = inspect.signature(edge).parameters
    owners: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for parameter in names:
        if translation is not None and core is not None:
            owner = translation.owner(parameter, core)
            if owner == "no effect":
                reasons[parameter] = translation.no_effect[parameter]
        elif parameter in no_effect:
            owner, reasons[parameter] = "no effect", no_effect[parameter]
        else:
            owner = "edge" if parameter in taken else "none"
        owners[parameter] = owner
    orphans = tuple(n for n, o in owners.items() if o == "none")
    return SurfaceRow(module, name, owners, orphans, reasons)


def surface_rows(original: str = "colossalai") -> list[SurfaceRow]:
    return [_row(entry) for entry in signatures(original)]


def surface_table(original: str = "colossalai") -> str:
    """The counts per module as a Markdown table, then every argument
    that has no effect and every refused name, with the reasons."""
    rows = surface_rows(original)
    modules = sorted({r.module for r in rows})
    lines = [
        "| module | names | parameters | taken by pc | by the edge | no effect | refused |",
        "|---|---|---|---|---|---|---|",
    ]
    totals = [0] * 6

    def counts(selected: list[SurfaceRow]) -> list[int]:
        owners = [o for r in selected for o in r.owners.values()]
        return [
            len(selected),
            len(owners),
            owners.count("pc"),
            owners.count("edge"),
            owners.count("no effect"),
            sum(
                1
                for r in selected
                if set(r.owners.values()) == {"refused"}
                or (not r.owners and f"{r.module}.{r.name}" in REFUSED)
            ),
        ]

    for module in modules:
        numbers = counts([r for r in rows if r.module == module])
        totals = [a + b for a, b in zip(totals, numbers, strict=True)]
        lines.append(f"| `{module}` | " + " | ".join(str(n) for n in numbers) + " |")
    lines.append("| **all** | " + " | ".join(f"**{n}**" for n in totals) + " |")
    lines += ["", "The last column counts names refused whole. Arguments with no effect:", ""]
    for r in rows:
        for parameter, why in r.reasons.items():
            lines.append(f"- `{r.name}({parameter}=)`: {why}.")
    lines += ["", "Names refused, with the reason and what to use instead:", ""]
    for key, why in sorted(REFUSED.items()):
        lines.append(f"- `{key}`: {why}")
    return "\n".join(lines)


if __name__ == "__main__":
    # The module the edges register their refusals in (this file also runs
    # as __main__, a second copy with a registry of its own).
    from pc_compat import surface as _surface

    for _entry in _surface.signatures("colossalai"):
        _surface.resolve(_entry)
    print(_surface.surface_table())
