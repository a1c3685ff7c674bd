"""``pc-export``: a sharded checkpoint into a directory ``transformers``'
``from_pretrained`` loads, or a ``transformers`` directory into a sharded
checkpoint, offline on one machine, one tensor in memory at a time
(pc-booster's [Note: streamed export]).

    pc-export runs/pc-train/checkpoints/step-000200 exported/ --size-per-shard 2048
    pc-export --to-sharded exported/ start/

A pc-train checkpoint directory (its ``model/`` inside), a directory of
``Booster.save_model(..., shard=True)`` and one of ``export_pretrained``'s
staging are all accepted; ``config.json`` is carried over when there is one.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

__all__ = ["main"]


def _sharded_model_dir(path: Path) -> Path:
    """The sharded model checkpoint in ``path``: itself, or a pc-train
    checkpoint's ``model/``."""
    if (path / ".metadata").exists():
        return path
    if (path / "model" / ".metadata").exists():
        return path / "model"
    raise ValueError(
        f"{path} holds no sharded checkpoint (no .metadata, nor model/.metadata): pass a "
        "directory written by Booster.save_model(..., shard=True) or a pc-train checkpoint."
    )


def _verify_signature(source: Path) -> None:
    """With ``PC_CHECKPOINT_KEY`` set, only a pc-train checkpoint signed
    with it is exported [Note: signed checkpoints in ``pc_train.signing``]."""
    import json

    from pc_train.signing import KEY_ENV, signing_key, verify_signed

    key = signing_key()
    if key is None:
        return
    state_file = source / "trainer_state.json"
    if not state_file.is_file():
        raise ValueError(
            f"{source} is not a signed pc-train checkpoint, and {KEY_ENV} is set: only "
            f"checkpoints signed with that key are exported. Unset {KEY_ENV} to export it."
        )
    raw = state_file.read_bytes()
    try:
        state = json.loads(raw)
    except ValueError as error:
        raise ValueError(f"{state_file} is corrupt ({error}).") from None
    verify_signed(source, raw, state, key)


def _verify_recorded_sums(source: Path, checkpoint: Path) -> None:
    """A pc-train checkpoint's ``trainer_state.json`` records the CRC-32 of
    every file of ``model/``: each is checked, so a removed sidecar does
    not let a garbled shard through (issue 52)."""
    import json

    from pc_booster.checkpoint.checksum import file_checksums

    if checkpoint.name == "model" and (checkpoint.parent / "trainer_state.json").is_file():
        source = checkpoint.parent  # pc-export step-N/model: the checkpoint it lies in
    state_file = source / "trainer_state.json"
    if checkpoint != source / "model" or not state_file.is_file():
        return  # a Booster directory: its sidecar is all there is
    try:
        recorded = json.loads(state_file.read_bytes()).get("checksums", {})
        sums = {k: str(v) for k, v in recorded.items() if k.startswith("model/")}
    except (ValueError, AttributeError) as error:
        raise ValueError(f"{state_file} is corrupt ({error}).") from None
    missing = sorted(k for k in sums if not (source / k).is_file())
    actual = file_checksums(source, sorted(set(sums) - set(missing)))
    for name, value in sorted(actual.items()):
        if value != sums[name]:
            raise ValueError(
                f"checkpoint {source} is corrupt: {name} has checksum {value}, {sums[name]} "
                f"was written ({state_file}). Export an earlier checkpoint."
            )
    if missing:
        raise ValueError(
            f"checkpoint {source} is incomplete: {', '.join(missing)} (listed in {state_file}) "
            "is missing. Export an earlier checkpoint."
        )


def _say_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    print(f"pc-export: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="pc-export",
        description="Convert a sharded checkpoint into a transformers directory "
        "(safetensors shards + index + config.json), or back with --to-sharded, "
        "holding one tensor in memory at a time.",
    )
    parser.add_argument("source", help="a sharded checkpoint (or with --to-sharded, a "
                        "transformers directory)")  # fmt: skip
    parser.add_argument("out", help="the directory to write")
    parser.add_argument(
        "--size-per-shard", type=int, default=1024, help="MiB per safetensors file (default 1024)"
    )
    parser.add_argument(
        "--to-sharded",
        action="store_true",
        help="convert a transformers directory into a sharded checkpoint that "
        "Booster.load_model loads under any plugin",
    )
    args = parser.parse_args(argv)
    source, out = Path(args.source), Path(args.out)
    with warnings.catch_warnings():
        # What pc leaves alone (an old index's names outside ``out``): one line each.
        warnings.showwarning = _say_warning
        _run(args, source, out)


def _run(args: argparse.Namespace, source: Path, out: Path) -> None:
    from pc_booster.checkpoint import DiskWriteError
    from pc_booster.checkpoint.checksum import verify_sidecar
    from pc_booster.checkpoint.export import (
        atomic_write,
        export_files,
        import_pretrained,
        plan_export,
        remove_orphans,
        shard_names,
        write_index,
    )

    try:
        if args.to_sharded:
            import_pretrained(source, out)
            print(f"pc-export: wrote the sharded checkpoint {out}")
            return
        checkpoint = _sharded_model_dir(source)
        _verify_signature(source)
        # A damaged source is refused before anything is written: an export
        # would carry its bytes on under fresh checksums (issue 44).
        verify_sidecar(checkpoint, collective=False)
        _verify_recorded_sums(source, checkpoint)
        plan = plan_export(checkpoint, args.size_per_shard)
        # What an export killed midway left (shards no index names, temporary
        # files) goes first: a rerun leaves only the export (issue 44).
        removed = remove_orphans(out)
        if removed:
            print(f"pc-export: removed {len(removed)} file(s) an unfinished export left in {out}")
        names = shard_names(out, len(plan.files))
        export_files(checkpoint, out, plan, names)
        write_index(out, plan, names)
        for config in (checkpoint / "config.json", source / "config.json"):
            if config.exists():  # replaced, never written through a link there
                atomic_write(out / "config.json", lambda p, c=config: shutil.copyfile(c, p))
                break
    except ValueError as error:
        print(f"pc-export: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except DiskWriteError as error:  # [Note: disk errors named in pc_booster.checkpoint.disk]
        remove_orphans(out)  # what this export wrote: no index names it
        fix = "free space there or pass an OUT on a larger disk"
        fix = fix if error.full else "pass a writable OUT"
        print(f"pc-export: error: {error}; {fix}, then run pc-export again.", file=sys.stderr)
        raise SystemExit(2 if error.user_fixable else 1) from None
    size = plan.total_bytes() / 2**20
    print(f"pc-export: wrote {len(plan.files)} file(s), {size:.1f} MiB, to {out}")


if __name__ == "__main__":
    main()
