"""``pc-train``'s checkpoints: one directory per saved step,
``<output_dir>/checkpoints/step-000040/``, holding the model and the
optimizer as sharded checkpoints (``model/``, ``optimizer/``: every rank
writes only its share, and a resume under any plugin, world size or
layout reads only its own; ``pc-export`` turns ``model/`` into a
directory ``from_pretrained`` loads), ``scheduler.pt``, each rank's RNG
state and ``trainer_state.json`` (step, history, the settings, the size and
checksum of every file).

A save writes ``step-N.partial/`` and renames it to ``step-N`` once every
file is complete, so a run killed mid-save leaves the previous checkpoint
intact and the new one absent; leftovers are removed at the next save.
Before resuming, the sizes recorded in ``trainer_state.json`` and the
safetensors header are checked, so a truncated or foreign checkpoint is
refused with a clear message instead of failing deep inside a load.

[Note: checkpoint checksums]
Every file's CRC-32 (``pc_booster.checkpoint.checksum``) is recorded beside its size.
The large files are hashed by the ranks that wrote them, in parallel: the
Booster's sharded saves leave ``.checksums.json`` in ``model/`` and
``optimizer/``, which rank 0 copies into the trainer state at the commit
and hashes only the small files itself (scheduler, RNG states, DCP
metadata, the sidecars). The launcher's preflight (one process, before any
rank starts) verifies every file, streamed on several threads (exit code 2
on a mismatch); inside a rank (torchrun's, or ``train()`` called directly)
only the files no sidecar covers are verified, and the Booster's loads
verify the sidecars' files split over the ranks, so no rank reads the
whole model. Checkpoints of earlier versions (sizes only) load as before.
With ``PC_CHECKPOINT_KEY`` set, checkpoints are signed and checked for
tampering too ([Note: signed checkpoints] in ``pc_train.signing``).
"""

from __future__ import annotations

import json
import os
import random
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from pc_booster.checkpoint import named_disk_errors
from pc_booster.checkpoint.checksum import CHECKSUMS, file_checksums, read_sidecar
from pc_booster.checkpoint.paths import own_directory, refuse_link, remove_tree
from pc_train.commit import (
    STATE,
    CheckpointError,
    prune_checkpoints,
    step_dirs,
    step_of,
    verified_commit,
)
from pc_train.signing import (
    SignatureError,
    check_position,
    high_water_step,
    signing_key,
    verify_signed,
)

__all__ = [
    "CHECKPOINTS_LINK_FIX",
    "CheckpointError",
    "find_checkpoint",
    "has_checkpoint",
    "load_trainer_state",
    "model_and_optimizer",
    "model_config_dict",
    "private_dir",
    "prune_checkpoints",
    "rank_file",
    "refuse_linked_run_dirs",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "step_of",
]

# Settings a resumed run must share with the saved one: anything else
# (steps, logging, checkpoint cadence) may change.
_MUST_MATCH = (
    "model",
    "clip_norm",
    "global_batch_size",
    "seq_len",
    "seed",
    "corpus",
    "corpus_bytes",
    "tokenizer",
    "accumulation",
    "lr",
    "warmup",
    "weight_decay",
    "precision",
)


# Why pc refuses a link at ``<output-dir>/checkpoints`` (or ``logs``,
# ``tensorboard``), and the fix.
CHECKPOINTS_LINK_FIX = (
    "To keep a run's checkpoints and logs on another disk, pass an --output-dir there (it "
    "may itself be a link), or remove the link."
)


def refuse_linked_run_dirs(config: Any) -> None:
    """Refuse a link at ``<output-dir>/checkpoints``, ``logs`` or
    ``tensorboard``: pc-train keeps its own files there [Note: paths pc
    touches in pc_booster.checkpoint.paths]."""
    out = Path(config.output_dir)
    for own in (Path(config.checkpoint_dir), out / "logs", out / "tensorboard"):
        refuse_link(own, CHECKPOINTS_LINK_FIX)


def has_checkpoint(root: Path) -> bool:
    return bool(step_dirs(root))


def find_checkpoint(root: Path, which: str) -> Path:
    """``which`` is ``"latest"`` (the newest complete checkpoint under
    ``root``) or a checkpoint directory."""
    if which != "latest":
        path = Path(which)
        if not path.is_dir():
            raise CheckpointError(f"--resume {which}: no such checkpoint directory.")
        return path
    found = step_dirs(root)
    if not found:
        raise CheckpointError(
            f"--resume: no checkpoint in {root}; run without --resume to start, or pass "
            "--output-dir of the run to continue."
        )
    if signing_key() is not None:  # [Note: what a signature binds]: the newest committed
        marked = high_water_step(root)
        named = [p for p in found if step_of(p) == marked]
        if named:
            return named[-1]
    return found[-1]


