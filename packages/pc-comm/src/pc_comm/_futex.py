"""Sleeping on a word of shared memory until another process changes it.

[Note: waiting in the kernel]
A rank that waits for its peers in a shared-memory barrier has two poor
choices in plain Python: poll (it takes a core from the compute of its own
or another rank) or sleep a fixed time (it wakes late, up to the nap, each
time). Linux's futex gives a third: ``wait(address, seen)`` sleeps in the
kernel while the 32-bit word at ``address`` still holds ``seen``, and the
process that changes the word calls ``wake(address)``. The kernel checks
the word and queues the sleeper atomically, so a change that lands between
the caller's read and its call is never missed (the wait returns at once).
The word lives in a MAP_SHARED mapping, so the key is the file's page, and
processes that map it at different addresses still meet.

Only Linux has futexes; elsewhere ``AVAILABLE`` is False and callers keep
their polling loop. A sandbox that refuses the syscall (seccomp) is found at
import by a wait on a private word that no longer holds the value (it must
fail with EAGAIN), and a wait that fails for another reason than a changed
word, a timeout or a signal raises OSError, so a caller never spins on a
wait that returns at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import platform

__all__ = ["AVAILABLE", "wait", "wake"]

# futex(2) syscall numbers (asm/unistd.h) by instruction set and pointer
# width: the kernel's machine name does not tell a 32-bit process apart.
_SYS_FUTEX = {("x86", 8): 202, ("x86", 4): 240, ("arm", 8): 98, ("arm", 4): 240}
_FAMILY = {"x86_64": "x86", "amd64": "x86", "i386": "x86", "i686": "x86"}
_FAMILY |= {"aarch64": "arm", "arm64": "arm", "armv7l": "arm", "armv8l": "arm"}
_FUTEX_WAIT = 0  # not FUTEX_PRIVATE_FLAG: the word is shared between processes
_FUTEX_WAKE = 1
_WAKE_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall() -> tuple[ctypes._CFuncPtr, int] | None:  # type: ignore[name-defined]
    family = _FAMILY.get(platform.machine().lower(), "")
    number = _SYS_FUTEX.get((family, ctypes.sizeof(ctypes.c_void_p)))
    if platform.system() != "Linux" or number is None:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    except OSError:
        return None
    call = libc.syscall
    call.restype = ctypes.c_long
    return call, number


_FOUND = _syscall()
_EXPECTED = {errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR}


def _futex(address: int, op: int, value: int, timeout_s: float | None = None) -> int:
    """futex(address, op, value, timeout); -1 with errno set on failure."""
    assert _FOUND is not None, "futex called where futexes are not available"
    call, number = _FOUND
    spec = None
    if timeout_s is not None:
        whole = max(0.0, timeout_s)
        spec = _Timespec(int(whole), int((whole % 1.0) * 1e9))
    return int(
        call(
            ctypes.c_long(number),
            ctypes.c_void_p(address),
            ctypes.c_int(op),
            ctypes.c_int(value),
            ctypes.byref(spec) if spec is not None else ctypes.c_void_p(0),
            ctypes.c_void_p(0),
            ctypes.c_int(0),
        )
    )


def _works() -> bool:
    """A wait on a private word that no longer holds the value must fail at
    once with EAGAIN: proof that the syscall is there, allowed, and futex."""
    if _FOUND is None:
        return False
    word = ctypes.c_int32(1)
    result = _futex(ctypes.addressof(word), _FUTEX_WAIT, 0, 0.001)
    return result == -1 and ctypes.get_errno() == errno.EAGAIN


AVAILABLE = _works()


def wait(address: int, seen: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``address`` equals the low 32 bits of
    ``seen``, at most ``timeout_s`` seconds. Returns early on a wake, a
    changed word or a signal; the caller rechecks its condition."""
    expected = ctypes.c_int32(seen & 0xFFFFFFFF).value  # wraps like the word does
    if _futex(address, _FUTEX_WAIT, expected, timeout_s) < 0:
        code = ctypes.get_errno()
        if code not in _EXPECTED:
            raise OSError(code, f"futex wait failed: {os.strerror(code)}")


def wake(address: int) -> None:
    """Wake every process sleeping on the word at ``address``."""
    _futex(address, _FUTEX_WAKE, _WAKE_ALL)
