"""Starting the default process group: from torchrun's environment
(:func:`init_distributed`, :func:`launch_from_torch`) or from explicit
arguments (:func:`launch`), the last two in Colossal-AI's call shapes.

[Note: launch without torchrun]
``launch(rank, world_size, host, port)`` is for processes started some other
way (a cluster's own launcher, a script that forks). It opens the rendezvous
store itself, and before the process group exists each rank writes its host
name there; from them every rank derives its local rank, the number of
ranks on its node and its node's index, as torchrun would have told it.
Then it exports them, with the rank and the store's address, as torchrun's
variables (``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``
...), so everything in pc that reads the launcher's environment
(:class:`~pc_comm.DistCoordinator`'s local rank, the hierarchical
communicator's nodes) sees the same job whichever way it started. No
collective is needed for this, so the CUDA device is chosen from the real
local rank before NCCL binds to one.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]  # not in torch's __all__

from pc_comm import health
from pc_comm.env import DistEnv, read_dist_env
from pc_comm.logger import get_dist_logger

__all__ = ["DistContext", "LegacyConfig", "init_distributed", "launch", "launch_from_torch"]

# Long enough for a slow first NCCL communicator on a big job, short enough
# that a dead peer does not hold a job for torch's 30-minute default.
DEFAULT_TIMEOUT = timedelta(minutes=10)

# Colossal-AI's old ``config=``: a dict (or its Config, a dict) or a file path.
LegacyConfig = Mapping[str, object] | str | os.PathLike[str] | None
_ENV_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


@dataclass(frozen=True)
class DistContext:
    """What :func:`init_distributed` set up: the environment, the backend in
    use and the device this rank computes on."""

    env: DistEnv
    backend: str
    device: torch.device


def _pick_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    name = backend.lower()
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    if name not in known:
        raise ValueError(
            f"unknown backend {backend!r}; expected one of {known}, or None to pick "
            "NCCL when CUDA is available and gloo otherwise."
        )
    if name == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "backend 'nccl' needs CUDA, and torch.cuda.is_available() is False. "
            "Use backend='gloo' (or None) on a machine without a GPU."
        )
    return name


def _device_for(backend: str, env: DistEnv) -> torch.device:
    if backend == "nccl":
        # Several local ranks may share a device (count < local world size);
        # NCCL refuses that, so this only happens with a wrapped communicator.
        index = env.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _check_existing(env: DistEnv, chosen: str, backend: str | None) -> DistContext:
    running = str(dist.get_backend())
    if dist.get_rank() != env.rank or dist.get_world_size() != env.world_size:
        raise RuntimeError(
            f"a process group is already initialised as rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, but the environment says rank {env.rank} of "
            f"{env.world_size}. Call dist.destroy_process_group() first."
        )
    if backend is not None and running != chosen:
        raise RuntimeError(
            f"a process group is already initialised with backend {running!r}, "
            f"not the requested {chosen!r}. Call dist.destroy_process_group() first."
        )
    return DistContext(env=env, backend=running, device=_device_for(running, env))


def _start_group(
    env: DistEnv,
    chosen: str,
    timeout: timedelta,
    *,
    init_method: str | None = None,
    store: Store | None = None,
    debug_collectives: bool,
    health_interval: float | None,
) -> DistContext:
    device = _device_for(chosen, env)
    if debug_collectives:
        # torch reads TORCH_DISTRIBUTED_DEBUG once, at import: set the level itself.
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level(dist.DebugLevel.DETAIL)  # type: ignore[attr-defined]
    dist.init_process_group(
        backend=chosen,
        init_method=init_method,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )
    health.set_group_timeout(timeout.total_seconds())  # [Note: one timeout for every path]
    if health_interval is not None:
        health.start_board(health_interval)
    return DistContext(env=env, backend=chosen, device=device)


def init_distributed(
    backend: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    *,
    environ: Mapping[str, str] | None = None,
    debug_collectives: bool = False,
    health_interval: float | None = 1.0,
) -> DistContext:
    """Initialise the default process group from torchrun's environment.

    ``health_interval`` (seconds): this rank's entry on the health board
    (:mod:`pc_comm.health`) is refreshed that often, so that when an
    operation fails, the error names the rank that died or stalled and
    where it was. None: no board, and such errors say only what failed here.

    ``debug_collectives=True`` checks, before every collective of the
    default group, that all ranks call the same operation with the same
    shapes and dtypes (torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wrapper),
    and raises on every rank with both sides' calls when they differ. It
    costs an extra small collective per call: for debugging, not training.

    Picks NCCL when CUDA is available and gloo otherwise (``backend``
    overrides), pins this rank to ``cuda:LOCAL_RANK`` under NCCL, and uses
    ``timeout`` for every collective of the default group. Calling it again
    in a process that is already initialised returns the existing setup if it
    matches, and raises if it does not.
    """
    env = read_dist_env(environ)
    chosen = _pick_backend(backend)
    if dist.is_initialized():
        return _check_existing(env, chosen, backend)
    # Under torchrun the agent already serves the store on MASTER_PORT
    # (TORCHELASTIC_USE_AGENT_STORE); only env:// knows to join it rather
    # than bind the port again.
    init_method = "env://" if environ is None else f"tcp://{env.master_addr}:{env.master_port}"
    return _start_group(
        env,
        chosen,
        timeout,
        init_method=init_method,
        debug_collectives=debug_collectives,
        health_interval=health_interval,
    )


# ------------------------------------------------------ Colossal-AI's shapes


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
    backend: str | None = None,
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
    context = init_distributed(backend, timeout, health_interval=health_interval)
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
    backend: str | None = None,
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
    chosen = _pick_backend(backend)
    if dist.is_initialized():
        env = read_dist_env()
        context = _check_existing(env, chosen, backend)
    else:
        store, environ = _rendezvous(rank, world_size, host.strip("[]"), port, local_rank, timeout)
        env = read_dist_env(environ)
        os.environ.update(environ)
        context = _start_group(
            env,
            chosen,
            timeout,
            store=store,
            debug_collectives=False,
            health_interval=health_interval,
        )
    return _finish_launch(context, seed, verbose)
