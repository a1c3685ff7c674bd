"""What a layer above (pc-booster) may rely on from a ZeRO optimizer.

[Note: sharded optimizer interface]
A ZeRO optimizer steps fp32 *masters* that are sharded across the
data-parallel ranks; the model's parameters are its working copies. A layer
above needs to map the optimizer's state back to the model (parameter order,
groups), to read and write the full-precision values when the masters are
separate from the parameters, to drive backward (loss scaling, gradient
accumulation, tied weights across pipeline stages) and to know how it clips.
That is :class:`ShardedOptimizer`; it names no private attribute, so a layer
above never reaches into the implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from pc_zero.loss_scale import DynamicLossScaler

__all__ = ["OwnedPiece", "ShardedOptimizer"]


class OwnedPiece(NamedTuple):
    """A rank's piece of one parameter (:meth:`ShardedOptimizer.owned_pieces`)."""

    param_index: int
    start: int
    master: torch.Tensor
    # Views of the element-wise optimizer states.
    state: dict[str, torch.Tensor]
    # The inner optimizer's state entry of the piece's bucket (its scalars,
    # such as Adam's step, are shared by the bucket's parameters).
    entry: dict[str, Any]


@runtime_checkable
class ShardedOptimizer(Protocol):
    """A ZeRO optimizer as the layers above see it [Note: sharded optimizer
    interface]. :class:`pc_zero.LowLevelZeroOptimizer` satisfies it.

    Parameter *indices* are positions in :attr:`params`, which is also the
    numbering of the ``state`` entries of :meth:`state_dict`.
    """

    @property
    def params(self) -> Sequence[torch.Tensor]:
        """The model's parameters in the original optimizer's param-group
        order (frozen ones included): index ``i`` is state-dict index ``i``."""
        ...

    @property
    def group_indices(self) -> Sequence[Sequence[int]]:
        """Per param group, the indices (into :attr:`params`) of its
        parameters, in the group's order."""
        ...

    @property
    def masters_are_params(self) -> bool:
        """True when the fp32 masters are the working parameters themselves
        (fp32 training on the device): there is no separate full-precision
        copy, so :meth:`full_params` equals the model's parameters."""
        ...

    @property
    def scaler(self) -> DynamicLossScaler | None:
        """The dynamic loss scale (fp16 parameters), else None."""
        ...

    @property
    def max_norm(self) -> float:
        """The max global gradient norm every step clips to; 0 for none."""
        ...

    def clip_next_step(self, max_norm: float) -> None:
        """Clip the next step only to at most ``max_norm`` [Note: clipping
        inside the step] in pc_zero.clipping."""
        ...

    param_groups: list[dict[str, Any]]

    def full_params(self) -> dict[int, torch.Tensor]:
        """Every trainable parameter's full-precision value by index
        (collective)."""
        ...

    def load_full_params(self, values: Mapping[int, torch.Tensor]) -> None:
        """Set the masters (and the parameters' rounding) from full values
        by index; every rank passes the same (collective)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """The full optimizer state in torch's per-parameter format
        (collective)."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full state dict (collective)."""
        ...

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``loss.backward()``, scaled first when :attr:`scaler` is set."""
        ...

    def no_sync(self) -> AbstractContextManager[None]:
        """Accumulate gradients without communicating (raises where the
        implementation cannot)."""
        ...

    def accumulated_grad(self, param: torch.Tensor) -> torch.Tensor:
        """Between ``no_sync`` backwards and ``step``: ``param``'s locally
        accumulated gradient, a view to modify in place (e.g. to sum a
        weight tied across pipeline stages)."""
        ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Unscale, clip, check for overflow and step."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients."""
        ...

    def owned_pieces(self) -> list[OwnedPiece]:
        """This rank's pieces of each parameter, for sharded checkpoints."""
        ...

    def init_state(self, elementwise: Sequence[str], scalars: Mapping[str, Any]) -> None:
        """Create optimizer state (zeros) where none exists yet."""
        ...

    def sync_params(self) -> None:
        """Every rank's parameters from the masters (collective)."""
        ...
