"""Starting the default process group from torchrun's environment
(:func:`init_distributed`), or from an explicit rendezvous store and the
variables torchrun would have set (``store=`` / ``environ=``, for processes
no launcher started; docs/packages/pc-compat.md).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]  # not in torch's __all__

from pc_comm import health
from pc_comm.env import DistEnv, read_dist_env

__all__ = ["DistContext", "StoreUnreachableError", "connect_store", "init_distributed"]

# Long enough for a slow first NCCL communicator on a big job, short enough
# that a dead peer does not hold a job for torch's 30-minute default.
DEFAULT_TIMEOUT = timedelta(minutes=10)

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


# [Note: a store reached within the timeout]
# Without a launcher, rank 0 serves the job's store on MASTER_PORT and the
# others dial it. When that port is held by another program, rank 0 fails
# at once (the address is in use), but a rank that dials it reaches the
# other program, which accepts and never answers, and torch's store client
# then waits past any timeout for its handshake. So the store is made here,
# in a thread given the group's timeout: a rank that has not joined by then
# raises StoreUnreachableError naming the address and the likely causes,
# and rank 0 names the port in use. Under torchrun, the agent's store is
# joined as before.


class StoreUnreachableError(RuntimeError):
    """The job's store did not answer within the timeout, or its port is
    held by another program."""


def connect_store(env: DistEnv, timeout: timedelta) -> Store:
    """The job's TCP store at MASTER_ADDR:MASTER_PORT, served by rank 0,
    reached within ``timeout`` [Note: a store reached within the timeout]."""
    import threading

    where = f"{env.master_addr}:{env.master_port}"
    made: list[Store] = []
    failed: list[BaseException] = []

    def make() -> None:
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                env.master_addr,
                env.master_port,
                env.world_size,
                env.rank == 0,
                timeout,
                multi_tenant=True,
            )
            made.append(store)
        except BaseException as error:  # handed to the caller
            failed.append(error)

    worker = threading.Thread(target=make, name="pc-comm-store", daemon=True)
    worker.start()
    worker.join(timeout.total_seconds())
    if made:
        return made[0]
    seconds = f"{timeout.total_seconds():g} s"
    if failed:
        text = " ".join(str(failed[0]).split())[:300]
        if env.rank == 0 and ("in use" in text or "EADDRINUSE" in text or "bind" in text):
            raise StoreUnreachableError(
                f"rank 0 cannot serve the job's store on {where}: the port is in use by another "
                f"program ({text}). Choose a free MASTER_PORT for every rank."
            ) from None
        raise StoreUnreachableError(
            f"rank {env.rank} could not reach the job's store at {where} within {seconds} "
            f"({text}). Check MASTER_ADDR / MASTER_PORT, and that rank 0 started."
        ) from None
    raise StoreUnreachableError(
        f"rank {env.rank} could not join the job's store at {where} within {seconds}: "
        "something there accepted the connection but never answered as a torch store (the "
        "port is held by another program, or rank 0 is not up: look at its output). Choose a "
        "free MASTER_PORT for every rank."
    )


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
    store: Store | None = None,
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

    ``environ``: torchrun's variables for this rank, read instead of the
    process environment; ``store``: a rendezvous store already joined
    (then ``environ``'s address is not dialled again).

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
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if store is None and not (agent and environ is None):
        store = connect_store(env, timeout)  # [Note: a store reached within the timeout]
    return _start_group(
        env,
        chosen,
        timeout,
        init_method=None if store is not None else init_method,
        store=store,
        debug_collectives=debug_collectives,
        health_interval=health_interval,
    )
