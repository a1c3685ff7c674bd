"""pc_booster.checkpoint.named_disk_errors [Note: disk errors named]:
torch.save on a full or read-only disk, whose C++ stream loses the errno
(``basic_ios::clear: iostream error``, ``unexpected pos``, ``open file
failed``), and Python's own writes, named with the path, the operation and
the cause; other errors pass unchanged. Needs root for its tmpfs."""

from __future__ import annotations

import errno
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pc_booster.checkpoint import DiskWriteError, named_disk_errors
from pc_booster.checkpoint.export import atomic_write
from pc_comm.testing import small_tmpfs

_tmpfs = small_tmpfs


def _fill(disk: Path) -> None:
    with open(disk / "filler", "wb", buffering=0) as file:
        try:
            while True:
                file.write(b"\0" * 4096)
        except OSError:
            pass


# name: the write, given the target path.
WRITES: dict[str, Callable[[Path], object]] = {
    "torch-save-empty": lambda p: torch.save({"x": torch.ones(4)}, p),  # iostream error
    "torch-save-large": lambda p: torch.save({"x": torch.ones(2**16)}, p),  # unexpected pos
    "python-write": lambda p: p.write_bytes(b"x" * 2**16),  # [Errno 28]
}


@pytest.mark.parametrize("how", list(WRITES))
def test_a_full_disk_is_named_with_the_path_and_the_bytes(how: str, tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "disk", "size=256k") as disk:
        _fill(disk)
        target = disk / "state.pt"
        named = named_disk_errors(target, "a test's save", needed=2**16)
        with pytest.raises(DiskWriteError) as failed, named:
            WRITES[how](target)
        error = failed.value
        assert error.errno == errno.ENOSPC
        assert error.full
        assert error.user_fixable
        assert str(error) == (
            f"cannot write {target} (a test's save): the disk is full (0 bytes free of "
            "256.0 KiB there; it needs 64.0 KiB)"
        )
        assert (error.filename, error.free, error.needed) == (str(target), 0, 2**16)
        copy = pickle.loads(pickle.dumps(error))  # crosses ranks in DCP's gathers
        assert (type(copy), str(copy), copy.errno) == (DiskWriteError, str(error), error.errno)
        # atomic_write names the file it was asked for and removes its temporary file.
        with pytest.raises(DiskWriteError, match=f"cannot write {disk}/atomic.pt: the disk"):
            atomic_write(disk / "atomic.pt", WRITES[how])
        assert sorted(p.name for p in disk.iterdir()) in (
            ["filler"],
            ["filler", "state.pt"],  # the caller's own target: the caller removes it
        )


def test_a_read_only_disk_is_named(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "disk", "size=256k,ro") as disk:
        for write in WRITES.values():
            with pytest.raises(DiskWriteError) as failed, named_disk_errors(disk / "a.pt", ""):
                write(disk / "a.pt")
            assert failed.value.errno == errno.EROFS
            assert str(failed.value) == f"cannot write {disk / 'a.pt'}: read-only file system"


def test_other_errors_pass_unchanged(tmp_path: Path) -> None:
    named = named_disk_errors(tmp_path / "a.pt", "")
    with pytest.raises(ValueError, match="not a disk error"), named:
        raise ValueError("not a disk error")
