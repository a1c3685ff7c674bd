"""Issue 52, orphaned ranks [Note: orphaned ranks] in pc_train.orphans: when
the launcher dies (SIGKILL), its ranks stop within a bounded time, saying
so, and the output directory's lock is free.

Under torchrun every rank runs in a Unix session of its own, so killing
torchrun's process group leaves the ranks running. pc-train's own launcher
starts its ranks in its process group, so there the launcher's pid alone is
killed: the OOM killer's choice, or a ``kill -9`` of the pid a user sees.
Before the fix, torchrun's ranks trained on, committed checkpoints and held
the lock until their output pipe broke (30 s after the kill here, still
training); pc-train's ranks, sent SIGINT by torch's parent-death signal,
saved one more checkpoint and left without a word about why."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pc_train.lock import LOCK_NAME

pytestmark = pytest.mark.timeout(300)

# fault_runs.argv's tiny run, many steps, a checkpoint every 2: it trains
# for minutes unless stopped. (Without --nproc, which torchrun's argparse
# would take for its own --nproc-per-node.)
RUN = ["--model", "gpt2-tiny", "--steps", "5000", "--global-batch-size", "4", "--seq-len",
       "16", "--corpus-bytes", "20000", "--plugin", "zero2", "--checkpoint-every", "2",
       "--keep-last", "2", "--eval-every", "0", "--log-every", "1", "--no-progress",
       "--no-tensorboard"]  # fmt: skip
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", "-m", "pc_train.train"]  # fmt: skip
PC_TRAIN = [sys.executable, "-m", "pc_train.train", "--nproc", "2"]
GONE_WITHIN_S = 30.0  # the bound the test holds the ranks to (they take < 0.1 s)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``, None when it no longer exists."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return fields[0], int(fields[1])


def _alive(pid: int) -> bool:
    """A zombie has exited: it holds no file and no lock, only its pid."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _children(parent: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (_stat(int(entry.name)) or ("", 0))[1] == parent:
            children.append(int(entry.name))
    return sorted(children)


def _ranks(launcher: int) -> list[int]:
    """The launcher's children that run pc-train, exec'd or forked
    (``pc_train.train``) or spawned (``spawn_main``); not multiprocessing's
    resource tracker, which it may start too."""
    ranks = []
    for pid in _children(launcher):
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"pc_train.train" in cmdline or b"spawn_main" in cmdline:
                ranks.append(pid)
    return ranks


