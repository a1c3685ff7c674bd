"""Checkpoint I/O for a plugin: the model, optimizer and LR scheduler in
every form ``Booster`` offers (DCP's sharded directory, transformers'
layout, one file), loaded under any plugin and world size
[Note: checkpoint forms] [Note: sharded saves]."""

from __future__ import annotations

import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pc_booster.checkpoint import checksum, files
from pc_booster.checkpoint.async_saves import AsyncSaves
from pc_booster.checkpoint.export import indexed_files
from pc_booster.checkpoint.paths import own_directory, remove_tree
from pc_booster.plugin import Plugin
from pc_booster.wrappers import inner_optimizer

__all__ = ["CheckpointIO"]


class CheckpointIO:
    """The saves and loads of :class:`~pc_booster.Booster`, which delegates
    to this (``booster.checkpoints``)."""

    def __init__(self, plugin: Plugin) -> None:
        self.plugin = plugin
        self.saves = AsyncSaves()

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
        files.refuse_prefix(prefix)
        if not shard:
            # [Note: single-file arguments]: size_per_shard and use_async
            # have no effect on one file, which is written before this returns.
            self._save_whole(model, out, gather_dtensor, use_safetensors)
            return files.done() if use_async else None
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
            (out / files.INDEX).unlink(missing_ok=True)
            files.remove(out, old | {files.WEIGHTS})
            self._write_config(model, out)

        state = self.plugin.sharded_model_state(model)
        changing = [*model.buffers(), *self.plugin.boosted(model).module.buffers()]
        return self.saves.write(
            state, out, tidy, use_async, "model", changing, files.file_count(state, size_per_shard)
        )

    def _save_whole(
        self, model: nn.Module, out: Path, gather_dtensor: bool, use_safetensors: bool | None
    ) -> None:
        """``shard=False``: one file, or a directory with model.safetensors."""
        if not gather_dtensor:
            raise ValueError(
                "gather_dtensor=False with shard=False: the single-file form holds full "
                "tensors; shard=True writes each rank's share without gathering."
            )
        if files.is_file_name(out):
            self._save_file(model, out, use_safetensors)
        elif use_safetensors is False:
            raise ValueError(
                f"{out} names a directory, which pc writes as model.safetensors (what "
                "from_pretrained reads); use_safetensors=False asks for a torch.save file: "
                "give a file name ending in .pt or .bin."
            )
        else:
            self._save_full(model, out)

    def _save_file(self, model: nn.Module, out: Path, use_safetensors: bool | None) -> None:
        """The whole model in one file that rank 0 writes (every rank gathers it)."""
        state = files.distinct(self.plugin.model_state_dict(model))
        if dist.get_rank() == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
            as_safetensors = use_safetensors or (
                use_safetensors is None and out.suffix == ".safetensors"
            )
            if as_safetensors:
                from safetensors.torch import save_file

                files.atomic(
                    out, lambda p: save_file(state, str(p), metadata=files.with_checksums(state))
                )
            else:
                files.atomic(out, lambda p: torch.save(state, p))
        dist.barrier()

    def export_pretrained(
        self, model: nn.Module, directory: str | os.PathLike[str], size_per_shard: int = 1024
    ) -> None:
        """Write the model as ``transformers``' ``save_pretrained`` does:
        safetensors files of at most ``size_per_shard`` MiB (fp32, the true
        values), the index and ``config.json``, for ``from_pretrained``
        (collective). No rank gathers the model [Note: streamed export in
        ``pc_booster.checkpoint.export``]: every rank saves its share as a sharded
        checkpoint in ``directory/.pc-export``, then writes its part of the
        output files one tensor at a time; rank 0 writes the index last and
        removes the staging checkpoint."""
        from pc_booster.checkpoint.export import (
            export_files,
            plan_export,
            remove_orphans,
            shard_names,
            write_index,
        )

        out = Path(directory)
        staging = out / ".pc-export"
        if dist.get_rank() == 0:  # pc's own: a link there is removed, not written through
            own_directory(staging, replace=True)
        dist.barrier()
        self.save_model(model, staging, shard=True)
        plan = plan_export(staging, size_per_shard)
        if dist.get_rank() == 0:  # what an export killed midway left here
            remove_orphans(out)
        names = [shard_names(out, len(plan.files)) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(names, src=0)  # a fresh token is drawn on rank 0
        rank, world = dist.get_rank(), dist.get_world_size()
        export_files(staging, out, plan, names[0], rank, world, atomic=files.atomic)  # type: ignore[arg-type]
        dist.barrier()
        if rank == 0:
            (out / files.DCP_METADATA).unlink(missing_ok=True)  # a sharded save's commit point
            (out / checksum.CHECKSUMS).unlink(missing_ok=True)  # and its checksums
            write_index(out, plan, names[0], atomic=files.atomic, remove=files.remove)  # type: ignore[arg-type]
            self._write_config(model, out)
            remove_tree(staging)
        dist.barrier()

    def _write_config(self, model: nn.Module, out: Path) -> None:
        module = self.plugin.boosted(model).module
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_json_file"):
            files.atomic(out / "config.json", lambda p: config.to_json_file(str(p)))

    def _save_full(self, model: nn.Module, out: Path) -> None:
        from safetensors.torch import save_file

        state = files.distinct(self.plugin.model_state_dict(model))
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / files.DCP_METADATA).unlink(missing_ok=True)  # a sharded save's commit point
            (out / checksum.CHECKSUMS).unlink(missing_ok=True)  # and its checksums
            old = indexed_files(out)
            files.atomic(
                out / files.WEIGHTS, lambda p: save_file(state, str(p), files.with_checksums(state))
            )
            (out / files.INDEX).unlink(missing_ok=True)  # first: the index points at the rest
            files.remove(out, old - {files.WEIGHTS})  # never the file just written
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
        files.one_reader("load_model", num_threads)
        self.saves.wait_for_saves()
        path = Path(checkpoint)
        if not self.plugin.has_boosted(model):
            self._load_unboosted(model, path, strict)
            return
        if path.is_file():
            self.plugin.load_model_state_dict(model, files.read_file(path))
            return
        if (path / files.DCP_METADATA).exists():
            checksum.verify_sidecar(path, collective=True)
            self._load_model_sharded(model, path, strict, pretrained=False)
        elif any(path.glob("*.safetensors")):
            files.verify_safetensors_files(path, collective=True)
            self._load_model_sharded(model, path, strict, pretrained=True)
        else:
            raise FileNotFoundError(
                f"no model checkpoint in {path}: expected a sharded checkpoint (.metadata), "
                f"{files.WEIGHTS} or {files.INDEX} (written by Booster.save_model, "
                "export_pretrained or save_pretrained)."
            )

    def _load_model_sharded(
        self, model: nn.Module, path: Path, strict: bool, *, pretrained: bool
    ) -> None:
        """Each rank reads only the byte ranges of its share, from a sharded
        checkpoint (keys ``model/<name>``) or safetensors files (keys
        ``<name>``, in any dtype; a tied weight may be saved once)."""
        from torch.distributed.checkpoint.state_dict_loader import load

        from pc_booster.checkpoint.export import pretrained_reader
        from pc_booster.plugins.sharded import canonical_model_keys, model_key
        from pc_zero import PiecesLoadPlanner

        module = self.plugin.boosted(model).module
        targets = self.plugin.sharded_model_state(model, loading=True)
        expected = canonical_model_keys(module)
        reader: Any = pretrained_reader(path) if pretrained else None
        if pretrained:
            present = {model_key(k) for k in reader.read_metadata().state_dict_metadata}
        else:
            present = set(files.saved_keys(path))
        names = {k.removeprefix("model/") for k in present}

        def alias(key: str, among: set[str]) -> str:
            """``key``, or the name of a weight tied to it that ``among`` has."""
            return model_key(files.tied_source(module, key.removeprefix("model/"), among))

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
            with files.named_failures(f"checkpoint {path} does not load"):
                planner = PiecesLoadPlanner(flatten_state_dict=False)
                load(wanted, storage_reader=reader, planner=planner)
        else:
            files.load_sharded(wanted, path)
        self.plugin.after_sharded_model_load(model)

    def _load_unboosted(self, model: nn.Module, path: Path, strict: bool) -> None:
        """Load into a model that was not boosted: the whole state, on every rank."""
        if path.is_file():
            state = files.read_file(path)
        elif (path / files.DCP_METADATA).exists() or any(path.glob("*.safetensors")):
            from torch.distributed.checkpoint.state_dict_loader import load

            from pc_booster.checkpoint.export import pretrained_reader
            from pc_zero import PiecesLoadPlanner, SafeFileSystemReader

            own = model.state_dict()
            pretrained = not (path / files.DCP_METADATA).exists()
            if pretrained:
                files.verify_safetensors_files(path, collective=False)
            else:
                checksum.verify_sidecar(path, collective=False)
            present = (
                pretrained_reader(path).read_metadata().state_dict_metadata
                if pretrained
                else files.saved_keys(path)
            )
            prefix = "" if pretrained else "model/"
            # A weight tied to another is saved once, under either name.
            names = {k.removeprefix(prefix) for k in present}
            source = {k: k if k in names else files.tied_source(model, k, names) for k in own}
            state = {
                k: torch.empty_like(v, device="cpu")
                for k, v in own.items()
                if f"{prefix}{k}" in present and source[k] == k
            }
            wanted = {f"{prefix}{k}": v for k, v in state.items()}
            reader = pretrained_reader(path) if pretrained else SafeFileSystemReader(str(path))
            with files.named_failures(f"checkpoint {path} does not load"):
                load(
                    wanted,
                    storage_reader=reader,
                    planner=PiecesLoadPlanner(flatten_state_dict=False),
                    no_dist=True,
                )
            state.update({k: state[v] for k, v in source.items() if k != v and v in state})
        else:
            raise FileNotFoundError(
                f"no model checkpoint at {path}: expected a file, a sharded checkpoint "
                f"(.metadata), {files.WEIGHTS} or {files.INDEX}."
            )
        model.load_state_dict(state, strict=strict)

    def save_optimizer(
        self,
        optimizer: Optimizer,
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
        files.refuse_prefix(prefix)
        if shard:
            state = self.plugin.sharded_optimizer_state(optimizer, None)
            return self.saves.write(
                state,
                Path(checkpoint),
                lambda: None,
                use_async,
                "optimizer",
                file_count=files.file_count(state, size_per_shard),
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
            files.atomic(path, lambda p: torch.save(state, p))
        dist.barrier()
        return files.done() if use_async else None

    def load_optimizer(
        self,
        optimizer: Optimizer,
        checkpoint: str | os.PathLike[str],
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> None:
        """Load a file written by :meth:`save_optimizer`, under any plugin
        and world size (a directory: the sharded form, each rank reading only
        its share). Load the model first. ``low_cpu_mem_mode`` /
        ``num_threads``: as for :meth:`load_model`."""
        optimizer = inner_optimizer(optimizer)
        files.one_reader("load_optimizer", num_threads)
        self.saves.wait_for_saves()
        path = Path(checkpoint)
        if (path / files.DCP_METADATA).exists():
            from pc_booster.plugins.sharded import saved_state_keys

            checksum.verify_sidecar(path, collective=True)
            saved = files.saved_keys(path)
            targets = self.plugin.sharded_optimizer_state(optimizer, saved_state_keys(saved))
            loaded = {k: v for k, v in targets.items() if k in saved}
            files.load_sharded(loaded, path)
            self.plugin.after_sharded_optimizer_load(optimizer, loaded)
            return
        state = torch.load(Path(checkpoint), map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or "param_groups" not in state:
            raise ValueError(
                f"{checkpoint} is not an optimizer checkpoint of Booster.save_optimizer."
            )
        self.plugin.load_optimizer_state_dict(optimizer, state)

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        if dist.get_rank() == 0:
            path = Path(checkpoint)
            path.parent.mkdir(parents=True, exist_ok=True)
            files.atomic(path, lambda p: torch.save(lr_scheduler.state_dict(), p))
        dist.barrier()

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        lr_scheduler.load_state_dict(torch.load(Path(checkpoint), weights_only=True))
