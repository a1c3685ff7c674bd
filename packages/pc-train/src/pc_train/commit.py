"""pc-train's checkpoint directories as files: their names (``step-N``,
compared by step number), the verified commit that turns
``step-N.partial`` into ``step-N`` [Note: a verified commit], and the
pruning of older ones. :mod:`pc_train.checkpoint` builds on this."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pc_booster.checkpoint import DiskWriteError, named_disk_errors
from pc_booster.checkpoint.checksum import CHECKSUMS, file_checksums, read_sidecar
from pc_booster.checkpoint.paths import remove_tree
from pc_train.signing import (
    SIGNATURE,
    HighWater,
    sha256_files,
    sign,
    signing_key,
    write_high_water,
)

__all__ = [
    "STATE",
    "CheckpointError",
    "prune_checkpoints",
    "remove_unfinished",
    "step_dirs",
    "step_of",
    "verified_commit",
]

# Each checkpoint's record of its step, history, settings, files and sums.
STATE = "trainer_state.json"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, corrupt or from another run."""


_STEP_DIR = re.compile(r"step-(\d+)")


def step_of(path: Path) -> int | None:
    """The step a checkpoint directory's name says (``step-000040``: 40),
    or None for any other name."""
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match else None


def step_dirs(root: Path) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first, by their step
    number (``step-1000000`` after ``step-999999``). A link named like one
    is not pc's: it is neither resumed from nor pruned."""
    found = [
        p
        for p in root.glob("step-*")
        if step_of(p) is not None and p.is_dir() and not p.is_symlink()
    ]
    return sorted(found, key=lambda p: (step_of(p), p.name))


def verified_commit(
    partial: Path,
    final: Path,
    root: Path,
    state: dict[str, Any],
    keep_last: int | None,
    use_async: bool,
) -> None:
    """Every rank: ``partial`` verified and renamed to ``final`` by rank 0,
    the older checkpoints pruned after; in a save, every rank raises what
    rank 0 found [Note: a verified commit]."""
    actual = None  # an async save's commit thread has no collectives: rank 0 reads all
    if not use_async:
        dist.barrier()
        actual = _checksums_split(partial)  # every rank re-reads its share
    problem: Exception | None = None
    if dist.get_rank() == 0:
        try:
            _commit(partial, final, root, state, dist.get_world_size(), actual)
            if keep_last is not None:
                prune_checkpoints(root, keep_last, step_of(final))
        except (CheckpointError, DiskWriteError) as error:  # a full disk at the commit too
            if use_async:
                raise
            problem = error
    if not use_async:  # every rank learns rank 0's verdict, and raises it too
        verdict = [problem]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise verdict[0]


# [Note: a verified commit]
# Nothing unverified becomes a checkpoint: before rank 0 renames
# ``step-N.partial`` to ``step-N`` it checks the directory against what the
# ranks reported writing. Each sharded folder (model/, optimizer/) must
# hold DCP's .metadata and its checksum sidecar, which rank 0 wrote from
# every rank's list of the shard files it wrote with their checksums; each
# of those files must be there with that checksum, re-read (split over the
# ranks in a save; by rank 0 alone in an async save, whose commit runs in
# a thread of its own, without collectives); and every rank's RNG file and
# the scheduler's must be there. A file lost or changed between the writes
# and the commit (a full or failing disk, another process) leaves the
# partial directory as it is, the earlier checkpoints unpruned, and a
# CheckpointError naming the files on every rank (an async save raises it
# on rank 0, whose failure pc-train's launcher reports for the others).


def _reported(partial: Path) -> tuple[dict[str, str], list[str]]:
    """The shard files the ranks reported writing, by path in ``partial``,
    with their checksums (the sidecars), and the metadata or sidecars that
    are missing or unreadable [Note: a verified commit]."""
    reported: dict[str, str] = {}
    missing: list[str] = []
    for folder in ("model", "optimizer"):
        directory = partial / folder
        if not (directory / ".metadata").is_file():
            missing.append(f"{folder}/.metadata")
        if not (directory / CHECKSUMS).is_file():
            missing.append(f"{folder}/{CHECKSUMS}")
            continue
        try:
            sums = read_sidecar(directory)
        except ValueError:
            missing.append(f"{folder}/{CHECKSUMS} (unreadable)")
            continue
        reported.update({f"{folder}/{name}": value for name, value in sums.items()})
    return reported, missing


def _checksums_split(partial: Path) -> dict[str, str | None]:
    """Collective: the checksums of the reported shard files, each rank
    re-reading its share of them."""
    names = sorted(_reported(partial)[0])
    rank, world = dist.get_rank(), dist.get_world_size()
    parts: list[dict[str, str | None] | None] = [None] * world
    dist.all_gather_object(parts, _checksums_of(partial, names[rank::world]))
    return {name: value for part in parts if part for name, value in part.items()}


