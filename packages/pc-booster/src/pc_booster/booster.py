"""``Booster``: one object that wraps a model, optimizer, criterion,
dataloader and LR scheduler for a plugin's parallel strategy, runs the
backward pass the strategy needs, and saves and loads checkpoints that any
other plugin, at any world size, can load.

Checkpoint files (written by rank 0, atomically: a temporary name, then a
rename; a save killed at any moment leaves the previous checkpoint loadable
and the new one complete or absent, see [Note: sharded saves]):

- model: ``safetensors`` of the full state dict under the unwrapped
  model's keys; with ``shard=True`` several files of at most
  ``size_per_shard`` MiB plus ``model.safetensors.index.json``, the layout
  ``transformers`` reads; a ``transformers`` model also gets its
  ``config.json``, so ``from_pretrained(directory)`` loads it;
- optimizer: the canonical form (state per parameter name, full tensors)
  through ``torch.save``;
- LR scheduler: its ``state_dict`` through ``torch.save``.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pc_booster.plugin import Plugin, Precision, SupportsNoSync, SupportsPipeline
from pc_booster.rules import TrainPrecision

__all__ = ["Booster"]

_WEIGHTS = "model.safetensors"
_INDEX = "model.safetensors.index.json"
_DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's commit point


def _atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


# [Note: sharded saves]
# The index is the commit point of a sharded model. New shards never take a
# name the current index uses (they get a fresh token when the plain names
# are taken), the index is replaced last, and only then are the files only
# the old index named removed. A save killed before the index is replaced
# leaves the old index and all its shards; after, the new ones. The single
# file model.safetensors is replaced in one rename; a stale index next to it
# (load_model prefers an index) is removed after that rename.


def _indexed_files(out: Path) -> set[str]:
    try:
        return set(json.loads((out / _INDEX).read_text())["weight_map"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _shard_names(out: Path, count: int) -> list[str]:
    def names(prefix: str) -> list[str]:
        return [f"{prefix}{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]

    plain = names("model-")
    if not any((out / name).exists() for name in plain):
        return plain
    return names(f"model-{uuid.uuid4().hex[:8]}-")


def _remove(out: Path, names: set[str]) -> None:
    for name in names:
        (out / name).unlink(missing_ok=True)


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
        boosted = self.plugin.boost(
            model, optimizer, criterion, dataloader, lr_scheduler, self.mixed_precision
        )
        if lr_scheduler is not None and boosted.optimizer is not None:
            lr_scheduler.optimizer = boosted.optimizer
        return (
            boosted.model,
            boosted.optimizer,
            boosted.criterion,
            boosted.dataloader,
            boosted.lr_scheduler,
        )

    def backward(self, loss: torch.Tensor, optimizer: Any) -> None:
        """``loss.backward()`` as the plugin needs it (loss scaling)."""
        self.plugin.backward(loss, optimizer)

    def no_sync(
        self, model: nn.Module | None = None, optimizer: Any = None
    ) -> AbstractContextManager[None]:
        """Accumulate gradients without synchronising them."""
        if not isinstance(self.plugin, SupportsNoSync):
            raise ValueError(f"{type(self.plugin).__name__} does not support no_sync.")
        return self.plugin.no_sync(model, optimizer)  # type: ignore[arg-type]

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
            data_iter, model, criterion, optimizer, return_loss, return_outputs
        )

    # -- checkpoints -----------------------------------------------------------

    def save_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        size_per_shard: int = 1024,
    ) -> None:
        """Write the model to directory ``checkpoint`` (collective: every rank
        calls it). ``shard=True``: every rank writes only its share, through
        ``torch.distributed.checkpoint`` ([Note: sharded canonical state] in
        ``pc_booster.plugins.sharded``); no rank holds the whole model. Else
        rank 0 writes ``model.safetensors`` with the full model, which every
        rank gathers first: a convenience for models that fit on one rank
        several times over. ``size_per_shard`` applies to
        :meth:`export_pretrained`."""
        if shard:
            self._save_sharded(self.plugin.sharded_model_state(model), Path(checkpoint))
            if dist.get_rank() == 0:
                old = _indexed_files(Path(checkpoint))
                (Path(checkpoint) / _INDEX).unlink(missing_ok=True)
                _remove(Path(checkpoint), old | {_WEIGHTS})
                self._write_config(model, Path(checkpoint))
            dist.barrier()
            return
        self._save_full(model, Path(checkpoint), split=False, size_per_shard=size_per_shard)

    def export_pretrained(
        self, model: nn.Module, directory: str | os.PathLike[str], size_per_shard: int = 1024
    ) -> None:
        """Write the full model as ``transformers``' ``save_pretrained`` does:
        safetensors files of at most ``size_per_shard`` MiB, the index and
        ``config.json``, for ``from_pretrained``. Every rank gathers the whole
        fp32 model first (collective; rank 0 writes)."""
        self._save_full(model, Path(directory), split=True, size_per_shard=size_per_shard)

    def _write_config(self, model: nn.Module, out: Path) -> None:
        module = self.plugin.boosted(model).module
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "to_json_file"):
            _atomic(out / "config.json", lambda p: config.to_json_file(str(p)))

    @staticmethod
    def _save_sharded(state: dict[str, Any], out: Path) -> None:
        """DCP writes every rank's items in parallel and the metadata last
        (the commit point)."""
        from torch.distributed.checkpoint.state_dict_saver import save

        from pc_zero import PiecesSavePlanner

        out.mkdir(parents=True, exist_ok=True)
        save(state, checkpoint_id=str(out), planner=PiecesSavePlanner(flatten_state_dict=False))

    @staticmethod
    def _saved_keys(path: Path) -> dict[str, Any]:
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        metadata: dict[str, Any] = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return metadata

    @staticmethod
    def _load_sharded(state: dict[str, Any], path: Path) -> None:
        from torch.distributed.checkpoint.state_dict_loader import load

        from pc_zero import PiecesLoadPlanner

        load(state, checkpoint_id=str(path), planner=PiecesLoadPlanner(flatten_state_dict=False))

    def _save_full(self, model: nn.Module, out: Path, *, split: bool, size_per_shard: int) -> None:
        from safetensors.torch import save_file

        state = _distinct(self.plugin.model_state_dict(model))
        if dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / _DCP_METADATA).unlink(missing_ok=True)  # a sharded save's commit point
            shard = split
            if shard:
                limit = size_per_shard * 2**20
                files: list[dict[str, torch.Tensor]] = [{}]
                used = 0
                for key, value in state.items():
                    size = value.numel() * value.element_size()
                    if files[-1] and used + size > limit:
                        files.append({})
                        used = 0
                    files[-1][key] = value
                    used += size
                old = _indexed_files(out)
                weight_map = {}
                for name, part in zip(_shard_names(out, len(files)), files, strict=True):
                    _atomic(out / name, lambda p, part=part: save_file(part, str(p)))
                    weight_map.update(dict.fromkeys(part, name))
                total = sum(v.numel() * v.element_size() for v in state.values())
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                _atomic(out / _INDEX, lambda p: p.write_text(json.dumps(index, indent=2)))
                _remove(out, (old - set(weight_map.values())) | {_WEIGHTS})
            else:
                old = _indexed_files(out)
                _atomic(out / _WEIGHTS, lambda p: save_file(state, str(p)))
                (out / _INDEX).unlink(missing_ok=True)  # first: the index points at the rest
                _remove(out, old)
            self._write_config(model, out)
        dist.barrier()

    def load_model(
        self, model: nn.Module, checkpoint: str | os.PathLike[str], strict: bool = True
    ) -> None:
        """Load a directory written by :meth:`save_model` (under any plugin
        and world size), or a ``transformers`` ``save_pretrained`` one."""
        from safetensors.torch import load_file

        path = Path(checkpoint)
        if (path / _DCP_METADATA).exists():
            self._load_model_sharded(model, path, strict)
            return
        if (path / _INDEX).exists():
            index = json.loads((path / _INDEX).read_text())
            state: dict[str, torch.Tensor] = {}
            for name in sorted(set(index["weight_map"].values())):
                state.update(load_file(str(path / name)))
        elif (path / _WEIGHTS).exists():
            state = load_file(str(path / _WEIGHTS))
        else:
            raise FileNotFoundError(
                f"no model checkpoint in {path}: expected {_WEIGHTS} or {_INDEX} "
                "(written by Booster.save_model or save_pretrained)."
            )
        module = self.plugin.boosted(model).module
        expected = set(module.state_dict())
        missing, unexpected = expected - set(state), set(state) - expected
        # A tied weight may be saved once (transformers drops the copy).
        sources = {k: self._tied_source(module, k, state) for k in missing}
        tied = {k for k, source in sources.items() if source in state}
        for key in tied:
            state[key] = state[sources[key]]
        missing -= tied
        if strict and (missing or unexpected):
            raise ValueError(
                f"checkpoint {path} does not match the model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}. Was it saved from another model? "
                "Pass strict=False to load the common keys."
            )
        if not strict and missing:
            # The keys the checkpoint lacks keep their current (full) values.
            current = self.plugin.model_state_dict(model)
            state = {**current, **{k: v for k, v in state.items() if k in current}}
        elif not strict:
            state = {k: v for k, v in state.items() if k in expected}
        self.plugin.load_model_state_dict(model, state)

    def _load_model_sharded(self, model: nn.Module, path: Path, strict: bool) -> None:
        """Each rank reads only the byte ranges of its share."""
        from pc_booster.plugins.sharded import canonical_model_keys

        targets = self.plugin.sharded_model_state(model, loading=True)
        saved = self._saved_keys(path)
        expected = canonical_model_keys(self.plugin.boosted(model).module)
        missing = sorted(k for k in expected if k not in saved)
        unexpected = sorted(k for k in saved if k.startswith("model/") and k not in expected)
        if strict and (missing or unexpected):
            raise ValueError(
                f"checkpoint {path} does not match the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}. Was it saved from another model? Pass "
                "strict=False to load the common keys."
            )
        self._load_sharded({k: v for k, v in targets.items() if k in saved}, path)
        self.plugin.after_sharded_model_load(model)

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
        self, optimizer: Any, checkpoint: str | os.PathLike[str], shard: bool = False
    ) -> None:
        """Write the optimizer's state (canonical form) to ``checkpoint``
        (collective). ``shard=True``: a directory to which every rank writes
        only its share of the state, through ``torch.distributed.checkpoint``;
        else one file that rank 0 writes after every rank gathered the whole
        state (for optimizers that fit on one rank several times over)."""
        if shard:
            state = self.plugin.sharded_optimizer_state(optimizer, None)
            self._save_sharded(state, Path(checkpoint))
            dist.barrier()
            return
        state = self.plugin.optimizer_state_dict(optimizer)
        if dist.get_rank() == 0:
            path = Path(checkpoint)
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic(path, lambda p: torch.save(state, p))
        dist.barrier()

    def load_optimizer(self, optimizer: Any, checkpoint: str | os.PathLike[str]) -> None:
        """Load a file written by :meth:`save_optimizer`, under any plugin
        and world size (a directory: the sharded form, each rank reading only
        its share). Load the model first."""
        path = Path(checkpoint)
        if (path / _DCP_METADATA).exists():
            from pc_booster.plugins.sharded import saved_state_keys

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
