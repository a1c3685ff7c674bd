"""Reading and validating the launcher's environment.

torchrun (and torch's elastic agent in general) tells each worker who it is
through environment variables. Everything that starts a process group reads
them here, once, into a frozen :class:`DistEnv`, so a missing or inconsistent
variable fails with one clear message instead of a hang inside the
rendezvous.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DistEnv", "DistEnvError", "read_dist_env"]

_LAUNCH_HINT = (
    "Start the script with torchrun, for example "
    "`torchrun --nproc-per-node 2 train.py` (one machine) or "
    "`torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d "
    "--rdzv-endpoint HOST:29500 train.py` (several), or set the variables yourself."
)


class DistEnvError(ValueError):
    """The launcher's environment is missing a variable or contradicts itself."""


@dataclass(frozen=True)
class DistEnv:
    """Who this process is, as the launcher described it.

    ``node_rank`` is torchrun's ``GROUP_RANK``: the index of this worker's node
    (agent) among all nodes. ``local_rank`` indexes the workers on one node.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size


def _int_var(environ: Mapping[str, str], name: str, *, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None:
        if default is not None:
            return default
        raise DistEnvError(f"environment variable {name} is not set. {_LAUNCH_HINT}")
    try:
        return int(raw)
    except ValueError:
        raise DistEnvError(
            f"environment variable {name} must be an integer, got {raw!r}. {_LAUNCH_HINT}"
        ) from None


def read_dist_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read torchrun's variables and check that they agree with each other.

    ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` are required.
    ``LOCAL_RANK`` defaults to ``RANK`` and ``LOCAL_WORLD_SIZE`` to
    ``WORLD_SIZE`` (one node), and ``GROUP_RANK`` to ``RANK //
    LOCAL_WORLD_SIZE``, which is what torchrun sets when every node runs the
    same number of workers. Pass ``environ`` to validate a mapping other than
    ``os.environ``.
    """
    env = os.environ if environ is None else environ
    rank = _int_var(env, "RANK")
    world_size = _int_var(env, "WORLD_SIZE")
    local_rank = _int_var(env, "LOCAL_RANK", default=rank)
    local_world_size = _int_var(env, "LOCAL_WORLD_SIZE", default=world_size)
    master_addr = env.get("MASTER_ADDR")
    if not master_addr:
        raise DistEnvError(f"environment variable MASTER_ADDR is not set. {_LAUNCH_HINT}")
    master_port = _int_var(env, "MASTER_PORT")

    if world_size < 1:
        raise DistEnvError(f"WORLD_SIZE must be at least 1, got {world_size}.")
    if not 0 <= rank < world_size:
        raise DistEnvError(
            f"RANK must be in [0, WORLD_SIZE={world_size}), got RANK={rank}. "
            "Each process needs its own rank; torchrun assigns them."
        )
    if local_world_size < 1 or world_size % local_world_size != 0:
        raise DistEnvError(
            f"WORLD_SIZE ({world_size}) must be a multiple of LOCAL_WORLD_SIZE "
            f"({local_world_size}): every node runs the same number of workers. "
            "Use the same --nproc-per-node on every node."
        )
    if not 0 <= local_rank < local_world_size:
        raise DistEnvError(
            f"LOCAL_RANK must be in [0, LOCAL_WORLD_SIZE={local_world_size}), "
            f"got LOCAL_RANK={local_rank}."
        )
    num_nodes = world_size // local_world_size
    node_rank = _int_var(env, "GROUP_RANK", default=rank // local_world_size)
    if not 0 <= node_rank < num_nodes:
        raise DistEnvError(
            f"GROUP_RANK must be in [0, WORLD_SIZE / LOCAL_WORLD_SIZE = "
            f"{world_size} / {local_world_size} = {num_nodes}), got GROUP_RANK={node_rank}."
        )
    if not 0 < master_port < 65536:
        raise DistEnvError(f"MASTER_PORT must be a TCP port in 1..65535, got {master_port}.")
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
    )