def _lock_is_free(out: Path) -> bool:
    fd = os.open(out / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # releases the lock taken, if any
    return True


def _committed(out: Path) -> list[Path]:
    return [p for p in (out / "checkpoints").glob("step-*") if not p.name.endswith(".partial")]


@pytest.mark.parametrize(
    ("launcher", "start_method", "kill"),
    [
        pytest.param(TORCHRUN, None, "process-group", id="torchrun-process-group"),
        pytest.param(PC_TRAIN, None, "launcher-pid", id="pc-train-launcher-pid"),
        # How pc-train starts its ranks with a CUDA build of torch.
        pytest.param(PC_TRAIN, "spawn", "launcher-pid", id="pc-train-spawned-launcher-pid"),
    ],
)
def test_ranks_stop_when_their_launcher_is_killed(
    launcher: list[str], start_method: str | None, kill: str, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    out.mkdir()
    env = {**os.environ, **({"PC_TRAIN_START_METHOD": start_method} if start_method else {})}
    logs = {name: (tmp_path / f"{name}.txt").open("w") for name in ("stdout", "stderr")}
    # Files, not pipes: an orphan must not stop because a pipe broke or filled.
    proc = subprocess.Popen(
        [*launcher, *RUN, "--output-dir", str(out)], stdout=logs["stdout"],
        stderr=logs["stderr"], env=env, start_new_session=True,
    )  # fmt: skip
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while len(ranks) < 2 or not _committed(out):  # the ranks train and save
            assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "the ranks never saved a checkpoint"
            ranks = _ranks(proc.pid) if len(ranks) < 2 else ranks
            time.sleep(0.05)
        assert len(ranks) == 2, ranks
        assert not _lock_is_free(out)  # held while they train
        if kill == "process-group":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        # A zombie's leader can show before its other threads have let go of
        # its files: the lock is waited for too, within the same bound.
        while time.monotonic() < killed + GONE_WITHIN_S and (
            any(_alive(pid) for pid in ranks) or not _lock_is_free(out)
        ):
            time.sleep(0.05)
        took = time.monotonic() - killed
        left = [pid for pid in ranks if _alive(pid)]
        err = (tmp_path / "stderr.txt").read_text()
        assert not left, (
            f"rank(s) {left} still run {took:.0f} s after their launcher was killed; "
            f"checkpoints: {sorted(p.name for p in _committed(out))}\n{err[-2000:]}"
        )
        assert _lock_is_free(out), "the output directory's lock is still held"
        assert err.count(f"the launcher (pid {proc.pid}) is gone") == 2, err[-3000:]
    finally:
        for pid in ranks:  # orphans of a failed run: each in a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for log in logs.values():
            log.close()


# The watch alone, in three processes: a reaper (a child subreaper, so the
# orphan's exit code can be read), a launcher, and a rank that watches it.
RANK = """
import sys, threading, time
from pc_train.orphans import watch_launcher

def watch():
    assert watch_launcher("1", "/run/checkpoints") is not None
if sys.argv[1] == "off-main":  # no signal handler there: the polling thread alone
    thread = threading.Thread(target=watch)
    thread.start()
    thread.join()
else:
    watch()
print("watching", flush=True)
time.sleep(120)
"""
LAUNCHER = """
import os, subprocess, sys, threading, time

def start():
    rank = subprocess.Popen(
        [sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "TORCHELASTIC_RUN_ID": "test"}, start_new_session=True,
    )
    assert rank.stdout.readline() == "watching\\n"
    print(rank.pid, flush=True)
if sys.argv[3] == "from-a-thread":  # the thread that started the rank ends, the launcher lives
    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
else:
    start()
print("started", flush=True)
time.sleep(120)
"""
REAPER = """
import ctypes, os, subprocess, sys
assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
launcher = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]])
print(launcher.pid, flush=True)
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    print(pid, os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.parametrize(
    ("watch", "started"),
    [("on-main", "from-main"), ("off-main", "from-main"), ("on-main", "from-a-thread")],
)
def test_a_watching_rank_leaves_when_its_launcher_dies(watch: str, started: str) -> None:
    reaper = subprocess.Popen(
        [sys.executable, "-c", REAPER, LAUNCHER, RANK, watch, started],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert reaper.stdout is not None
        launcher, rank = int(reaper.stdout.readline()), int(reaper.stdout.readline())
        assert reaper.stdout.readline() == "started\n"
        time.sleep(0.5)  # past a parent-death signal from the thread's exit, and a poll
        assert _alive(rank), "the rank left while its launcher lived"
        os.kill(launcher, signal.SIGKILL)
        killed = time.monotonic()
        exits = {}
        for _ in range(2):  # "<pid> <exit code>" of the launcher and the rank
            pid, code = map(int, reaper.stdout.readline().split())
            exits[pid] = code
        took = time.monotonic() - killed
        err = reaper.stderr.read() if reaper.stderr else ""
        assert exits == {launcher: -signal.SIGKILL, rank: 1}, err
        assert took < 10, took  # at once by the signal, within 0.2 s by the poll, on a busy host
        assert err.count(f"pc-train (rank 1): error: the launcher (pid {launcher}) is gone") == 1
        assert "stops without saving (it was in start-up)" in err
        assert "Checkpoints saved so far are in /run/checkpoints; continue with --resume." in err
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(reaper.pid, signal.SIGKILL)
        reaper.wait()


def test_ranks_started_without_a_launcher_are_not_watched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pc_train.orphans import watch_launcher

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert watch_launcher("0", "checkpoints") is None


HOLD_AND_FORK = """
import os, sys, time
from pathlib import Path
from pc_train.lock import LOCK_NAME, run_lock
from pc_train.orphans import keep_lock_from_forks

with run_lock(sys.argv[1]):
    keep_lock_from_forks(Path(sys.argv[1]) / LOCK_NAME)
    if os.fork() == 0:  # a helper the rank forks, outliving it
        time.sleep(60)
        os._exit(0)
    print("forked", flush=True)
    time.sleep(60)
"""


def test_a_process_a_rank_forks_does_not_hold_the_lock(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_AND_FORK, str(tmp_path)], stdout=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "forked\n"
        assert not _lock_is_free(tmp_path)
        helpers = _children(holder.pid)
        assert len(helpers) == 1
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        deadline = time.monotonic() + 10
        while not _lock_is_free(tmp_path):
            assert time.monotonic() < deadline, "the forked helper holds the lock"
            time.sleep(0.02)
        assert _alive(helpers[0])  # alive, without the lock
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
