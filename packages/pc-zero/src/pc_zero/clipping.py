"""The global-norm clip of a ZeRO optimizer, which clips inside its step.

[Note: clipping inside the step]
A ZeRO optimizer's gradients are sharded, or still being reduced, when
backward returns, so it clips them inside ``step()``
(:func:`pc_zero.unscale_clip_and_check`). ``max_norm`` is the global norm
every step clips to (0: none); it is a public attribute, and a new value
applies from the next step. ``clip_next_step(max_norm)`` clips the next
step only (what ``optimizer.clip_grad_by_norm(max_norm)`` asks for after
backward): to the smaller of the two norms when ``max_norm`` is set, to the
one given when not. A second call before that step replaces the first
(still bounded by ``max_norm``). Once a step returns, taken or skipped on
overflow, ``max_norm`` alone applies again.
"""

from __future__ import annotations

__all__ = ["ClipsInStep"]


class ClipsInStep:
    """The clip settings of an optimizer that clips inside its step
    [Note: clipping inside the step]. The optimizer sets :attr:`max_norm`,
    clips by :meth:`_step_max_norm` and calls :meth:`_step_clipped` when a
    step returns."""

    # The max global gradient norm every step clips to; 0 for none.
    max_norm: float
    # clip_next_step's norm for the next step; None: max_norm alone.
    _next_max_norm: float | None = None

    def clip_next_step(self, max_norm: float) -> None:
        """Clip the next step's gradients to a global norm of at most
        ``max_norm`` (> 0), and to :attr:`max_norm` too when that is set;
        the steps after clip by :attr:`max_norm` alone [Note: clipping
        inside the step]."""
        if not max_norm > 0:
            raise ValueError(f"clip_next_step: max_norm must be > 0, got {max_norm}.")
        max_norm = float(max_norm)
        self._next_max_norm = min(max_norm, self.max_norm) if self.max_norm > 0 else max_norm

    def _step_max_norm(self) -> float:
        """The norm this step clips to (0: none)."""
        return self.max_norm if self._next_max_norm is None else self._next_max_norm

    def _step_clipped(self) -> None:
        """A step returned: a :meth:`clip_next_step` norm is spent."""
        self._next_max_norm = None
