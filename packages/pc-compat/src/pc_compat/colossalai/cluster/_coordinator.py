"""Who is master, who prints, who goes first: Colossal-AI's
``DistCoordinator`` shape over the default process group.

Not a singleton: every instance reads the same default group and
environment, so two instances answer alike, and a test that builds a new
group gets a coordinator for it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

import torch
import torch.distributed as dist

from pc_comm import health

__all__ = ["DistCoordinator"]

P = ParamSpec("P")
R = TypeVar("R")


def _local_rank_from_env() -> int | None:
    raw = os.environ.get("LOCAL_RANK")
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"environment variable LOCAL_RANK must be an integer, got {raw!r}."
        ) from None


def _flag_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class DistCoordinator:
    """Rank queries and rank-0-only helpers for the default process group.

    ``process_group`` arguments take a sub-group; ranks are then ranks in
    that group. ``local_rank`` comes from ``LOCAL_RANK`` (set by torchrun, and
    by :func:`pc_comm.launch`).
    """

    def __init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "DistCoordinator needs an initialised default process group: call "
                "pc_comm.launch_from_torch() (under torchrun), pc_comm.launch(rank=..., "
                "world_size=..., host=..., port=...) or dist.init_process_group first."
            )
        # Read once, as the process group is fixed for the coordinator's life.
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        # None when no launcher said it: node-level questions then raise.
        self._local_rank = _local_rank_from_env()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def local_rank(self) -> int:
        """This process's index on its node. Raises when ``LOCAL_RANK`` is
        not set (Colossal-AI returns -1 there)."""
        if self._local_rank is None:
            raise RuntimeError(
                "the local rank is unknown: LOCAL_RANK is not set. Start the script with "
                "torchrun, or with pc_comm.launch(..., local_rank=...), which set it."
            )
        return self._local_rank

    def is_master(self, process_group: dist.ProcessGroup | None = None) -> bool:
        """Whether this is rank 0 (of ``process_group`` if given)."""
        return dist.get_rank(process_group) == 0

    def is_node_master(self) -> bool:
        """Whether this is local rank 0 on its node."""
        return self.local_rank == 0

    def is_last_process(self, process_group: dist.ProcessGroup | None = None) -> bool:
        """Whether this is the last rank (of ``process_group`` if given)."""
        return dist.get_rank(process_group) == dist.get_world_size(process_group) - 1

    def print_on_master(self, msg: object, process_group: dist.ProcessGroup | None = None) -> None:
        """``print(msg)`` on rank 0 only."""
        if self.is_master(process_group):
            print(msg, flush=True)

    def print_on_node_master(self, msg: object) -> None:
        """``print(msg)`` on local rank 0 of each node only."""
        if self.is_node_master():
            print(msg, flush=True)

    def block_all(self, process_group: dist.ProcessGroup | None = None) -> None:
        """A barrier over ``process_group`` (default: every rank)."""
        dist.barrier(group=process_group)

    @contextmanager
    def priority_execution(
        self, executor_rank: int = 0, process_group: dist.ProcessGroup | None = None
    ) -> Iterator[None]:
        """Run the body on ``executor_rank`` first and on the other ranks after
        it finished (a download or a cache build that must happen once).

        If the body raises on the executor, the other ranks raise too,
        naming it, instead of running their body on a half-done result
        (Colossal-AI's version leaves them waiting in a barrier forever).
        """
        size = dist.get_world_size(process_group)
        if not isinstance(executor_rank, int) or not 0 <= executor_rank < size:
            raise ValueError(f"executor_rank must be a rank in [0, {size}), got {executor_rank!r}.")
        source = (
            executor_rank
            if process_group is None
            else dist.get_global_rank(process_group, executor_rank)
        )
        flag = torch.zeros(1, dtype=torch.int32, device=_flag_device(process_group))
        if dist.get_rank(process_group) != executor_rank:
            dist.broadcast(flag, src=source, group=process_group)
            if flag.item() != 1:
                raise RuntimeError(
                    f"rank {executor_rank} raised inside priority_execution, so this rank "
                    "does not run the body; see that rank's error."
                )
            yield
            return
        try:
            yield
        except BaseException:
            dist.broadcast(flag, src=source, group=process_group)  # 0: failed
            raise
        flag.fill_(1)
        dist.broadcast(flag, src=source, group=process_group)

    def destroy(self, process_group: dist.ProcessGroup | None = None) -> None:
        """Destroy ``process_group`` (default: the default group, and with it
        this rank's health board)."""
        if process_group is None:
            health.stop_board()
        dist.destroy_process_group(process_group)

    def on_master_only(
        self, process_group: dist.ProcessGroup | None = None
    ) -> Callable[[Callable[P, R]], Callable[P, R | None]]:
        """A decorator: the function runs on rank 0 (of ``process_group``)
        and returns None elsewhere. Whether this is rank 0 is decided when
        the decorator is made."""
        master = self.is_master(process_group)

        def decorate(func: Callable[P, R]) -> Callable[P, R | None]:
            @functools.wraps(func)
            def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | None:
                return func(*args, **kwargs) if master else None

            return wrapper

        return decorate
