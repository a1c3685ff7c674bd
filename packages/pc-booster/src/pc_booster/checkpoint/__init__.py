"""Checkpoints of a boosted model, optimizer and LR scheduler that any other
plugin, at any world size and tp / pp layout, can load. Each is written so
that a save killed at any moment leaves the previous checkpoint loadable and
the new one complete or absent ([Note: sharded saves] in :mod:`.files`):

- ``save_model(..., shard=True)`` / ``save_optimizer(..., shard=True)``:
  a ``torch.distributed.checkpoint`` directory to which every rank writes
  only its share; loads read only each rank's byte ranges. No rank holds
  the whole model or optimizer state. ``use_async=True`` writes it in the
  background (:mod:`.async_saves`).
- ``export_pretrained``: ``transformers``' layout (safetensors files of at
  most ``size_per_shard`` MiB, ``model.safetensors.index.json``,
  ``config.json``), streamed from a sharded save one tensor at a time
  (:mod:`.export`).
- ``shard=False``: one ``model.safetensors`` / ``optimizer.pt`` that rank 0
  writes after every rank gathered the whole state: a convenience for
  models that fit on one rank several times over.
- LR scheduler: its ``state_dict`` through ``torch.save``.

``load_model`` reads any of them, and a ``save_pretrained`` directory, by
slices of each rank's share; every file is checked against the checksums
written beside it (:mod:`.checksum`).

Modules: :mod:`.io` (``CheckpointIO``, what ``Booster`` delegates to),
:mod:`.files` (names, forms, DCP save and load of one state),
:mod:`.async_saves`, :mod:`.export`, :mod:`.checksum`, :mod:`.disk` (a failed
write named: path, operation, cause and bytes, [Note: disk errors named]).
"""

from pc_booster.checkpoint.disk import DiskWriteError, named_disk_errors
from pc_booster.checkpoint.io import CheckpointIO
from pc_zero import UnsafeCheckpointError, refuse_weights_only

__all__ = [
    "CheckpointIO",
    "DiskWriteError",
    "UnsafeCheckpointError",
    "named_disk_errors",
    "refuse_weights_only",
]
