"""Naming an out-of-memory death for what it is.

[Note: out of memory, named]
A rank that runs out of memory dies in one of three ways, none of which
says "memory" by itself:

- the kernel's OOM killer sends SIGKILL: at a memory cgroup's limit (a
  container, a batch system's job, ``PC_TRAIN_CGROUP``) or when the
  machine runs out. The rank cannot speak, so at start each rank leaves
  its memory cgroup, that group's OOM-kill count and limit in the
  launcher's error directory (:func:`record`); on a SIGKILL the launcher
  compares the count now (cgroup v1 ``memory.oom_control``, v2
  ``memory.events``) and the machine's (``/proc/vmstat``) with the counts
  at start (:func:`explain`);
- an address-space limit (``ulimit -v``, ``RLIMIT_AS``) fails an
  allocation: ``MemoryError``, torch's "can't allocate memory", or
  Python's "can't start new thread" (a thread's stack is address space);
- a full ``/dev/shm`` (the shared-memory collectives' segments) kills a
  rank with SIGBUS when it touches a page tmpfs cannot back.

Each is reported with the limit and exit code 2 (a limit to raise or a
load to lower, [Note: exit codes]).
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path
from typing import Any

__all__ = [
    "address_space_limit",
    "bytes_text",
    "explain_kill",
    "is_allocation_failure",
    "record",
    "shm_text",
    "system_oom_kills",
]

_CGROUP = Path("/sys/fs/cgroup")


def bytes_text(n: float) -> str:
    """``n`` bytes for a message: ``1.5 GiB``, ``12.0 MiB``, ``300 bytes``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} bytes"


def _memory_cgroup() -> Path | None:
    """This process's memory cgroup directory (v1's controller, else v2's)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    unified = None
    for line in lines:
        number, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return _CGROUP / "memory" / path.lstrip("/")
        if number == "0" and controllers == "":
            unified = path.lstrip("/")
    if unified is not None:
        for root in (_CGROUP, _CGROUP / "unified"):
            if (root / unified / "memory.events").exists():
                return root / unified
    return None


def _counter(text: str, key: str) -> int | None:
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def _oom_kills(group: Path) -> int | None:
    for name in ("memory.oom_control", "memory.events"):  # v1, v2
        try:
            return _counter((group / name).read_text(), "oom_kill")
        except OSError:
            continue
    return None


def _limit(group: Path) -> int | None:
    for name in ("memory.limit_in_bytes", "memory.max"):  # v1, v2
        try:
            text = (group / name).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # v1's "no limit" is a huge number
            return int(text)
        return None
    return None


def system_oom_kills() -> int | None:
    """The machine's OOM kills since boot (``/proc/vmstat``)."""
    try:
        return _counter(Path("/proc/vmstat").read_text(), "oom_kill")
    except OSError:
        return None


def record(rank: int, directory: str | None) -> None:
    """A rank's memory cgroup and its OOM-kill count now, for the launcher
    (nothing without one) [Note: out of memory, named]."""
    if not directory:
        return
    group = _memory_cgroup()
    state = {
        "cgroup": str(group) if group else None,
        "oom_kills": _oom_kills(group) if group else None,
        "system": system_oom_kills(),
    }
    Path(directory, f"rank{rank}.memory").write_text(json.dumps(state))


def explain_kill(rank: int, directory: Path, machine: bool = True) -> str | None:
    """Why SIGKILL ended ``rank``, when the kernel's OOM killer did it: in
    the rank's memory cgroup, or (``machine``) anywhere on the machine."""
    try:
        state: dict[str, Any] = json.loads((directory / f"rank{rank}.memory").read_text())
    except (OSError, ValueError):
        return None
    cgroup = state.get("cgroup")
    if cgroup:
        group = Path(cgroup)
        now, then = _oom_kills(group), state.get("oom_kills")
        if now is not None and then is not None and now > then:
            limit = _limit(group)
            cap = f"its limit of {bytes_text(limit)}" if limit else "its limit"
            return (
                f"killed by the kernel's out-of-memory killer: its memory cgroup {group} reached "
                f"{cap} (memory.oom_control / memory.events count {now - then} OOM kill(s)); "
                "raise the limit, or lower the memory each rank needs (pc-estimate --search "
                "shows each layout's)"
            )
    now, then = system_oom_kills(), state.get("system")
    if machine and now is not None and then is not None and now > then:
        return (
            f"killed by the kernel's out-of-memory killer: the machine ran out of memory "
            f"({now - then} OOM kill(s) since the job started); lower the memory each rank "
            "needs (pc-estimate --search shows each layout's) or run fewer ranks here"
        )
    return None


def address_space_limit() -> int | None:
    """This process's address-space limit (``ulimit -v``), if it has one."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


def is_allocation_failure(error: BaseException) -> bool:
    """An exception that means an allocation failed: memory, or address
    space (a thread's stack)."""
    if isinstance(error, MemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "can't start new thread" in text
        or "can't allocate memory" in text
        or "Cannot allocate memory" in text
    )


def shm_text() -> str:
    """``/dev/shm``'s free and total space, in words."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return "/dev/shm is not mounted"
    free, total = stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize
    return f"/dev/shm has {bytes_text(free)} free of {bytes_text(total)}"
