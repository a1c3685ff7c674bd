"""Async sharded saves [Note: async saves]: the host copies made beside
training and the writes on a thread and a gloo group of their own."""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from pc_booster.checkpoint import files
from pc_booster.plugins import sharded

__all__ = ["AsyncSaves"]


def fence_steps(saves: AsyncSaves) -> None:
    """Make every optimizer step in this process wait for ``saves``'
    async-save copies first [Note: async saves] (for as long as it lives)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    ref = weakref.ref(saves)

    def fence(optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        alive = ref()
        if alive is not None:
            alive.wait_for_copies()

    register_optimizer_step_pre_hook(fence)


class AsyncSaves:
    """The sharded saves of one Booster, now or in the background."""

    def __init__(self) -> None:
        # Async saves [Note: async saves]: a background stager and a
        # background writer (one thread each, so copies and writes land in
        # the order they were asked), the writes over a gloo group of their
        # own (training's collectives run on the default group meanwhile),
        # all made on the first async save; the writes not finished yet;
        # the copies not finished yet, which every optimizer step waits for.
        self._stager: ThreadPoolExecutor | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._save_group: dist.ProcessGroup | None = None
        self._pending: list[Future[None]] = []
        self._copying: list[Future[Any]] = []
        self._copy_waits = 0.0
        # Host copies kept per kind of state ("model", "optimizer") for the
        # next async save of that kind, with the save that last wrote them.
        self._staging: dict[str, dict[Any, torch.Tensor]] = {}
        self._staged_by: dict[str, Future[None]] = {}

    # [Note: async saves]
    # An async save takes, at the call, what training could change before
    # its next optimizer step (module buffers, small tensors, every
    # non-tensor value) and copies the rest of this rank's share to host
    # memory on a background thread while the next forward and backward run
    # ([Note: staging beside training] in pc_booster.plugins.sharded); every
    # optimizer step, anywhere in the process, waits until the copies asked
    # for before it are done (a step pre-hook; under Gemini's
    # step_in_backward that is the first chunk's update inside backward).
    # The host buffers of the last save of the same kind are reused once it
    # is written, so later saves copy into memory already mapped. A second
    # thread then runs DCP's save of the copy over a gloo group made for
    # saves only, so its collectives never interleave with training's on the
    # default group. DCP's .metadata is written last, so a process killed
    # mid-write leaves the directory without a commit point (not loadable)
    # and every other checkpoint as it was. Loads wait for the writes still
    # going. Parameters changed by hand (not by a step) before the copy is
    # done would reach the checkpoint: call wait_for_saves() first.

    def write(
        self,
        state: dict[str, Any],
        out: Path,
        tidy: Any,
        use_async: bool,
        kind: str,
        changing: Iterable[torch.Tensor] = (),
        file_count: int = 1,
    ) -> Future[None] | None:
        """Save ``state`` to ``out``, then ``tidy()`` on rank 0 (collective),
        now or in the background (``kind``: which host copies to reuse;
        ``changing``: tensors training changes outside optimizer steps)."""
        if not use_async:
            files.save_sharded(state, out, files=file_count)
            if dist.get_rank() == 0:
                tidy()
            dist.barrier()
            return None

        kept = sharded.held(state, changing)
        if self._writer is None:
            self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pc-stage")
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pc-save")
            self._save_group = dist.new_group(backend="gloo")
            fence_steps(self)
        assert self._stager is not None
        group, previous = self._save_group, self._staged_by.get(kind)
        buffers = self._staging.setdefault(kind, {})

        def stage() -> dict[str, Any]:
            if previous is not None:  # its copy is written: the buffers are free again
                wait([previous])
            return sharded.staged(kept, buffers)

        copying = self._stager.submit(stage)

        def write() -> None:
            files.save_sharded(copying.result(), out, group, file_count)
            if dist.get_rank() == 0:
                tidy()
            dist.barrier(group=group)

        future = self._writer.submit(write)
        self._copying = [f for f in self._copying if not f.done()] + [copying]
        self._pending = [f for f in self._pending if not f.done()] + [future]
        self._staged_by[kind] = future
        return future

    def wait_for_copies(self) -> None:
        """Wait until the host copies of every async save asked for so far
        are made (what optimizer steps wait for); the writes may go on."""
        copying = [f for f in self._copying if not f.done()]
        if copying:
            began = time.perf_counter()
            wait(copying)
            self._copy_waits += time.perf_counter() - began
        self._copying = []

    @property
    def async_save_waits(self) -> float:
        """Seconds training has waited, in all, for async saves' host copies
        at its optimizer steps (the part of an async save's stall after the
        call returned)."""
        return self._copy_waits

    def wait_for_saves(self) -> None:
        """Wait until every async save has been written; raise the first
        one's error, if one failed."""
        self.wait_for_copies()
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()
