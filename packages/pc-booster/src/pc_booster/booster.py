"""``Booster``: one object that wraps a model, optimizer, criterion,
dataloader and LR scheduler for a plugin's parallel strategy, runs the
backward pass the strategy needs, and saves and loads checkpoints that any
other plugin, at any world size and tp / pp layout, can load.

Checkpoints (each written so that a save killed at any moment leaves the
previous checkpoint loadable and the new one complete or absent, see
[Note: sharded saves]):

- ``save_model(..., shard=True)`` / ``save_optimizer(..., shard=True)``:
  a ``torch.distributed.checkpoint`` directory to which every rank writes
  only its share; loads read only each rank's byte ranges. No rank holds
  the whole model or optimizer state.
- ``export_pretrained``: ``transformers``' layout (safetensors files of at
  most ``size_per_shard`` MiB, ``model.safetensors.index.json``,
  ``config.json``), streamed from a sharded save one tensor at a time.
- ``shard=False``: one ``model.safetensors`` / ``optimizer.pt`` that rank 0
  writes after every rank gathered the whole state: a convenience for
  models that fit on one rank several times over (every rank then holds
  the full fp32 model, and for the optimizer its full state).
- LR scheduler: its ``state_dict`` through ``torch.save``.

``load_model`` reads any of them, and a ``save_pretrained`` directory, by
slices of each rank's share.
"""

from __future__ import annotations

import os
import shutil
import time
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pc_booster import checksum
from pc_booster.export import atomic_write, indexed_files, remove_files
from pc_booster.plugin import Plugin, Precision, SupportsNoSync, SupportsPipeline
from pc_booster.rules import TrainPrecision
from pc_booster.wrappers import inner_optimizer

__all__ = ["Booster"]

_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's commit point
# Every write and removal of a save goes through these two (the atomic-save
# test stops a save at each of them in turn).
_atomic = atomic_write
_remove = remove_files


