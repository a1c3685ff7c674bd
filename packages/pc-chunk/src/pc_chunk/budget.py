"""Device-memory accounting that placement is checked against.

A :class:`DeviceBudget` is told about every byte a chunk places on the
compute device and refuses a reservation that would exceed its limit. It
keeps the running total, the peak, and (optionally) a log of every change,
so a test can prove the limit held at every moment of a training step, on a
machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BudgetExceededError", "DeviceBudget"]


class BudgetExceededError(MemoryError):
    """A reservation would take device residency past the budget."""


@dataclass
class DeviceBudget:
    """``limit_bytes`` of device memory for model data (chunks)."""

    limit_bytes: int
    record: bool = False
    used_bytes: int = 0
    peak_bytes: int = 0
    log: list[tuple[str, int, int]] = field(default_factory=list)  # (what, delta, used after)

    def __post_init__(self) -> None:
        if self.limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be positive, got {self.limit_bytes}.")

    @property
    def available_bytes(self) -> int:
        return self.limit_bytes - self.used_bytes

    def reserve(self, nbytes: int, what: str = "") -> None:
        if self.used_bytes + nbytes > self.limit_bytes:
            raise BudgetExceededError(
                f"device budget: {what or 'a reservation'} needs {nbytes} bytes but only "
                f"{self.available_bytes} of {self.limit_bytes} are free. Lower the device "
                "fractions of the placement, use placement 'auto', or raise the budget."
            )
        self.used_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        if self.record:
            self.log.append((what, nbytes, self.used_bytes))

    def free(self, nbytes: int, what: str = "") -> None:
        if nbytes > self.used_bytes:
            raise ValueError(
                f"device budget: freeing {nbytes} bytes ({what}) but only {self.used_bytes} "
                "are reserved; a chunk was freed twice."
            )
        self.used_bytes -= nbytes
        if self.record:
            self.log.append((what, -nbytes, self.used_bytes))