def load_trainer_state(
    path: Path, config: Any, verify_contents: bool | None = None
) -> dict[str, Any]:
    """The checkpoint's trainer state, after checking that every file is
    present and whole and that it belongs to a run with ``config``'s
    settings. ``verify_contents``: hash every file against its recorded
    checksum (True), or only those the Booster's loads do not verify
    (False); None: True in a process outside any rank (the launcher's
    preflight), else False [Note: checkpoint checksums]."""
    file = path / STATE
    try:
        raw = file.read_bytes()
        state: dict[str, Any] = json.loads(raw)
        files: dict[str, int] = state["files"]
        step = int(state["step"])
        saved: dict[str, Any] = state["config"]
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is not a complete pc-train checkpoint: {STATE} is missing."
        ) from None
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"{file} is corrupt ({error}); resume from another checkpoint."
        ) from None
    for name, size in files.items():
        part = path / name
        if not part.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing.")
        if part.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {name} has {part.stat().st_size} bytes, "
                f"{size} were written. Resume from an earlier checkpoint."
            )
    key = signing_key()
    if key is not None:  # [Note: signed checkpoints] [Note: what a signature binds]
        explicit = getattr(config, "resume", None) not in (None, "latest", "auto")
        try:
            verify_signed(path, raw, state, key)
            real = path.resolve()  # a link or "." named by the user: what it is
            check_position(real, state, step_of(real), key, explicit)
        except SignatureError as error:
            raise CheckpointError(str(error)) from None
    if verify_contents is None:
        verify_contents = not _inside_a_rank()
    _verify_checksums(path, state.get("checksums", {}), verify_contents)
    _check_model_opens(path)
    current = config.to_dict()
    differ = [k for k in _MUST_MATCH if saved.get(k) != current.get(k)]
    if differ:
        details = ", ".join(f"{k}: saved {saved.get(k)!r}, now {current.get(k)!r}" for k in differ)
        raise CheckpointError(
            f"checkpoint {path} comes from a run with other settings ({details}); resume with "
            "the same settings, or use another --output-dir for a new run."
        )
    _check_model_config(path, state, config)
    if step > config.steps:
        raise CheckpointError(f"checkpoint {path} is at step {step}, past --steps {config.steps}.")
    schedule = int(state.get("schedule_steps", saved.get("steps", config.steps)))
    if config.steps > schedule and not getattr(config, "extend_schedule", False):
        raise CheckpointError(
            f"--steps {config.steps} goes past the learning-rate schedule of the run in {path}, "
            f"which reaches 0 at step {schedule}: steps after it would not learn. Pass "
            f"--extend-schedule to stretch the schedule to {config.steps} steps (the warm-up "
            "as it was, the cosine decay over the new length, from the learning rate it "
            f"reaches at step {step} then), or start a new run from the exported model "
            f"(pc-export {path} <dir>, then --model <dir>)."
        )
    return state


# Keys of a model config that say nothing about the model's computation.
_CONFIG_NOISE = {"transformers_version", "_name_or_path", "architectures", "torch_dtype", "dtype"}


def model_config_dict(config: Any) -> dict[str, Any]:
    """What the trainer state records of the model's config (JSON values)."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    kept = {k: v for k, v in sorted(raw.items()) if k not in _CONFIG_NOISE}
    recorded: dict[str, Any] = json.loads(json.dumps(kept, default=str))  # as the file holds it
    return recorded


def _check_model_config(path: Path, state: dict[str, Any], config: Any) -> None:
    """A checkpoint records its model's config: a config file edited since
    (an activation, a width) is refused with the difference."""
    saved = state.get("model_config")
    if not isinstance(saved, dict):
        return  # checkpoints of earlier versions
    from pc_train.models import resolve_model

    now = model_config_dict(resolve_model(config.model, config.seq_len).config)
    keys = sorted(set(saved) | set(now))
    differ = [k for k in keys if saved.get(k) != now.get(k)]
    if differ:
        details = ", ".join(f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in differ[:5])
        raise CheckpointError(
            f"checkpoint {path} was trained with another model config ({details}): the "
            f"config of --model {config.model} changed since. Restore it, or start a new run."
        )


def _inside_a_rank() -> bool:
    return (dist.is_available() and dist.is_initialized()) or "RANK" in os.environ


def _verify_checksums(path: Path, sums: dict[str, str], everything: bool) -> None:
    if not isinstance(sums, dict):
        raise CheckpointError(f"{path / STATE} is corrupt (checksums: {sums!r}).")
    if not everything:  # the files a Booster sidecar lists are verified by the loads
        sidecars = {k: v for k, v in sums.items() if Path(k).name == CHECKSUMS}
        _compare(path, sidecars)  # first: the lists of what the loads verify
        covered = {
            str((path / sidecar).parent.joinpath(name).relative_to(path))
            for sidecar in sidecars
            for name in read_sidecar((path / sidecar).parent)
        }
        sums = {k: v for k, v in sums.items() if k not in covered and k not in sidecars}
    _compare(path, sums)


def _compare(path: Path, sums: dict[str, str]) -> None:
    actual = file_checksums(path, sums)
    for name, expected in sorted(sums.items()):
        if actual[name] != expected:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {name} has checksum {actual[name]}, {expected} "
                "was written. Resume from an earlier checkpoint."
            )


def private_dir(path: Path) -> None:
    """Make ``path`` and the missing directories above it readable by this
    user only (0700): checkpoints, logs and reports hold the model and the
    run's data. Directories that exist already keep their modes."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # another rank made it meanwhile
            continue
        os.chmod(folder, 0o700)  # whatever the umask


