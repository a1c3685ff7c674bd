"""Each rank's peak memory per phase of a run (build, load, train, save),
for pc-train's report: on CUDA the allocator's peak, reset as each phase
starts; on the host the resident set's peak (``VmHWM``), reset through
``/proc/self/clear_refs`` where the kernel allows it (else the process'
peak so far, and the report says so)."""

from __future__ import annotations

import re
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["PHASES", "PhaseMemory", "peak_memory"]

PHASES = ("build", "load", "train", "save")
_HWM = re.compile(r"VmHWM:\s+(\d+)\s+kB")


def peak_memory(device: torch.device) -> tuple[float, str]:
    """This rank's peak memory so far, and what it counts: CUDA allocated
    bytes, or the process' peak resident set on the host."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device)), "CUDA allocated"
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), "host RSS"


class PhaseMemory:
    """This rank's peak memory in each phase, in bytes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # The peak of each phase seen so far (a phase may come back: train
        # and save alternate).
        self.peaks: dict[str, float] = {}
        # Whether the host peak can be reset per phase (else it only grows).
        self.resets = device.type == "cuda" or self._reset_host()
        self.current: str | None = None

    @property
    def kind(self) -> str:
        if self.device.type == "cuda":
            return "CUDA allocated"
        return "host RSS" if self.resets else "host RSS (peak since start)"

    def read(self) -> float:
        """The peak since the current phase started."""
        if self.device.type == "cuda":
            return float(torch.cuda.max_memory_allocated(self.device))
        try:
            match = _HWM.search(Path("/proc/self/status").read_text())
        except OSError:
            match = None
        if match is not None:
            return float(match.group(1)) * 1024
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def enter(self, phase: str) -> None:
        """Close the current phase (its peak kept) and start ``phase``."""
        if phase not in PHASES:
            raise AssertionError(f"unknown phase {phase!r}; one of {PHASES}")
        if phase == self.current:
            return
        self.close()
        self.current = phase
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._reset_host()

    def close(self) -> None:
        if self.current is not None:
            self.peaks[self.current] = max(self.peaks.get(self.current, 0.0), self.read())

    @contextmanager
    def phase(self, phase: str, then: str | None = None) -> Iterator[None]:
        """``phase`` for the body, then ``then`` (if given)."""
        self.enter(phase)
        try:
            yield
        finally:
            if then is not None:
                self.enter(then)
            else:
                self.close()

    @staticmethod
    def _reset_host() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            return False
        return True
