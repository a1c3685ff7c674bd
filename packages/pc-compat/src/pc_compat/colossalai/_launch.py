"""Colossal-AI's ``launch`` and ``launch_from_torch`` over pc-comm's
``init_distributed``.

[Note: launch without torchrun]
``launch(rank, world_size, host, port)`` is for processes started some other
way (a cluster's own launcher, a script that forks). It opens the rendezvous
store itself, and before the process group exists each rank writes its host
name there; from them every rank derives its local rank, the number of
ranks on its node and its node's index, as torchrun would have told it.
Then it exports them, with the rank and the store's address, as torchrun's
variables (``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``
...), so everything in pc that reads the launcher's environment
(``DistCoordinator``'s local rank, the hierarchical communicator's nodes)
sees the same job whichever way it started. No collective is needed for
this, so the CUDA device is chosen from the real local rank before NCCL
binds to one.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]  # not in torch's __all__

from pc_comm import DistContext, init_distributed
from pc_comm.launch import DEFAULT_TIMEOUT
from pc_compat.colossalai.logging import get_dist_logger

__all__ = [
    "LegacyConfig",
    "launch",
    "launch_from_openmpi",
    "launch_from_slurm",
    "launch_from_torch",
]

# Colossal-AI's old config argument: only an empty one is taken.
LegacyConfig = Mapping[str, object] | str | os.PathLike[str] | None


def _backend(backend: str | None) -> str | None:
    """``'nccl'`` (Colossal-AI's default) where no GPU is visible would stop
    there; here it falls back to gloo, which is what a CPU run needs."""
    if backend == "nccl" and not torch.cuda.is_available():
        return "gloo"
    return backend


def _refuse_config(config: object, caller: str) -> None:
    """Accept Colossal-AI's empty ``config={}`` (or None); refuse any other."""
    if config is None or (isinstance(config, Mapping) and len(config) == 0):
        return
    if isinstance(config, Mapping):
        what = f"a config with keys {sorted(str(k) for k in config)}"
    elif isinstance(config, (str, os.PathLike)):
        what = f"the config file {os.fspath(config)!r}"
    else:
        raise TypeError(
            f"{caller}: config must be a dict, a file path or None, got {type(config).__name__}."
        )
    raise ValueError(
        f"{caller}(config=...) got {what}, and pc reads no config. Colossal-AI's "
        "config (parallel sizes, fp16, zero, gradient clipping) is given in pc as the "
        "options of the plugin passed to pc_booster.Booster, and the seed, backend and "
        "logging as arguments of this function (see docs/migrate-colossalai.md). "
        "Pass config={} or leave it out."
    )


def _looks_like_config(value: object) -> bool:
    """A config passed where the backend now stands (Colossal-AI's old
    positional order ``launch_from_torch(config, backend, ...)``)."""
    if isinstance(value, (Mapping, os.PathLike)):
        return True
    return isinstance(value, str) and (value.endswith(".py") or os.sep in value)


def _check_seed_and_verbose(seed: object, verbose: object) -> None:
    """Before anything starts, so a wrong value costs no rendezvous."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got {seed!r}.")
    if not isinstance(verbose, bool):
        raise TypeError(f"verbose must be True or False, got {verbose!r}.")


def _seed_all(seed: int) -> None:
    """What Colossal-AI's ``set_seed`` seeds: Python, NumPy (when installed)
    and torch (CPU and every CUDA device)."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _finish_launch(context: DistContext, seed: int | None, verbose: bool) -> DistContext:
    if seed is not None:
        _seed_all(seed)
    if verbose:
        get_dist_logger().info(
            f"Distributed environment is initialized, world size: {context.env.world_size}, "
            f"backend: {context.backend}, device: {context.device}",
            ranks=[0],
        )
    return context


def launch_from_torch(
    backend: str | None = "nccl",
    seed: int | None = 1024,
    verbose: bool = True,
    *,
    config: LegacyConfig = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    health_interval: float | None = 1.0,
) -> DistContext:
    """Colossal-AI's entry point under torchrun: :func:`init_distributed`,
    then seed Python, NumPy and torch with ``seed`` on every rank (so
    replicated parameters start equal; None leaves the generators alone),
    and with ``verbose`` log one line on rank 0.

    ``backend`` None picks NCCL with CUDA and gloo without; a backend that
    cannot run here is refused (Colossal-AI replaces it by its
    accelerator's). ``config``: only an empty one (old scripts pass
    ``config={}``); any other is refused with what to use instead.
    """
    if _looks_like_config(backend):
        if config is not None:
            raise TypeError("launch_from_torch got a config both positionally and as config=.")
        config, backend = backend, None
    _refuse_config(config, "launch_from_torch")
    _check_seed_and_verbose(seed, verbose)
    context = init_distributed(_backend(backend), timeout, health_interval=health_interval)
    return _finish_launch(context, seed, verbose)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        hint = ""
        if name == "rank" and isinstance(value, (Mapping, str, os.PathLike)):
            hint = (
                " Colossal-AI's old launch took config first, launch(config, rank, ...): "
                "pass the arguments by name, launch(rank=..., world_size=..., host=..., port=...)."
            )
        raise TypeError(f"launch: {name} must be an int, got {value!r}.{hint}")
    if value < low or (high is not None and value >= high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"launch: {name} must be in {bound}, got {value}.")
    return value


def _agree_with_environment(rank: int, world_size: int, local_rank: int | None) -> None:
    given = {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": local_rank}
    for key, value in given.items():
        present = os.environ.get(key)
        if value is not None and present is not None and present != str(value):
            raise ValueError(
                f"launch: {key.lower()}={value}, but the environment says {key}={present} "
                "(set by a launcher). Use launch_from_torch() under torchrun, or pass the "
                "values the launcher gave."
            )


def _rendezvous(
    rank: int, world_size: int, host: str, port: int, local_rank: int | None, timeout: timedelta
) -> tuple[Store, dict[str, str]]:
    """The store, and torchrun's variables for this rank [Note: launch without torchrun]."""
    store = dist.TCPStore(  # type: ignore[attr-defined]  # not in torch's __all__
        host, port, world_size, is_master=rank == 0, timeout=timeout
    )
    mine = f"{socket.gethostname()}\n{-1 if local_rank is None else local_rank}"
    store.set(f"pc_launch/{rank}", mine)
    entries = [store.get(f"pc_launch/{r}").decode().split("\n") for r in range(world_size)]
    hosts = [entry[0] for entry in entries]
    nodes = list(dict.fromkeys(hosts))  # in order of each node's first rank
    peers = [r for r in range(world_size) if hosts[r] == hosts[rank]]
    sizes = {node: hosts.count(node) for node in nodes}
    if len(set(sizes.values())) != 1:
        raise ValueError(
            f"launch: pc needs the same number of processes on every node, got {sizes}."
        )
    if local_rank is None:
        local_rank = peers.index(rank)
    else:
        given = sorted(int(entries[r][1]) for r in peers)
        if given != list(range(len(peers))):
            raise ValueError(
                f"launch: the local ranks given on host {hosts[rank]!r} are {given}; they "
                f"must be 0..{len(peers) - 1}, one per process (or pass local_rank=None)."
            )
    environ = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(len(peers)),
        "GROUP_RANK": str(nodes.index(hosts[rank])),
        "MASTER_ADDR": host,
        "MASTER_PORT": str(port),
    }
    return store, environ


def launch(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str | None = "nccl",
    local_rank: int | None = None,
    seed: int | None = 1024,
    verbose: bool = True,
    *,
    config: LegacyConfig = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    health_interval: float | None = 1.0,
) -> DistContext:
    """Colossal-AI's ``launch``: join the default process group as ``rank``
    of ``world_size`` through the store at ``host:port`` (rank 0 serves
    it), then seed and log as :func:`launch_from_torch` does.

    ``local_rank`` None derives it from the host names of all ranks; either
    way this rank's local rank, node size and node index are exported as
    torchrun's variables [Note: launch without torchrun]. Under NCCL the
    rank is pinned to ``cuda:local_rank``. A process group that already
    exists with this rank and size is kept.
    """
    _refuse_config(config, "launch")
    _check_seed_and_verbose(seed, verbose)
    _check_int("rank", rank, 0)
    _check_int("world_size", world_size, 1)
    _check_int("rank", rank, 0, world_size)
    _check_int("port", port, 1, 65536)
    if local_rank is not None:
        _check_int("local_rank", local_rank, 0, world_size)
    if not isinstance(host, str) or not host:
        raise TypeError(f"launch: host must be a host name or address, got {host!r}.")
    _agree_with_environment(rank, world_size, local_rank)
    if dist.is_initialized():
        context = init_distributed(_backend(backend), timeout, health_interval=health_interval)
    else:
        store, environ = _rendezvous(rank, world_size, host.strip("[]"), port, local_rank, timeout)
        os.environ.update(environ)
        context = init_distributed(
            _backend(backend),
            timeout,
            environ=environ,
            store=store,
            health_interval=health_interval,
        )
    return _finish_launch(context, seed, verbose)


def _from_environment(
    launcher: str, keys: tuple[str, str, str | None]
) -> tuple[int, int, int | None]:
    """Rank, world size and local rank from a launcher's variables."""
    rank_key, world_key, local_key = keys
    missing = [k for k in keys if k is not None and k not in os.environ]
    if missing:
        raise ValueError(
            f"launch_from_{launcher}: {', '.join(missing)} not set; this process was not "
            f"started by {launcher}. Under torchrun use launch_from_torch(), elsewhere "
            "launch(rank=, world_size=, host=, port=)."
        )
    local = int(os.environ[local_key]) if local_key is not None else None
    return int(os.environ[rank_key]), int(os.environ[world_key]), local


def launch_from_slurm(
    host: str, port: int, backend: str = "nccl", seed: int = 1024, verbose: bool = True
) -> DistContext:
    """Colossal-AI's ``launch_from_slurm``: :func:`launch` with the rank and
    world size Slurm gives (``SLURM_PROCID``, ``SLURM_NPROCS``)."""
    rank, world, _ = _from_environment("slurm", ("SLURM_PROCID", "SLURM_NPROCS", None))
    return launch(rank, world, host, port, backend, None, seed, verbose)


def launch_from_openmpi(
    host: str, port: int, backend: str = "nccl", seed: int = 1024, verbose: bool = True
) -> DistContext:
    """Colossal-AI's ``launch_from_openmpi``: :func:`launch` with the ranks
    OpenMPI gives (``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
    ``OMPI_COMM_WORLD_LOCAL_RANK``)."""
    rank, world, local = _from_environment(
        "openmpi",
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    )
    return launch(rank, world, host, port, backend, local, seed, verbose)