def _check_model_opens(path: Path) -> None:
    """The model's index opens: a sharded checkpoint's metadata, or the
    safetensors header of a checkpoint of earlier pc-train versions."""
    sharded = path / "model" / ".metadata"
    try:
        if sharded.exists() or not (path / "model.safetensors").exists():
            from pc_booster.checkpoint.files import saved_keys  # no code from the file runs

            saved_keys(path / "model")
            return
        from safetensors import safe_open

        with safe_open(str(path / "model.safetensors"), framework="pt") as model_file:
            model_file.keys()
    except Exception as error:  # pickle and safetensors raise their own error types
        raise CheckpointError(f"checkpoint {path}: the model does not open: {error}") from None


def rng_state() -> dict[str, Any]:
    """This rank's RNG states (torch's, Python's, every GPU's), as saved."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_and_optimizer(path: Path) -> tuple[Path, Path]:
    """Where checkpoint ``path`` keeps the model and the optimizer (sharded
    directories; one file each in checkpoints of earlier versions)."""
    if (path / "model").is_dir():
        return path / "model", path / "optimizer"
    return path, path / "optimizer.pt"


def save_checkpoint(
    booster: Any,
    model: Any,
    optimizer: Optimizer,
    schedule: Any,
    root: Path,
    step: int,
    state: dict[str, Any],
    rng: dict[str, Any],
    written: Callable[[], None] | None = None,
    use_async: bool = False,
    keep_last: int | None = None,
) -> Future[Path]:
    """Save step ``step`` (collective: every rank calls it), then (rank 0)
    keep the newest ``keep_last``. ``written`` is called once every file is
    written and before the rename (the fault tests kill a rank there).

    Returns a future of the checkpoint's directory, done at once, or with
    ``use_async`` once the background writes are done and the directory
    renamed: each rank has then only copied its share of the model and
    optimizer to host memory [Note: async saves in ``pc_booster.checkpoint.async_saves``].
    A run killed before that leaves ``step-N.partial``, never loaded, and
    the earlier checkpoints as they were. Wait for one save before the next."""
    final = root / f"step-{step:06d}"
    partial = root / f"step-{step:06d}.partial"
    rank = dist.get_rank()
    if rank == 0:  # [Note: paths pc touches in pc_booster.checkpoint.paths]
        own_directory(root, replace=False, fix=CHECKPOINTS_LINK_FIX)
        remove_tree(partial)  # a leftover, or a link there: removed, never written through
        private_dir(partial)
    dist.barrier()
    # The small files first: every rank's are on disk before any rank's
    # background write starts, so the rename after those writes moves them.
    booster.save_lr_scheduler(schedule, partial / "scheduler.pt")
    with named_disk_errors(partial / f"rng-rank{rank}.pt", f"rank {rank}'s RNG state"):
        torch.save(rng, partial / f"rng-rank{rank}.pt")  # [Note: disk errors named]
    dist.barrier()
    writes = [
        booster.save_model(model, partial / "model", shard=True, use_async=use_async),
        booster.save_optimizer(optimizer, partial / "optimizer", shard=True, use_async=use_async),
    ]

    def commit() -> Path:
        for write in writes:
            if write is not None:
                write.result()  # an async write's barrier: every rank's share is written
        if written is not None:
            written()
        verified_commit(partial, final, root, state, keep_last, use_async)
        return final

    done: Future[Path] = Future()
    if not use_async:
        done.set_result(commit())
        return done

    def run() -> None:
        try:
            done.set_result(commit())
        except BaseException as error:  # handed to whoever waits for the save
            done.set_exception(error)

    threading.Thread(target=run, name=f"pc-train-commit-{step}", daemon=True).start()
    return done


def rank_file(path: Path, file: Path) -> Any:
    """This rank's ``file`` of checkpoint ``path`` (read with the
    weights-only unpickler: nothing in it runs as code); when it does not
    load on any rank, every rank raises, naming the rank and the file."""
    problem: str | None = None
    loaded: Any = None
    try:
        loaded = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # missing, truncated, or a pickle naming code
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        problem = f"{file.name} does not load on rank {dist.get_rank()}: {first}"
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)
    failed = next((p for p in found if p), None)
    if failed:
        raise CheckpointError(f"checkpoint {path} does not load: {failed}")
    return loaded