def _verify_partial(partial: Path, world: int, actual: dict[str, str | None] | None = None) -> None:
    """Raise CheckpointError unless ``partial`` holds every file the ranks
    reported writing, with their checksums [Note: a verified commit].
    ``actual``: the shard files' checksums as re-read (None: read here)."""
    reported, lost = _reported(partial)
    names = ("scheduler.pt", *(f"rng-rank{r}.pt" for r in range(world)))
    missing = [name for name in names if not (partial / name).is_file()] + lost
    if actual is None:
        actual = _checksums_of(partial, sorted(reported))
    missing += [name for name in sorted(reported) if actual.get(name) is None]
    wrong = [
        f"{name} (checksum {actual[name]}, reported {value})"
        for name, value in sorted(reported.items())
        if actual.get(name) is not None and actual[name] != value
    ]
    if missing or wrong:
        named = ([f"missing: {', '.join(missing)}"] if missing else []) + (
            [f"changed: {', '.join(wrong)}"] if wrong else []
        )
        raise CheckpointError(
            f"checkpoint {partial} was not committed: the files on disk differ from what the "
            f"ranks wrote ({'; '.join(named)}). The earlier checkpoints are kept as they were; "
            "check the disk (space, errors, another process writing there) and --resume from "
            "the latest one."
        )


def _checksums_of(directory: Path, names: Iterable[str]) -> dict[str, str | None]:
    """The checksums of ``directory``'s files ``names`` (None: missing, or
    gone while read)."""
    listed = list(names)
    try:
        return dict(file_checksums(directory, listed))
    except OSError:  # one is missing: one at a time, naming it
        sums: dict[str, str | None] = {}
        for name in listed:
            try:
                sums[name] = file_checksums(directory, [name])[name]
            except OSError:
                sums[name] = None
        return sums


def _commit(
    partial: Path,
    final: Path,
    root: Path,
    state: dict[str, Any],
    world: int,
    actual: dict[str, str | None] | None = None,
) -> None:
    """Rank 0: the directory verified [Note: a verified commit] (``actual``:
    the shard files' checksums the ranks re-read), the trainer state (with
    every file's size and checksum), then the rename that makes the
    checkpoint one."""
    _verify_partial(partial, world, actual)
    files = {
        str(p.relative_to(partial)): p.stat().st_size
        for p in sorted(partial.rglob("*"))
        if p.is_file()
    }
    payload = {**state, "files": files, "checksums": _checksums(partial, files)}
    key = signing_key()
    if key is not None:  # [Note: signed checkpoints]
        payload["sha256"] = sha256_files(partial, files)
    text = json.dumps(payload).encode()
    with named_disk_errors(partial / STATE, f"the commit of {final.name}"):
        (partial / STATE).write_bytes(text)
        if key is not None:
            (partial / SIGNATURE).write_text(sign(text, key))
    _fsync_dir(partial)
    remove_tree(final)  # an older save of this step, or a link there (the link only)
    os.replace(partial, final)
    _fsync_dir(root, walk=False)  # the rename; the other checkpoints were synced before
    if key is not None and isinstance(state.get("run_id"), str):  # [Note: what a signature binds]
        write_high_water(root, HighWater(state["run_id"], int(state["step"])), key)


def _checksums(partial: Path, files: dict[str, int]) -> dict[str, str]:
    """Every file's checksum: from the sidecars of the Booster's sharded
    saves (each rank hashed the files it wrote), the rest hashed here
    [Note: checkpoint checksums]."""
    sums: dict[str, str] = {}
    for sidecar in partial.rglob(CHECKSUMS):
        folder = sidecar.parent
        for name, value in read_sidecar(folder).items():
            sums[str((folder / name).relative_to(partial))] = value
    rest = [name for name in files if name not in sums]
    return {**sums, **file_checksums(partial, rest)}


def _fsync_dir(path: Path, walk: bool = True) -> None:
    """fsync ``path``'s files (``walk``: and its folders', never through a
    link), then ``path`` itself."""
    for file in path.iterdir() if walk else ():
        if file.is_symlink():
            continue
        if file.is_dir():
            _fsync_dir(file)
        elif file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_unfinished(root: Path) -> list[str]:
    """Remove what saves that did not finish (a full disk, a killed run)
    left under ``root`` (``step-N.partial``; a link there: the link only).
    Returns the names removed."""
    gone = sorted(root.glob("step-*.partial"))
    for partial in gone:
        remove_tree(partial)
    return [p.name for p in gone]


def prune_checkpoints(root: Path, keep: int, newest: int | None = None) -> None:
    """Keep the newest ``keep`` checkpoints; drop older ones and any
    partial save left by a killed run. ``newest``: the step just committed;
    checkpoints past it (a line the run went back from with ``--resume
    PATH``, or a planted ``step-9999999``) are neither counted nor removed,
    so the one just committed is never pruned."""
    remove_unfinished(root)
    found = step_dirs(root)
    if newest is not None:
        found = [p for p in found if (step_of(p) or 0) <= newest]
    for old in found[:-keep]:
        remove_tree(old)
