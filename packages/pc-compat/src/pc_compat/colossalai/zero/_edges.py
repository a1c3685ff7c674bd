"""What the ``colossalai.zero`` edges share: a :class:`Translation` whose
handled arguments may fill pc parameters themselves, refusals of
non-default values, and the loss-scale fields as pc-zero's
:class:`~pc_zero.LossScaleConfig` [Note: edges from signatures in
pc_compat.surface]."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch.distributed as dist

from pc_compat.surface import Translation, original_signature
from pc_zero import LossScaleConfig

__all__ = [
    "LOSS_SCALE_FIELDS",
    "EdgeTranslation",
    "Handled",
    "TranslatedEdge",
    "install",
    "loss_scale_config",
    "refuse_unless",
    "taken_by_edge",
    "world_size",
]

Handled = Callable[[Any], dict[str, Any]]

# Colossal-AI's dynamic loss-scale arguments: pc-zero's LossScaleConfig fields.
LOSS_SCALE_FIELDS = (
    "initial_scale",
    "min_scale",
    "max_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
)


@dataclass(frozen=True)
class EdgeTranslation(Translation):
    """A :class:`Translation` where some of pc's parameters are filled by the
    edge from the original's arguments (``fills``: ``optimizer`` from
    ``optim``, ``loss_scale`` from the loss-scale fields, ...); those are
    left out of the keyword-only extras, so one value cannot arrive twice."""

    fills: frozenset[str] = frozenset()

    def signature(self, core: Callable[..., Any] | None = None) -> inspect.Signature:
        full = super().signature(core)
        original = original_signature(self.module, self.name, method=True).parameters
        kept = [
            p for p in full.parameters.values() if p.name in original or p.name not in self.fills
        ]
        return full.replace(parameters=kept)

    def arguments(
        self, core: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """Every argument of a call by name, defaults applied (the edge's
        view, before translation)."""
        bound = self.signature(core).bind(None, *args, **kwargs)
        bound.apply_defaults()
        return dict(list(bound.arguments.items())[1:])


class TranslatedEdge:
    """The class attributes the surface test reads from an edge class."""

    TRANSLATION: ClassVar[EdgeTranslation]
    CORE: ClassVar[Callable[..., Any]]


def install(edge: type[TranslatedEdge]) -> None:
    """``inspect.signature(edge)`` shows the original's parameters, then pc's
    own as keyword-only."""
    setattr(edge.__init__, "__signature__", edge.TRANSLATION.signature(edge.CORE))  # noqa: B010


def taken_by_edge(value: Any) -> dict[str, Any]:
    """A handled argument the edge's constructor reads itself."""
    return {}


def refuse_unless(owner: str, name: str, default: Any, reason: str) -> Handled:
    """A handled argument accepted at its default only; any other value is
    refused with ``reason`` (why, and what to use instead)."""

    def check(value: Any) -> dict[str, Any]:
        same = value is default if default is None else bool(value == default)
        if not same:
            raise ValueError(f"{owner}({name}={value!r}): {reason}")
        return {}

    return check


def loss_scale_config(values: Mapping[str, Any]) -> LossScaleConfig:
    """Colossal-AI's loss-scale arguments as pc-zero's config (it checks them)."""
    return LossScaleConfig(
        initial_scale=float(values["initial_scale"]),
        min_scale=float(values["min_scale"]),
        max_scale=float(values["max_scale"]),
        growth_factor=float(values["growth_factor"]),
        backoff_factor=float(values["backoff_factor"]),
        growth_interval=int(values["growth_interval"]),
        hysteresis=int(values["hysteresis"]),
    )


def world_size(owner: str, group: dist.ProcessGroup | None) -> int:
    """The size of ``group`` (None: every rank), or a ValueError before the
    process group exists."""
    if not dist.is_initialized():
        raise ValueError(
            f"{owner}: the process group is not initialised; start it first "
            "(colossalai.launch_from_torch(), or torch.distributed.init_process_group)."
        )
    return dist.get_world_size(group)
