"""A per-process memory cap that the kernel enforces: a cgroup (v1) memory
controller group per rank, with swap counted too where the kernel accounts
it. A rank joins its group after its imports and process-group start, so
only what it allocates from then on (the model's share, optimizer states,
gradients, activations, buffers, checkpoint staging) counts against the
cap; going over it gets the rank killed by the kernel's OOM killer, which
the test harness reports as that rank's failure."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["MemoryCap", "unavailable"]

ROOT = Path("/sys/fs/cgroup/memory")


def unavailable() -> str | None:
    """Why caps cannot be enforced here, or None."""
    if not (ROOT / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {ROOT}"
    probe = ROOT / f"pc-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as error:
        return f"cannot create memory cgroups ({error}); run as root"
    return None


class MemoryCap:
    """The cgroup ``name`` with a limit of ``limit`` bytes."""

    def __init__(self, name: str, limit: int) -> None:
        self.path = ROOT / name
        self.path.mkdir(exist_ok=True)
        (self.path / "memory.max_usage_in_bytes").write_text("0")  # a reused group's peak
        memory = self.path / "memory.limit_in_bytes"
        swap = self.path / "memory.memsw.limit_in_bytes"  # memory + swap: no escape into swap
        # memory <= memory + swap at every moment: lower memory first, raise swap first.
        order = [memory, swap] if limit <= int(memory.read_text()) else [swap, memory]
        for file in order:
            if file.exists():
                file.write_text(str(limit))
        self.limit = limit

    def join(self) -> None:
        """Move this process (all its threads) into the group."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        """The group's peak usage: anonymous memory and page cache (the
        checkpoint files written and read, which the kernel reclaims
        before it would kill)."""
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def anonymous(self) -> int:
        """The group's anonymous memory now (what cannot be reclaimed)."""
        for line in (self.path / "memory.stat").read_text().splitlines():
            if line.startswith("rss "):
                return int(line.split()[1])
        return 0

    def sample_anonymous(self, every: float = 0.005) -> Callable[[], int]:
        """Start sampling :meth:`anonymous` in a daemon thread; returns a
        function giving the largest value seen so far."""
        import threading
        import time

        seen = [self.anonymous()]

        def sample() -> None:
            while self.path.exists():
                try:
                    seen[0] = max(seen[0], self.anonymous())
                except OSError:  # the group is gone
                    return
                time.sleep(every)

        threading.Thread(target=sample, daemon=True).start()
        return lambda: max(seen[0], self.anonymous())

    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    @staticmethod
    def remove_group(name: str) -> None:
        """Delete the group ``name`` if it exists (its processes have exited)."""
        path = ROOT / name
        for _ in range(50):
            if not path.exists():
                return
            try:
                path.rmdir()
                return
            except OSError:
                import time

                time.sleep(0.1)

    def remove(self) -> None:
        """Delete the group (its processes have exited)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                import time

                time.sleep(0.1)
