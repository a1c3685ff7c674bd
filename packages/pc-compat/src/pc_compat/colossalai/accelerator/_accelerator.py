"""The device this process computes on, behind one interface: Colossal-AI's
``get_accelerator()`` shape, for CUDA and for the CPU.

``get_accelerator()`` returns a :class:`CudaAccelerator` when CUDA is
available and a :class:`CpuAccelerator` otherwise. Both are stateless (all
state is torch's), so there is no process-wide accelerator to set.

[Note: memory on the CPU]
torch keeps no statistics of its CPU allocator, and Colossal-AI's CPU
accelerator raises on every memory query. Here they answer for the host
process: ``memory_allocated`` and ``memory_reserved`` are its resident set
(RSS, every byte of the process, not only tensors) and the ``max_``
variants its peak RSS (Linux ``VmHWM``), which ``reset_peak_memory_stats``
resets (``/proc/self/clear_refs``). So they move when tensors are allocated
and freed, and a script dividing by them never divides by zero. Linux sums
a process's resident pages lazily (per-thread counters), so a read can lag
by a few hundred KB. Where the platform cannot answer (no ``/proc``), they
raise.
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["BaseAccelerator", "CpuAccelerator", "CudaAccelerator", "get_accelerator"]

Device = torch.device | int | str | None
M = TypeVar("M", bound=nn.Module)
_PROC_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


class BaseAccelerator:
    """What every accelerator shares: its name, the collective backend that
    goes with it, and moving modules to its current device."""

    def __init__(self, name: str, communication_backend: str, is_synchronous: bool) -> None:
        self._name = name  # "cuda" or "cpu", as torch names the device type
        self._communication_backend = communication_backend  # the backend for this device
        self._is_synchronous = is_synchronous  # whether a call returns after the work is done

    @property
    def name(self) -> str:
        return self._name

    @property
    def communication_backend(self) -> str:
        return self._communication_backend

    @property
    def is_synchronous(self) -> bool:
        return self._is_synchronous

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self._name}, communication_backend="
            f"{self._communication_backend}, is_synchronous={self._is_synchronous})"
        )

    def get_current_device(self) -> torch.device:
        raise NotImplementedError

    def set_to_device(self, models: M | list[M]) -> M | list[M]:
        """Move a module, or each module of a list, to the current device (a
        one-element list gives the module itself, as in Colossal-AI)."""
        device = self.get_current_device()
        if isinstance(models, list):
            moved = [m.to(device) for m in models]
            return moved[0] if len(moved) == 1 else moved
        return models.to(device)


# ----------------------------------------------------------------- the CPU


def _status_bytes(field: str) -> int:
    """A ``kB`` line of /proc/self/status, in bytes [Note: memory on the CPU]."""
    try:
        text = _PROC_STATUS.read_text()
    except OSError:
        raise RuntimeError(
            f"CPU memory queries read {_PROC_STATUS}, which this platform does not have."
        ) from None
    for line in text.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{_PROC_STATUS} has no {field} line.")


def _check_cpu(device: Device) -> None:
    if device is None:
        return
    parsed = torch.device("cpu", device) if isinstance(device, int) else torch.device(device)
    if parsed.type != "cpu" or parsed.index not in (None, 0):
        raise ValueError(f"the CPU accelerator has one device, 'cpu'; got {device!r}.")


def _no_cpu(what: str) -> RuntimeError:
    return RuntimeError(f"{what} has no meaning on the CPU accelerator (CUDA only).")


class CpuAccelerator(BaseAccelerator):
    """The host as the device: one device, ``cpu``; collectives over gloo."""

    def __init__(self) -> None:
        # CPU kernels finish before they return, so this is synchronous
        # (Colossal-AI says False).
        super().__init__(name="cpu", communication_backend="gloo", is_synchronous=True)

    # device
    def get_current_device(self) -> torch.device:
        return torch.device("cpu")

    def current_device(self) -> int:
        """0: the CPU is this process's one device."""
        return 0

    def set_device(self, device: Device = None) -> None:
        """Accepts only the CPU itself (there is nothing else to bind to)."""
        _check_cpu(device)

    def get_device_name(self, device: Device = None) -> str:
        _check_cpu(device)
        return platform.processor() or platform.machine() or "cpu"

    def synchronize(self, device: Device = None) -> None:
        """Returns at once: CPU work is done when its call returns."""
        _check_cpu(device)

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def get_device_capability(self, device: Device = None) -> tuple[int, int]:
        raise _no_cpu("a compute capability")

    def get_device_properties(self, device: Device = None) -> Any:
        raise _no_cpu("get_device_properties")

    def utilization(self, device: Device = None) -> int:
        raise _no_cpu("utilization (nvidia-smi's kernel-busy percentage)")

    # random numbers: the CPU generator
    def get_rng_state(self, device: Device = None) -> torch.Tensor:
        _check_cpu(device)
        return torch.get_rng_state()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [torch.get_rng_state()]

    def set_rng_state(self, new_state: torch.Tensor, device: Device = None) -> None:
        _check_cpu(device)
        torch.set_rng_state(new_state)

    def set_rng_state_all(self, new_states: list[torch.Tensor]) -> None:
        if len(new_states) != 1:
            raise ValueError(
                f"the CPU accelerator has one generator; got {len(new_states)} states."
            )
        torch.set_rng_state(new_states[0])

    def manual_seed(self, seed: int) -> None:
        torch.default_generator.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.default_generator.manual_seed(seed)

    def seed(self) -> None:
        torch.default_generator.seed()

    def seed_all(self) -> None:
        torch.default_generator.seed()

    def initial_seed(self) -> int:
        return torch.default_generator.initial_seed()

    # memory [Note: memory on the CPU]
    def empty_cache(self) -> None:
        """Hands freed heap memory back to the system (glibc ``malloc_trim``);
        nothing to do where there is no glibc, as torch caches no CPU memory."""
        trim = (
            getattr(ctypes.CDLL(None), "malloc_trim", None)
            if platform.system() == "Linux"
            else None
        )
        if trim is not None:
            trim(0)

    def memory_allocated(self, device: Device = None) -> int:
        """Bytes resident in this process (RSS)."""
        _check_cpu(device)
        return _status_bytes("VmRSS")

    def max_memory_allocated(self, device: Device = None) -> int:
        """Peak RSS of this process since start or the last reset."""
        _check_cpu(device)
        return _status_bytes("VmHWM")

    def memory_reserved(self, device: Device = None) -> int:
        """The same as :meth:`memory_allocated`: the process holds what it has."""
        return self.memory_allocated(device)

    def max_memory_reserved(self, device: Device = None) -> int:
        return self.max_memory_allocated(device)

    def reset_peak_memory_stats(self, device: Device = None) -> None:
        """Resets the peak RSS to the current RSS."""
        _check_cpu(device)
        try:
            _CLEAR_REFS.write_text("5")
        except OSError as error:
            raise RuntimeError(
                f"cannot reset the peak RSS here ({_CLEAR_REFS}: {error})."
            ) from None

    def reset_max_memory_allocated(self, device: Device = None) -> None:
        self.reset_peak_memory_stats(device)

    def reset_max_memory_cached(self, device: Device = None) -> None:
        self.reset_peak_memory_stats(device)

    def memory_stats(self, device: Device = None) -> dict[str, Any]:
        """CUDA's key names for what the CPU can say, plus the process's
        lifetime peak from ``getrusage``."""
        current, peak = self.memory_allocated(device), self.max_memory_allocated(device)
        return {
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": current,
            "reserved_bytes.all.peak": peak,
            "lifetime_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }

    def memory_summary(self, device: Device = None, abbreviated: bool = False) -> str:
        stats = self.memory_stats(device)
        mib = 1 << 20
        return (
            f"CPU (host process {os.getpid()}): resident "
            f"{stats['allocated_bytes.all.current'] / mib:.1f} MiB, "
            f"peak {stats['allocated_bytes.all.peak'] / mib:.1f} MiB since the last reset"
        )

    def memory_snapshot(self) -> list[dict[str, Any]]:
        raise _no_cpu("memory_snapshot (the CUDA caching allocator's segments)")

    def set_per_process_memory_fraction(self, fraction: float, device: Device = None) -> None:
        raise _no_cpu("set_per_process_memory_fraction")

    # streams and events: torch.cpu's, which run work in order at once
    def Stream(self, device: Device = None, priority: int = 0, **kwargs: Any) -> Any:  # noqa: N802
        _check_cpu(device)
        if kwargs:
            raise TypeError(f"the CPU stream takes no {sorted(kwargs)}.")
        return torch.cpu.Stream(priority)

    def Event(  # noqa: N802
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> Any:
        event = getattr(torch.cpu, "Event", None)
        if event is None:
            raise RuntimeError("this torch has no torch.cpu.Event (torch 2.5 and later do).")
        if enable_timing or blocking or interprocess:
            raise ValueError("CPU events support none of enable_timing, blocking, interprocess.")
        return event()

    def current_stream(self, device: Device = None) -> Any:
        _check_cpu(device)
        return torch.cpu.current_stream()

    def default_stream(self, device: Device = None) -> Any:
        _check_cpu(device)
        return torch.cpu.current_stream()

    def set_stream(self, stream_: Any) -> None:
        if stream_ is not torch.cpu.current_stream():
            raise ValueError("the CPU accelerator has one stream, its current one.")

    def stream(self, stream_: Any) -> AbstractContextManager[Any]:
        return torch.cpu.stream(stream_)

    # mixed precision
    def autocast(
        self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True
    ) -> AbstractContextManager[Any]:
        """CPU autocast at ``dtype`` (Colossal-AI returns a no-op here)."""
        return torch.autocast("cpu", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


# ---------------------------------------------------------------- CUDA


class CudaAccelerator(BaseAccelerator):
    """An NVIDIA GPU; collectives over NCCL. Each call is torch.cuda's."""

    def __init__(self) -> None:
        super().__init__(name="cuda", communication_backend="nccl", is_synchronous=False)

    def get_version(self) -> str | None:
        return torch.version.cuda

    def get_current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device: Device = None) -> None:
        """Bind to ``device``; None: ``LOCAL_RANK`` modulo the device count,
        else the global rank modulo it."""
        if device is None:
            local = os.environ.get("LOCAL_RANK")
            if local is not None:
                device = int(local) % torch.cuda.device_count()
            elif dist.is_initialized():
                device = dist.get_rank() % torch.cuda.device_count()
            else:
                raise RuntimeError(
                    "set_device() without a device needs LOCAL_RANK or an initialised "
                    "process group."
                )
        torch.cuda.set_device(device)

    def get_device_name(self, device: Device = None) -> str:
        return torch.cuda.get_device_name(device)

    def synchronize(self, device: Device = None) -> None:
        torch.cuda.synchronize(device)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def get_device_capability(self, device: Device = None) -> tuple[int, int]:
        return torch.cuda.get_device_capability(device)

    def get_device_properties(self, device: Device = None) -> Any:
        return torch.cuda.get_device_properties(device)

    def utilization(self, device: Device = None) -> int:
        return torch.cuda.utilization(device)

    def get_rng_state(self, device: Device = "cuda") -> torch.Tensor:
        return torch.cuda.get_rng_state(device if device is not None else "cuda")

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return torch.cuda.get_rng_state_all()

    def set_rng_state(self, new_state: torch.Tensor, device: Device = "cuda") -> None:
        torch.cuda.set_rng_state(new_state, device if device is not None else "cuda")

    def set_rng_state_all(self, new_states: list[torch.Tensor]) -> None:
        torch.cuda.set_rng_state_all(new_states)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def seed(self) -> None:
        torch.cuda.seed()

    def seed_all(self) -> None:
        torch.cuda.seed_all()

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_stats(self, device: Device = None) -> dict[str, Any]:
        return torch.cuda.memory_stats(device)

    def memory_summary(self, device: Device = None, abbreviated: bool = False) -> str:
        return torch.cuda.memory_summary(device, abbreviated)

    def memory_snapshot(self) -> Any:
        return torch.cuda.memory_snapshot()  # type: ignore[no-untyped-call]

    def memory_allocated(self, device: Device = None) -> int:
        return torch.cuda.memory_allocated(device)

    def max_memory_allocated(self, device: Device = None) -> int:
        return torch.cuda.max_memory_allocated(device)

    def memory_reserved(self, device: Device = None) -> int:
        return torch.cuda.memory_reserved(device)

    def max_memory_reserved(self, device: Device = None) -> int:
        return torch.cuda.max_memory_reserved(device)

    def reset_peak_memory_stats(self, device: Device = None) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def reset_max_memory_allocated(self, device: Device = None) -> None:
        torch.cuda.reset_peak_memory_stats(device)  # what torch's deprecated alias does

    def reset_max_memory_cached(self, device: Device = None) -> None:
        torch.cuda.reset_peak_memory_stats(device)  # what torch's deprecated alias does

    def set_per_process_memory_fraction(self, fraction: float, device: Device = None) -> None:
        torch.cuda.set_per_process_memory_fraction(fraction, device)

    def Stream(self, device: Device = None, priority: int = 0, **kwargs: Any) -> Any:  # noqa: N802
        return torch.cuda.Stream(device, priority, **kwargs)  # type: ignore[no-untyped-call]

    def Event(  # noqa: N802
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> Any:
        return torch.cuda.Event(enable_timing, blocking, interprocess)  # type: ignore[no-untyped-call]

    def current_stream(self, device: Device = None) -> Any:
        return torch.cuda.current_stream(device)

    def default_stream(self, device: Device = None) -> Any:
        return torch.cuda.default_stream(device)

    def set_stream(self, stream_: Any) -> None:
        torch.cuda.set_stream(stream_)

    def stream(self, stream_: Any) -> AbstractContextManager[Any]:
        context: AbstractContextManager[Any] = torch.cuda.stream(stream_)
        return context

    def autocast(
        self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True
    ) -> AbstractContextManager[Any]:
        return torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


def get_accelerator() -> CudaAccelerator | CpuAccelerator:
    """CUDA when ``torch.cuda.is_available()``, else the CPU."""
    return CudaAccelerator() if torch.cuda.is_available() else CpuAccelerator()
