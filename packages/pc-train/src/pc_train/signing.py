"""Signed checkpoints: tampering detected, not only corruption.

[Note: signed checkpoints]
CRC-32 finds a flipped bit, not a forger: anyone who can write a
checkpoint can rewrite its checksums too (and CRC-32 itself is easy to
match). With ``PC_CHECKPOINT_KEY`` set in the environment (a secret, at
least 32 random bytes: ``openssl rand -hex 32``), pc-train signs what it
saves: at the commit, rank 0 records every file's SHA-256 in
``trainer_state.json`` and writes ``signature``, an HMAC-SHA256 under the
key of ``trainer_state.json``'s exact bytes. So the signature covers the
settings, the history and, through the SHA-256 sums, every byte of every
file.

With the key set, a resume (and ``pc-export`` of a pc-train checkpoint)
checks the signature, then every file's SHA-256: the launcher's preflight
checks all of them in one process before any rank starts; inside a rank
(torchrun's, or ``train()`` called directly) the ranks split the files and
every rank raises the first mismatch. A checkpoint without a signature is
refused while the key is set (unset it to load unsigned checkpoints, your
own earlier ones or someone else's you trust); a signed checkpoint loads
without the key as an unsigned one (its CRC-32 checked), since nothing can
be verified then. The key never leaves the environment: it is not written
to the checkpoint, the logs or the report. A key shorter than 32 bytes is
refused.

[Note: what a signature binds]
A signature proves the bytes came from a holder of the key; alone it does
not say *which* of the key's checkpoints this is, so an older, genuine one
copied over the newest, or to ``step-000099``, would resume (a replay).
So the signed trainer state carries the step and the run (``run_id``,
drawn at a run's first start and kept on resume), and each directory of
checkpoints keeps ``high-water.json``: the run and the step of its newest
commit, signed (under a domain prefix of its own, so neither signature
passes for the other), replaced after each rename. While the key is set,
``latest`` is the mark's step, not the highest number (a run that went
back with ``--resume PATH`` goes on from there; a planted
``step-9999999`` is not it), and pruning after a commit counts only
checkpoints up to the step committed. A resume refuses a signed
checkpoint whose directory name is not its signed step (a copy or a
rename) and one whose run is not its directory's run (a copy from another
run); for ``latest`` also one whose step is not the mark's (the newer ones
deleted), one signed by an earlier version (no run id) in a directory
with a mark, and any when the mark is gone or edited. Naming a checkpoint
with ``--resume PATH`` lifts the ``latest`` checks: going back is then the
user's decision. What it does not bind: the host or the user (anyone
with the key signs), the time (a mark copied back from a backup with its
own checkpoints replays that whole directory), and checkpoints of earlier
versions in a directory without a mark (only their name is checked).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = [
    "HIGH_WATER",
    "KEY_ENV",
    "MIN_KEY_BYTES",
    "SIGNATURE",
    "HighWater",
    "SignatureError",
    "check_position",
    "high_water_step",
    "read_high_water",
    "sha256_files",
    "sign",
    "signing_key",
    "verify_signed",
    "write_high_water",
]

KEY_ENV = "PC_CHECKPOINT_KEY"
SIGNATURE = "signature"
MIN_KEY_BYTES = 32
# Beside the checkpoints: the newest signed step of this directory and its run.
HIGH_WATER = "high-water.json"
# What a high-water mark's signature covers starts with this, so it can never
# pass for a trainer state's signature, nor one for it.
_HIGH_WATER_DOMAIN = b"pc-train high-water mark\n"
_BLOCK = 4 * 2**20


class SignatureError(ValueError):
    """A checkpoint whose signature or SHA-256 sums do not hold."""


def signing_key() -> bytes | None:
    """The key in ``PC_CHECKPOINT_KEY``, or None when it is not set; a key
    shorter than :data:`MIN_KEY_BYTES` is refused (ValueError)."""
    value = os.environ.get(KEY_ENV, "")
    if not value:
        return None
    key = value.encode()
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"{KEY_ENV} holds {len(key)} byte(s); a signing key must be at least "
            f"{MIN_KEY_BYTES} random bytes, or anyone can guess it. Make one with "
            f"`export {KEY_ENV}=$(openssl rand -hex 32)` (or python -c 'import secrets; "
            "print(secrets.token_hex(32))'), or unset it to save unsigned checkpoints."
        )
    return key


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as stream:
        while block := stream.read(_BLOCK):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def sha256_files(directory: Path, names: Iterable[str]) -> dict[str, str]:
    """The SHA-256 of ``directory``'s files ``names``, several at a time
    (hashlib releases the GIL on large blocks)."""
    listed = sorted(names)
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(listed)))) as pool:
        sums = list(pool.map(lambda n: _sha256(directory / n), listed))
    return dict(zip(listed, sums, strict=True))


def sign(data: bytes, key: bytes) -> str:
    """The signature of ``data`` under ``key``."""
    return "hmac-sha256:" + hmac.new(key, data, hashlib.sha256).hexdigest()


def verify_signed(path: Path, raw_state: bytes, state: dict[str, Any], key: bytes) -> None:
    """Raise SignatureError unless checkpoint ``path`` is signed under
    ``key`` and every file it lists has its recorded SHA-256 [Note: signed
    checkpoints]. ``raw_state``: ``trainer_state.json``'s bytes as read,
    ``state`` their contents. Collective when a process group is up (the
    ranks split the files); else this process checks them all."""
    signature = path / SIGNATURE
    if not signature.is_file():
        raise SignatureError(
            f"checkpoint {path} is not signed, and {KEY_ENV} is set: only checkpoints signed "
            f"with that key load. Unset {KEY_ENV} to load unsigned checkpoints you trust."
        )
    if not hmac.compare_digest(signature.read_text().strip(), sign(raw_state, key)):
        raise SignatureError(
            f"checkpoint {path}: its signature does not match (its trainer state was changed "
            f"after it was signed, or it was signed with another key than {KEY_ENV}'s). Do not "
            "load it; resume from a checkpoint you signed."
        )
    sums = state.get("sha256")
    if not isinstance(sums, dict) or set(sums) != set(state.get("files", {})):
        raise SignatureError(f"checkpoint {path}: its signed trainer state lists no SHA-256 sums.")
    names = sorted(sums)
    group = dist.is_available() and dist.is_initialized()
    if group:  # each rank its share of the files
        rank, world = dist.get_rank(), dist.get_world_size()
        names = names[rank::world]
    actual = sha256_files(path, names)
    wrong = next((n for n in names if actual[n] != sums[n]), None)
    problem = None if wrong is None else (
        f"checkpoint {path}: {wrong} was changed after the checkpoint was signed (SHA-256 "
        f"{actual[wrong]}, {sums[wrong]} was signed). Do not load it; resume from a checkpoint "
        "you signed."
    )  # fmt: skip
    if group:
        found: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(found, problem)
        problem = next((p for p in found if p), None)
    if problem:
        raise SignatureError(problem)


@dataclass(frozen=True)
class HighWater:
    """The newest checkpoint a directory of checkpoints has committed while
    signing: its run and its step [Note: what a signature binds]."""

    run_id: str
    step: int

    def payload(self) -> bytes:
        return (
            _HIGH_WATER_DOMAIN
            + json.dumps({"run_id": self.run_id, "step": self.step}, sort_keys=True).encode()
        )


def write_high_water(root: Path, mark: HighWater, key: bytes) -> None:
    """Record ``mark``, signed, as ``root``'s high-water mark (replaced in
    one rename, never written through a link)."""
    from pc_booster.checkpoint.export import atomic_write

    text = json.dumps(
        {"run_id": mark.run_id, "step": mark.step, "signature": sign(mark.payload(), key)}
    )
    atomic_write(root / HIGH_WATER, lambda p: p.write_text(text))


def high_water_step(root: Path) -> int | None:
    """The step ``root``'s high-water mark names, unverified (which
    checkpoint ``latest`` is; its signature is checked when it loads), or
    None without a readable mark."""
    try:
        step = json.loads((root / HIGH_WATER).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def read_high_water(root: Path, key: bytes) -> HighWater | None:
    """``root``'s high-water mark, its signature checked; None when there
    is none. A mark that does not parse or whose signature does not hold
    raises SignatureError."""
    file = root / HIGH_WATER
    try:
        raw = json.loads(file.read_text())
        mark = HighWater(str(raw["run_id"]), int(raw["step"]))
        signature = str(raw["signature"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SignatureError(f"{file} is unreadable ({error}); it cannot be trusted.") from None
    if not hmac.compare_digest(signature, sign(mark.payload(), key)):
        raise SignatureError(
            f"{file}: its signature does not match (it was edited, or signed with another key "
            f"than {KEY_ENV}'s). Do not resume from this directory's checkpoints unless you "
            "trust them: name one with --resume PATH."
        )
    return mark


def check_position(
    path: Path, state: dict[str, Any], named_step: int | None, key: bytes, explicit: bool
) -> None:
    """Raise SignatureError unless the signed ``state`` of checkpoint
    ``path`` agrees with where it lies [Note: what a signature binds]: its
    step with its directory's name (``named_step``), its run with the run
    of the directory it lies in, and, unless the user named it
    (``explicit``), its step is not older than that directory's high-water
    mark, and (``latest``) is that mark's step. ``state`` must be verified
    already."""
    step = int(state["step"])
    if named_step != step:
        raise SignatureError(
            f"checkpoint {path} holds step {step} (signed), but its directory's name says "
            f"{'step ' + str(named_step) if named_step is not None else 'no step'}: it was "
            "copied or renamed. Do not load it; resume from the checkpoint saved under its own "
            f"name (step-{step:06d})."
        )
    run_id = state.get("run_id")
    try:
        mark = read_high_water(path.parent, key)
    except SignatureError:
        if not explicit:
            raise
        return  # named by the user: a damaged mark does not stand in the way
    if mark is None:
        if explicit or not isinstance(run_id, str):
            return  # named, or signed by an earlier version and no mark yet: nothing binds it
        raise SignatureError(
            f"{path.parent / HIGH_WATER} is missing: pc-train writes it, signed, at every "
            "signed save, so without it an older checkpoint could pass for the newest. To "
            f"resume {path} all the same, name it: --resume {path}."
        )
    if isinstance(run_id, str) and mark.run_id != run_id:
        raise SignatureError(
            f"checkpoint {path} was saved by run {run_id}, but {path.parent} holds the "
            f"checkpoints of run {mark.run_id}: it was copied from another run. Resume it "
            "where it was saved, or name it with --resume from there."
        )
    if explicit:
        return
    if not isinstance(run_id, str):  # signed before marks existed, in a directory that has one
        raise SignatureError(
            f"checkpoint {path} was signed by an earlier pc-train, which bound no run, and "
            f"{path.parent} has committed step {mark.step} since: it is older than the newest. "
            f"To go back on purpose, name it: --resume {path}."
        )
    if step != mark.step:
        newer = "older than" if step < mark.step else "not"
        raise SignatureError(
            f"checkpoint {path} is at step {step}, {newer} step {mark.step}, the newest "
            f"this directory has committed ({path.parent / HIGH_WATER}): resuming it would "
            f"roll the run back or onto another line. To go back on purpose, name it: "
            f"--resume {path}."
        )
