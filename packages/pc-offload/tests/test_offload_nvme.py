"""The NVMe tier of the CPU Adams ([Note: the NVMe tier] in pc_offload.nvme):
training is bitwise that of states in memory; the pages leave memory after
each tensor's step; the scratch files are private, gone however the
process ends, and a bad directory or a full disk is named."""

from __future__ import annotations

import copy
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pc_comm.testing import small_tmpfs
from pc_offload import CPUAdam, CPUAdamW, HybridAdam, NvmeSpaceError, NvmeTier

STEPS = 20


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64), nn.Linear(64, 32))


def _train(model: nn.Module, opt: Any, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("fraction", [0.5, 1.0])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("cls", [CPUAdam, HybridAdam])
def test_states_on_disk_train_bitwise_as_in_memory(
    cls: type[CPUAdam], state_dtype: str, fraction: float, tmp_path: Path
) -> None:
    memory, disk = _model(), _model()
    expected = _train(memory, cls(memory.parameters(), lr=1e-2, state_dtype=state_dtype),
                      range(STEPS))  # fmt: skip
    opt = cls(disk.parameters(), lr=1e-2, state_dtype=state_dtype,
              nvme_offload_fraction=fraction, nvme_offload_dir=str(tmp_path))  # fmt: skip
    assert _train(disk, opt, range(STEPS)) == expected
    for p, q in zip(memory.parameters(), disk.parameters(), strict=True):
        assert torch.equal(p, q)
    assert opt.nvme is not None
    placed = [p for p in disk.parameters() if opt.nvme.holds(opt.state[p]["exp_avg"])]
    total = sum(p.numel() for p in disk.parameters())
    largest = max(p.numel() for p in disk.parameters())  # within a tensor of the fraction
    assert abs(sum(p.numel() for p in placed) - fraction * total) <= largest


def _resident(tag: str) -> int:
    """Resident bytes of this process's mappings of the tier's file."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef":
            inside = tag in line
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_pages_leave_memory_after_each_step_and_come_back(tmp_path: Path) -> None:
    model = nn.Linear(1024, 1024)  # 8 MiB of moments
    opt = CPUAdamW(model.parameters(), nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path))
    _train_wide = [torch.randn(4, 1024) for _ in range(3)]
    for x in _train_wide:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert opt.nvme is not None
    opt.nvme.wait()
    assert opt.nvme.bytes >= 2 * 1024 * 1025 * 4
    assert _resident(opt.nvme.path.name) < 1024 * 1024  # dropped after the write-behind
    moments = opt.state[model.weight]["exp_avg"]
    assert float(moments.abs().sum()) > 0  # read back from the disk


def test_every_byte_is_counted_and_the_wait_on_the_disk_is_timed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each step reads and writes back every byte on the tier once; the next
    step's first tensor is asked for at the end of a step; a read that is
    not done when its tensor is stepped is the step's wait on the disk."""
    from pc_offload import nvme

    head = nn.Linear(256, 256)
    model = nn.Sequential(head, nn.Linear(256, 256))
    opt = CPUAdamW(model.parameters(), nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path))
    tier = opt.nvme
    assert tier is not None
    on_tier = 2 * 4 * sum(p.numel() for p in model.parameters())  # both moments, fp32
    for _ in range(3):
        model(torch.randn(4, 256)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    tier.wait()
    stats = tier.stats()
    assert stats.bytes_written == 3 * on_tier
    assert stats.bytes_read == 3 * on_tier  # the first step's reads the zeros it made
    first = opt.state[head.weight]
    assert {first["exp_avg"].untyped_storage().data_ptr()} <= set(tier._reading)

    slow = 0.2
    real = nvme._read_in

    def _slow_read(*args: Any) -> int:
        time.sleep(slow)
        return real(*args)

    monkeypatch.setattr(nvme, "_read_in", _slow_read)
    before = tier.stats()
    model(torch.randn(4, 256)).square().mean().backward()
    opt.step()
    waited = tier.stats().read_wait_s - before.read_wait_s
    # Three tensors read slowly one after another (the first was read fast):
    # the step waits for each while stepping the one before takes no time.
    assert waited >= 2 * slow * 0.9
    assert tier.stats().bytes_read - before.bytes_read == on_tier


def test_nothing_is_left_to_find_while_it_runs_or_after(tmp_path: Path) -> None:
    """The scratch file and its private directory are removed as soon as
    the file is open: the states live in an unlinked file (its blocks
    held by the descriptor), so nothing can be found, loaded or left
    behind, whatever way the process ends (os._exit included)."""
    model = _model()
    opt = CPUAdam(model.parameters(), nvme_offload_fraction=1.0, nvme_offload_dir=str(tmp_path))
    _train(model, opt, range(1))
    assert opt.nvme is not None
    assert opt.nvme.bytes > 0
    assert opt.nvme.path.parent == tmp_path
    assert list(tmp_path.iterdir()) == []
    target = os.readlink(f"/proc/self/fd/{opt.nvme._fd}")
    assert target.startswith(str(opt.nvme.path)), target
    assert target.endswith("(deleted)"), target
    fd = opt.nvme._fd
    del opt
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed with the optimizer


def test_a_killed_process_leaves_nothing_after_the_next_start(tmp_path: Path) -> None:
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(f"""
        import torch
        from pc_offload import CPUAdamW
        model = torch.nn.Linear(512, 512)
        opt = CPUAdamW(model.parameters(), nvme_offload_fraction=1.0,
                       nvme_offload_dir={str(tmp_path / "scratch")!r})
        print("ready", flush=True)
        while True:
            model(torch.randn(4, 512)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    """)
    )
    (tmp_path / "scratch").mkdir()
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)  # stepping, write-behind under way
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list((tmp_path / "scratch").iterdir()) == []  # the file went with the process
    # A directory left by a process killed between its two steps (made,
    # not yet removed) goes at the next start.
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = tmp_path / "scratch" / f"pc-nvme-{gone.stdout.strip()}-0123abcd"
    stale.mkdir(mode=0o700)
    (stale / "states").write_bytes(b"\0" * 4096)
    tier = NvmeTier(tmp_path / "scratch")
    assert list((tmp_path / "scratch").iterdir()) == []
    tier.close()


