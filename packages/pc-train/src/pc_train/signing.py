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
to the checkpoint, the logs or the report.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = [
    "KEY_ENV",
    "SIGNATURE",
    "SignatureError",
    "sha256_files",
    "sign",
    "signing_key",
    "verify_signed",
]

KEY_ENV = "PC_CHECKPOINT_KEY"
SIGNATURE = "signature"
_BLOCK = 4 * 2**20


class SignatureError(ValueError):
    """A checkpoint whose signature or SHA-256 sums do not hold."""


def signing_key() -> bytes | None:
    """The key in ``PC_CHECKPOINT_KEY``, or None when it is not set."""
    value = os.environ.get(KEY_ENV, "")
    return value.encode() if value else None


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