def _fence_steps(booster: Booster) -> None:
    """Make every optimizer step in this process wait for ``booster``'s
    async-save copies first [Note: async saves] (for as long as it lives)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    ref = weakref.ref(booster)

    def fence(optimizer: Any, args: Any, kwargs: Any) -> None:
        alive = ref()
        if alive is not None:
            alive.wait_for_copies()

    register_optimizer_step_pre_hook(fence)


# [Note: single-file arguments]
# Programs written for the original Booster pass size_per_shard and use_async
# with shard=False (docs/migrate-colossalai.md).
# One file has no shards, and it is gathered whole before it is written, so
# there is nothing to stage in the background: both are accepted and have
# no effect; with use_async the save returns a future that is already done
# (the file is complete when save_model returns).


def _done() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


# [Note: sharded saves]
# DCP's .metadata is the commit point of a sharded checkpoint; the index is
# that of an exported one. New export files never take a name the current
# index uses (they get a fresh token when the plain names are taken), the
# index is replaced last, and only then are the files only the old index
# named removed; loads read only the files the index names. A save killed
# before the index is replaced leaves the old index and all its files;
# after, the new ones. The single file model.safetensors is replaced in one
# rename; a stale index next to it (load_model prefers an index) is removed
# after that rename.


@contextmanager
def _named_failures(what: str) -> Iterator[None]:
    """DCP reports a rank's failure as a CheckpointException, a
    BaseException that ``except Exception`` misses: raise it as the error
    it wraps (an OSError stays one: a full disk), naming the rank."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as error:
        rank, failure = next(iter(error.failures.items()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        lines = str(inner).strip().splitlines()
        message = f"{what}: rank {rank}: {type(inner).__name__}: {lines[0] if lines else ''}"
        if isinstance(inner, OSError):
            raise OSError(inner.errno, message) from None
        raise ValueError(message) from None


# [Note: checkpoint forms]
# save_model(shard=False) in the original Booster writes one file at the path it is
# given, which its users torch.load; pc did so only as a directory of
# transformers' layout. Both are kept: a path with a file suffix is a file,
# any other path a directory (model.safetensors + config.json). shard=True
# is DCP's directory (every rank its share), or with use_safetensors=True
# transformers' sharded safetensors streamed without gathering, which is
# what the original's sharded form is (docs/migrate-colossalai.md).
_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")


def _is_file_name(path: Path) -> bool:
    return not path.is_dir() and path.suffix in _FILE_SUFFIXES


def _refuse_prefix(prefix: str | None) -> None:
    if prefix is not None:
        raise ValueError(
            f"prefix={prefix!r}: pc names a sharded checkpoint's files as "
            "torch.distributed.checkpoint (or transformers, for use_safetensors=True) does; "
            "drop prefix, or save into a directory of its own."
        )


def _files(state: dict[str, Any], size_per_shard: int | None) -> int:
    """How many files this rank's share goes into: about ``size_per_shard``
    MiB each (one when None)."""
    if size_per_shard is None:
        return 1
    if size_per_shard <= 0:
        raise ValueError(f"size_per_shard must be a positive number of MiB, got {size_per_shard}.")
    from torch.distributed.tensor import DTensor

    from pc_zero import Pieces

    total = 0
    for value in state.values():
        if isinstance(value, Pieces):
            total += sum(t.numel() * t.element_size() for _, t in value.boxes)
        elif isinstance(value, DTensor):
            local = value.to_local()
            total += local.numel() * local.element_size()
        elif isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return max(1, -(-total // (size_per_shard * 2**20)))


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    """A single-file checkpoint: safetensors, or torch.save's state dict
    (mapped, so its pages are read only as they are copied)."""
    if path.suffix == ".safetensors" or _is_safetensors(path):
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(str(path), framework="pt") as header:
            metadata = header.metadata()
        tensors = load_file(str(path))
        checksum.check_tensors(path, tensors, metadata)  # in memory: no second read
        return tensors
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(
            f"{path} is not a model checkpoint: expected a state dict of tensors (what "
            "Booster.save_model or torch.save(model.state_dict()) writes)."
        )
    return state


def _is_safetensors(path: Path) -> bool:
    """safetensors files start with an 8-byte header length, then '{'."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{"


def _with_checksums(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """A safetensors header's metadata: the format transformers expects
    and every tensor's checksum (``pc_booster.checksum``)."""
    return {"format": "pt", **checksum.tensor_checksums(state)}


def _distinct(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied weights): copies."""
    seen: set[int] = set()
    out = {}
    for key, value in state.items():
        value = value.detach().cpu().contiguous()
        if value.data_ptr() in seen:
            value = value.clone()
        seen.add(value.data_ptr())
        out[key] = value
    return out


def _verify_safetensors_files(directory: Path, collective: bool) -> None:
    """The safetensors files a load of ``directory`` reads (those its index
    names, else model.safetensors) against their checksums, split over the
    ranks with ``collective``."""
    names = sorted(indexed_files(directory) or {_WEIGHTS})
    files = [directory / name for name in names if (directory / name).is_file()]
    checks = [partial(checksum.verify_safetensors, file) for file in files]
    checksum.verify_split(checks, collective)


class Booster:
    """``Booster(plugin=..., mixed_precision="fp16" | "bf16" | None)``.

    The default plugin is :class:`~pc_booster.TorchDDPPlugin`.
    ``mixed_precision`` is implemented by the plugin: ZeRO and Gemini keep
    fp32 masters (fp16 with a dynamic loss scale), FSDP casts parameters in
    forward; a plugin that cannot do the asked precision refuses it here.
    Left None, a run trains in the dtype its model was built in
    (``pc_booster.rules``' [Note: model dtype]).
    """

    def __init__(
        self, plugin: Plugin | None = None, mixed_precision: Precision | str = None
    ) -> None:
        if mixed_precision not in (None, "fp32", "fp16", "bf16"):
            raise ValueError(
                f"mixed_precision must be 'fp16', 'bf16', 'fp32' or None, got {mixed_precision!r}."
            )
        if plugin is None:
            from pc_booster.plugins import TorchDDPPlugin

            plugin = TorchDDPPlugin()
        if not isinstance(plugin, Plugin):
            raise TypeError(f"plugin must be a pc_booster Plugin, got {type(plugin).__name__}.")
        if mixed_precision is not None:  # the plugin's rules, at construction
            plugin.validate_later(precision=TrainPrecision.parse(mixed_precision))
        self.plugin = plugin
        self.mixed_precision: Precision | str = mixed_precision
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

    # -- training --------------------------------------------------------------

    def boost(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Any = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[Any, Any, Any, Any, Any]:
        """Wrap the objects for the plugin. Use what it returns from here on:
        plugins that shard parameters rebuild the optimizer over the shards
        (same class, hyperparameters and param groups), and the LR
        scheduler is re-pointed at it."""
        if not isinstance(model, nn.Module):
            raise TypeError(f"boost() takes an nn.Module, got {type(model).__name__}.")
        from pc_booster.wrappers import BoostedOptimizer

        boosted = self.plugin.boost(
            model, optimizer, criterion, dataloader, lr_scheduler, self.mixed_precision
        )
        wrapped = None
        if boosted.optimizer is not None:
            wrapped = BoostedOptimizer(boosted.optimizer, self.plugin, boosted.step_policy)
        # A scheduler built over the user's optimizer keeps it where that is
        # the optimizer that steps (its step patch then counts every applied
        # step); over one a plugin rebuilt, it is re-pointed at the wrapper,
        # whose param groups are the rebuilt optimizer's.
        if (
            lr_scheduler is not None
            and wrapped is not None
            and getattr(lr_scheduler, "optimizer", None) is not boosted.optimizer
        ):
            lr_scheduler.optimizer = wrapped
        return (
            boosted.model,
            wrapped,
            boosted.criterion,
            boosted.dataloader,
            boosted.lr_scheduler,
        )

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The model as it was built, behind what ``boost`` returned
        (tensor-parallel layers stay split, FSDP2 parameters stay DTensors:
        the module, not a gathered copy)."""
        return self.plugin.boosted(model).module

    def backward(self, loss: torch.Tensor, optimizer: Any) -> None:
        """``loss.backward()`` as the plugin needs it (loss scaling)."""
        from pc_booster.wrappers import BoostedOptimizer

        if isinstance(optimizer, BoostedOptimizer):
            optimizer.backward(loss)
        else:
            self.plugin.backward(loss, optimizer)

    def no_sync(
        self, model: nn.Module | None = None, optimizer: Any = None
    ) -> AbstractContextManager[None]:
        """Accumulate gradients without synchronising them."""
        if not isinstance(self.plugin, SupportsNoSync):
            raise ValueError(f"{type(self.plugin).__name__} does not support no_sync.")
        return self.plugin.no_sync(model, inner_optimizer(optimizer))  # type: ignore[arg-type]

    def execute_pipeline(
        self,
        data_iter: Iterator[Any],
        model: nn.Module,
        criterion: Any,
        optimizer: Any = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        if not isinstance(self.plugin, SupportsPipeline):
            raise ValueError(
                f"{type(self.plugin).__name__} does not run pipelines; execute_pipeline needs "
                "a plugin with pipeline parallelism."
            )
        return self.plugin.execute_pipeline(
            data_iter, model, criterion, inner_optimizer(optimizer), return_loss, return_outputs
        )

    # -- checkpoints -----------------------------------------------------------

    def save_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int | None = None,
        use_safetensors: bool | None = None,
        use_async: bool = False,
    ) -> Future[None] | None:
        """Write the model (collective: every rank calls it) [Note: checkpoint
        forms]:

        - ``shard=False`` and ``checkpoint`` a file name (``.pt``, ``.pth``,
          ``.bin``, ``.ckpt``, ``.safetensors``): one file that rank 0 writes
          after every rank gathered the whole model, for ``torch.load`` or
          :meth:`load_model`; ``torch.save`` of the state dict, or
          safetensors with ``use_safetensors=True`` or the ``.safetensors``
          suffix. Any other path: a directory with ``model.safetensors`` and
          ``config.json`` (what ``from_pretrained`` reads). Both hold the
          whole model: a convenience for models that fit on one rank.
        - ``shard=True``: every rank writes only its share, through
          ``torch.distributed.checkpoint`` ([Note: sharded canonical state]
          in ``pc_booster.plugins.sharded``); no rank holds the whole model.
          ``size_per_shard`` (MiB) splits each rank's share over files of
          about that size. With ``use_safetensors=True``: transformers'
          safetensors files of at most ``size_per_shard`` MiB with their
          index, streamed as :meth:`export_pretrained` does.

        ``gather_dtensor``: the single-file forms hold full tensors (True);
        ``shard=True`` never gathers. ``prefix`` is refused: pc names the
        files as DCP or transformers do.

        ``use_async=True`` (DCP form only): returns at once; the copy of
        this rank's share to host memory is made during the next forward and
        backward (the next optimizer step waits for it) and the write goes
        on in the background while training continues [Note: async saves].
        Returns a future that is done when the checkpoint is
        (:meth:`wait_for_saves` waits for all; call it before destroying
        the process group)."""
        out = Path(checkpoint)
        _refuse_prefix(prefix)
        if not shard:
            # [Note: single-file arguments]: size_per_shard and use_async
            # have no effect on one file, which is written before this returns.
            if not gather_dtensor:
                raise ValueError(
                    "gather_dtensor=False with shard=False: the single-file form holds full "
                    "tensors; shard=True writes each rank's share without gathering."
                )
            if _is_file_name(out):
                self._save_file(model, out, use_safetensors)
            elif use_safetensors is False:
                raise ValueError(
                    f"{out} names a directory, which pc writes as model.safetensors (what "
                    "from_pretrained reads); use_safetensors=False asks for a torch.save file: "
                    "give a file name ending in .pt or .bin."
                )
            else:
                self._save_full(model, out)
            return _done() if use_async else None
        if use_safetensors:
            if use_async:
                raise ValueError(
                    "use_async=True with use_safetensors=True: the transformers form is "
                    "streamed from a sharded save; save asynchronously with shard=True alone "
                    "and convert later with pc-export."
                )
            self.export_pretrained(model, out, size_per_shard or 1024)
            return None

        def tidy() -> None:  # rank 0, after the save: what a sharded save replaces
            old = indexed_files(out)
            (out / _INDEX).unlink(missing_ok=True)
            _remove(out, old | {_WEIGHTS})
            self._write_config(model, out)

        state = self.plugin.sharded_model_state(model)
        changing = [*model.buffers(), *self.plugin.boosted(model).module.buffers()]
        return self._write_sharded(
            state, out, tidy, use_async, "model", changing, _files(state, size_per_shard)
        )

    def _save_file(self, model: nn.Module, out: Path, use_safetensors: bool | None) -> None:
        """The whole model in one file that rank 0 writes (every rank gathers it)."""
        state = _distinct(self.plugin.model_state_dict(model))
        if dist.get_rank() == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
            as_safetensors = use_safetensors or (
                use_safetensors is None and out.suffix == ".safetensors"
            )
            if as_safetensors:
                from safetensors.torch import save_file

                _atomic(out, lambda p: save_file(state, str(p), metadata=_with_checksums(state)))
            else:
                _atomic(out, lambda p: torch.save(state, p))
        dist.barrier()

    def export_pretrained(
        self, model: nn.Module, directory: str | os.PathLike[str], size_per_shard: int = 1024
    ) -> None:
        """Write the model as ``transformers``' ``save_pretrained`` does:
        safetensors files of at most ``size_per_shard`` MiB (fp32, the true
        values), the index and ``config.json``, for ``from_pretrained``
        (collective). No rank gathers the model [Note: streamed export in
        ``pc_booster.export``]: every rank saves its share as a sharded
        checkpoint in ``directory/.pc-export``, then writes its part of the
        output files one tensor at a time; rank 0 writes the index last and
        removes the staging checkpoint."""
        from pc_booster.export import export_files, plan_export, shard_names, write_index

        out = Path(directory)
        staging = out / ".pc-export"
        self.save_model(model, staging, shard=True)
        plan = plan_export(staging, size_per_shard)
        names = [shard_names(out, len(plan.files)) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(names, src=0)  # a fresh token is drawn on rank 0
        rank, world = dist.get_rank(), dist.get_world_size()
        export_files(staging, out, plan, names[0], rank, world, atomic=_atomic)  # type: ignore[arg-type]
        dist.barrier()
        if rank == 0:
            (out / _DCP_METADATA).unlink(missing_ok=True)  # a sharded save's commit point
            (out / checksum.CHECKSUMS).unlink(missing_ok=True)  # and its checksums
            write_index(out, plan, names[0], atomic=_atomic, remove=_remove)  # type: ignore[arg-type]
            self._write_config(model, out)
            shutil.rmtree(staging, ignore_errors=True)
        dist.barrier()

    def _write_config(self, model: nn.Module, out: Path) -> None:
        module = self.plugin.boosted(model).module
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_json_file"):
            _atomic(out / "config.json", lambda p: config.to_json_file(str(p)))

    @staticmethod
    def _save_sharded(
        state: dict[str, Any], out: Path, group: dist.ProcessGroup | None = None, files: int = 1
    ) -> None:
        """DCP writes every rank's items in parallel and the metadata last
        (the commit point); each rank's items go into ``files`` files of
        about equal size."""
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        from pc_zero import PiecesSavePlanner

        out.mkdir(parents=True, exist_ok=True)
        rank = dist.get_rank(group)
        if rank == 0:  # the old sums go before any file they describe is replaced
            (out / checksum.CHECKSUMS).unlink(missing_ok=True)
        with _named_failures(f"the sharded save to {out}"):
            planner = PiecesSavePlanner(flatten_state_dict=False)
            writer = FileSystemWriter(str(out), thread_count=files)
            metadata = save(state, storage_writer=writer, planner=planner, process_group=group)
        # DCP names rank r's files __r_<k>.distcp; each rank hashes its own.
        own = {info.relative_path for info in (metadata.storage_data or {}).values()}
        checksum.write_sidecar(out, sorted(p for p in own if p.startswith(f"__{rank}_")), group)

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

    def _write_sharded(
        self,
        state: dict[str, Any],
        out: Path,
        tidy: Any,
        use_async: bool,
        kind: str,
        changing: Iterable[torch.Tensor] = (),
        files: int = 1,
    ) -> Future[None] | None:
        """Save ``state`` to ``out``, then ``tidy()`` on rank 0 (collective),
        now or in the background (``kind``: which host copies to reuse;
        ``changing``: tensors training changes outside optimizer steps)."""
        if not use_async:
            self._save_sharded(state, out, files=files)
            if dist.get_rank() == 0:
                tidy()
            dist.barrier()
            return None
        from pc_booster.plugins import sharded

        kept = sharded.held(state, changing)
        if self._writer is None:
            self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pc-stage")
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pc-save")
            self._save_group = dist.new_group(backend="gloo")
            _fence_steps(self)
        assert self._stager is not None
        group, previous = self._save_group, self._staged_by.get(kind)
        buffers = self._staging.setdefault(kind, {})

        def stage() -> dict[str, Any]:
            if previous is not None:  # its copy is written: the buffers are free again
                wait([previous])
            return sharded.staged(kept, buffers)

        copying = self._stager.submit(stage)

        def write() -> None:
            self._save_sharded(copying.result(), out, group, files)
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

    @staticmethod
    def _saved_keys(path: Path) -> dict[str, Any]:
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        metadata: dict[str, Any] = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return metadata

    @staticmethod
    def _load_sharded(state: dict[str, Any], path: Path) -> None:
        from torch.distributed.checkpoint.state_dict_loader import load

        from pc_zero import PiecesLoadPlanner

        with _named_failures(f"checkpoint {path} does not load"):
            load(
                state, checkpoint_id=str(path), planner=PiecesLoadPlanner(flatten_state_dict=False)
            )

    def _save_full(self, model: nn.Module, out: Path) -> None:
        from safetensors.torch import save_file

        state = _distinct(self.plugin.model_state_dict(model))
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / _DCP_METADATA).unlink(missing_ok=True)  # a sharded save's commit point
            (out / checksum.CHECKSUMS).unlink(missing_ok=True)  # and its checksums
            old = indexed_files(out)
            _atomic(out / _WEIGHTS, lambda p: save_file(state, str(p), _with_checksums(state)))
            (out / _INDEX).unlink(missing_ok=True)  # first: the index points at the rest
            _remove(out, old)
            self._write_config(model, out)
        dist.barrier()

    def load_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        strict: bool = True,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """Load what :meth:`save_model` or :meth:`export_pretrained` wrote
        (under any plugin and world size), or a ``transformers``
        ``save_pretrained`` directory. From a directory each rank reads only
        the byte ranges of its share (safetensors are read by slices); a
        single file is mapped into memory and each rank copies its share.
        ``model``: one ``boost`` returned, or a model that was not boosted
        (it then loads the whole state). ``low_cpu_mem_mode``: pc always
        reads this way, so both values load the same; ``num_threads``: 1
        (one reader per rank)."""
        if num_threads != 1:
            raise ValueError(
                f"load_model: num_threads={num_threads}; pc reads with one thread per rank, "
                "each rank its own share in parallel. Pass num_threads=1."
            )
        self.wait_for_saves()
        path = Path(checkpoint)
        if not self.plugin.has_boosted(model):
            self._load_unboosted(model, path, strict)
            return
        if path.is_file():
            self.plugin.load_model_state_dict(model, _read_file(path))
            return
        if (path / _DCP_METADATA).exists():
            checksum.verify_sidecar(path, collective=True)
            self._load_model_sharded(model, path, strict, pretrained=False)
        elif any(path.glob("*.safetensors")):
            _verify_safetensors_files(path, collective=True)
            self._load_model_sharded(model, path, strict, pretrained=True)
        else:
            raise FileNotFoundError(
                f"no model checkpoint in {path}: expected a sharded checkpoint (.metadata), "
                f"{_WEIGHTS} or {_INDEX} (written by Booster.save_model, export_pretrained "
                "or save_pretrained)."
            )

    def _load_model_sharded(
        self, model: nn.Module, path: Path, strict: bool, *, pretrained: bool
    ) -> None:
        """Each rank reads only the byte ranges of its share, from a sharded
        checkpoint (keys ``model/<name>``) or safetensors files (keys
        ``<name>``, in any dtype; a tied weight may be saved once)."""
        from torch.distributed.checkpoint.state_dict_loader import load

        from pc_booster.export import pretrained_reader
        from pc_booster.plugins.sharded import canonical_model_keys, model_key
        from pc_zero import PiecesLoadPlanner

        module = self.plugin.boosted(model).module
        targets = self.plugin.sharded_model_state(model, loading=True)
        expected = canonical_model_keys(module)
        reader: Any = pretrained_reader(path) if pretrained else None
        if pretrained:
            present = {model_key(k) for k in reader.read_metadata().state_dict_metadata}
        else:
            present = set(self._saved_keys(path))
        names = {k.removeprefix("model/") for k in present}

        def alias(key: str, among: set[str]) -> str:
            """``key``, or the name of a weight tied to it that ``among`` has."""
            return model_key(self._tied_source(module, key.removeprefix("model/"), among))

        # A tied weight is read from whichever of its names was saved.
        source = {k: alias(k, names) for k in expected if k not in present}
        source = {k: v for k, v in source.items() if v in present}
        missing = sorted(k for k in expected if k not in present and k not in source)
        known = {k.removeprefix("model/") for k in expected}
        unexpected = sorted(
            k
            for k in present
            if k.startswith("model/") and k not in expected and alias(k, known) not in expected
        )
        if strict and (missing or unexpected):
            raise ValueError(
                f"checkpoint {path} does not match the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}. Was it saved from another model? Pass "
                "strict=False to load the common keys."
            )
        wanted = {source.get(k, k): v for k, v in targets.items() if source.get(k, k) in present}
        if pretrained:
            wanted = {k.removeprefix("model/"): v for k, v in wanted.items()}
            with _named_failures(f"checkpoint {path} does not load"):
                planner = PiecesLoadPlanner(flatten_state_dict=False)
                load(wanted, storage_reader=reader, planner=planner)
        else:
            self._load_sharded(wanted, path)
        self.plugin.after_sharded_model_load(model)

    def _load_unboosted(self, model: nn.Module, path: Path, strict: bool) -> None:
        """Load into a model that was not boosted: the whole state, on every rank."""
        if path.is_file():
            state = _read_file(path)
        elif (path / _DCP_METADATA).exists() or any(path.glob("*.safetensors")):
            from torch.distributed.checkpoint.state_dict_loader import load

            from pc_booster.export import pretrained_reader

            own = model.state_dict()
            pretrained = not (path / _DCP_METADATA).exists()
            if pretrained:
                _verify_safetensors_files(path, collective=False)
            else:
                checksum.verify_sidecar(path, collective=False)
            present = (
                pretrained_reader(path).read_metadata().state_dict_metadata
                if pretrained
                else self._saved_keys(path)
            )
            prefix = "" if pretrained else "model/"
            # A weight tied to another is saved once, under either name.
            names = {k.removeprefix(prefix) for k in present}
            source = {k: k if k in names else self._tied_source(model, k, names) for k in own}
            state = {
                k: torch.empty_like(v, device="cpu")
                for k, v in own.items()
                if f"{prefix}{k}" in present and source[k] == k
            }
            wanted = {f"{prefix}{k}": v for k, v in state.items()}
            with _named_failures(f"checkpoint {path} does not load"):
                if pretrained:
                    load(wanted, storage_reader=pretrained_reader(path), no_dist=True)
                else:
                    load(wanted, checkpoint_id=str(path), no_dist=True)
            state.update({k: state[v] for k, v in source.items() if k != v and v in state})
        else:
            raise FileNotFoundError(
                f"no model checkpoint at {path}: expected a file, a sharded checkpoint "
                f"(.metadata), {_WEIGHTS} or {_INDEX}."
            )
        model.load_state_dict(state, strict=strict)

    @staticmethod
    def _tied_source(module: nn.Module, key: str, present: Any = ()) -> str:
        """A key holding the same tensor as ``key`` (tied weights), one in
        ``present`` when there is one."""
        state = module.state_dict(keep_vars=True)
        target = state.get(key)
        aliases = [other for other, value in state.items() if value is target and other != key]
        for other in aliases:
            if other in present:
                return other
        return aliases[0] if aliases else key

    def save_optimizer(
        self,
        optimizer: Any,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int | None = None,
        use_async: bool = False,
    ) -> Future[None] | None:
        """Write the optimizer's state (canonical form) to ``checkpoint``
        (collective). ``shard=True``: a directory to which every rank writes
        only its share of the state, through ``torch.distributed.checkpoint``
        (``size_per_shard``: files of about that many MiB per rank); else
        one file that rank 0 writes after every rank gathered the whole
        state (for optimizers that fit on one rank several times over).
        ``gather_dtensor``, ``prefix``, ``use_async``: as for
        :meth:`save_model`."""
        optimizer = inner_optimizer(optimizer)
        _refuse_prefix(prefix)
        if shard:
            state = self.plugin.sharded_optimizer_state(optimizer, None)
            return self._write_sharded(
                state,
                Path(checkpoint),
                lambda: None,
                use_async,
                "optimizer",
                files=_files(state, size_per_shard),
            )
        if not gather_dtensor:
            raise ValueError(
                "gather_dtensor=False with shard=False: the single-file form holds the full "
                "state; shard=True writes each rank's share without gathering."
            )
        # [Note: single-file arguments]
        state = self.plugin.optimizer_state_dict(optimizer)
        if dist.get_rank() == 0:
            path = Path(checkpoint)
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic(path, lambda p: torch.save(state, p))
        dist.barrier()
        return _done() if use_async else None

    def load_optimizer(
        self,
        optimizer: Any,
        checkpoint: str | os.PathLike[str],
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """Load a file written by :meth:`save_optimizer`, under any plugin
        and world size (a directory: the sharded form, each rank reading only
        its share). Load the model first. ``low_cpu_mem_mode`` /
        ``num_threads``: as for :meth:`load_model`."""
        optimizer = inner_optimizer(optimizer)
        if num_threads != 1:
            raise ValueError(
                f"load_optimizer: num_threads={num_threads}; pc reads with one thread per "
                "rank, each rank its own share in parallel. Pass num_threads=1."
            )
        self.wait_for_saves()
        path = Path(checkpoint)
        if (path / _DCP_METADATA).exists():
            from pc_booster.plugins.sharded import saved_state_keys

            checksum.verify_sidecar(path, collective=True)
            saved = self._saved_keys(path)
            targets = self.plugin.sharded_optimizer_state(optimizer, saved_state_keys(saved))
            loaded = {k: v for k, v in targets.items() if k in saved}
            self._load_sharded(loaded, path)
            self.plugin.after_sharded_optimizer_load(optimizer, loaded)
            return
        state = torch.load(Path(checkpoint), map_location="cpu", weights_only=False)
        if not isinstance(state, dict) or "param_groups" not in state:
            raise ValueError(
                f"{checkpoint} is not an optimizer checkpoint of Booster.save_optimizer."
            )
        self.plugin.load_optimizer_state_dict(optimizer, state)

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        if dist.get_rank() == 0:
            path = Path(checkpoint)
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic(path, lambda p: torch.save(lr_scheduler.state_dict(), p))
        dist.barrier()

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        lr_scheduler.load_state_dict(torch.load(Path(checkpoint), weights_only=False))