def test_a_link_or_another_users_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="is a symbolic link"):
        NvmeTier(link)
    with pytest.raises(ValueError, match="does not exist"):
        NvmeTier(tmp_path / "missing")
    if os.getuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)  # nobody
        with pytest.raises(ValueError, match="belongs to another user"):
            NvmeTier(theirs)
    NvmeTier("/tmp").close()  # shared and sticky: allowed


def test_a_full_disk_is_named_with_the_bytes(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", "size=1m") as small:
        model = nn.Linear(1024, 1024)  # 8 MiB of moments
        opt = CPUAdamW(model.parameters(), nvme_offload_fraction=1.0, nvme_offload_dir=str(small))
        model(torch.randn(2, 1024)).sum().backward()
        with pytest.raises(NvmeSpaceError, match=rf"more bytes in '{small}'.*free"):
            opt.step()
        del opt
        gc.collect()


def test_checkpoints_move_between_disk_and_memory(tmp_path: Path) -> None:
    model = _model()
    opt = CPUAdamW(model.parameters(), lr=1e-2, nvme_offload_fraction=1.0,
                   nvme_offload_dir=str(tmp_path))  # fmt: skip
    _train(model, opt, range(3))
    saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    went_on = _train(model, opt, range(3, 6))
    for fraction in (0.0, 1.0):
        again = _model()
        again.load_state_dict(weights)
        other = CPUAdamW(again.parameters(), lr=1e-2, nvme_offload_fraction=fraction,
                         nvme_offload_dir=str(tmp_path))  # fmt: skip
        other.load_state_dict(copy.deepcopy(saved))
        assert _train(again, other, range(3, 6)) == went_on
        if other.nvme is not None:  # loaded into memory, moved to the disk at the step
            assert all(other.nvme.holds(s["exp_avg"]) for s in other.state.values())
