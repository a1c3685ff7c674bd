"""Process supervision: the local launch of ``--nproc`` ranks through
torch's elastic launcher (:func:`launch_local`), what each rank runs
(:func:`run_rank`: its signals, threads and process group, the training,
and its one line on failure), and the launcher's single report of the
ranks' failures with the job's exit code ([Note: exit codes] in
:mod:`pc_train.failures`)."""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import re
import signal
import sys
import tempfile
import uuid
import warnings
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pc_comm import health, tune_host_allocator
from pc_comm.host_allocator import RETURN_FREED
from pc_train import memory_limits
from pc_train.failures import (
    ERROR_DIR,
    EXIT_FAILURE,
    EXIT_USER_ERROR,
    declared_codes,
    describe_failure,
    fail,
    leave,
    traceback_file,
)
from pc_train.faults import join_memory_cgroup
from pc_train.lock import LOCK_NAME
from pc_train.orphans import keep_lock_from_forks, watch_launcher
from pc_train.stopping import Phases
from pc_train.train_config import TrainConfig
from pc_train.trainer import train

__all__ = ["launch_local", "run_rank"]


def _bound_by_memory(config: TrainConfig) -> bool:
    """A run that places states on the host or the disk tier, or one under
    the memory tests' caps: what one phase frees, the next needs."""
    options = config.plugin_options()
    placed = options.cpu_offload or options.offload_frac > 0 or options.nvme_offload_fraction > 0
    return placed or bool(os.environ.get("PC_TRAIN_CGROUP"))


def _cpu_threads(local_ranks: int) -> int:
    """Threads per rank: the cores this process may run on, shared."""
    from pc_comm import usable_cores

    return max(1, usable_cores() // max(1, local_ranks))


def run_rank(config: TrainConfig, reasons: Sequence[str]) -> None:
    """One rank's process, started by :func:`launch_local` or by torchrun:
    train, and on an exception leave one line saying what it was (the
    traceback in a file when it is not one of pc-train's own) and exit
    with its code."""
    from pc_comm import StoreUnreachableError, init_distributed

    # A forked worker inherits the launcher's handlers; a rank's own are
    # Python's defaults until the training loop installs its Stop's.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    # A rank outlives neither its launcher nor (through a fork) its lock
    # [Note: orphaned ranks in pc_train.orphans].
    launcher = watch_launcher(os.environ.get("RANK", "?"), str(config.checkpoint_dir))
    keep_lock_from_forks(Path(config.output_dir) / LOCK_NAME)

    # The Booster re-points the LR schedule at the optimizer it rebuilt;
    # torch's check for a wrapped step() cannot see that.
    warnings.filterwarnings("ignore", message=re.escape("Seems like `optimizer.step()` has been"))
    if config.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    try:
        context = init_distributed(
            timeout=timedelta(seconds=config.timeout), debug_collectives=config.debug_collectives
        )
    except StoreUnreachableError as error:  # a busy or wrong MASTER_PORT, bounded by --timeout
        try:
            fail(f"rank {os.environ.get('RANK', '?')} in start-up: {error}", EXIT_USER_ERROR)
        finally:
            # torch's store constructor may still run in a thread nothing can
            # stop; woken during interpreter shutdown it would abort the process.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_USER_ERROR)
    if context.device.type == "cpu":
        # Ranks share the host's cores; oversubscribing them slows every rank.
        torch.set_num_threads(_cpu_threads(context.env.local_world_size))
        # Freed memory kept (no page faults for it next step), or given back
        # where memory is the limit [Note: host allocator].
        tune_host_allocator(RETURN_FREED if _bound_by_memory(config) else None)
    phases = Phases()
    rank = context.env.rank
    if launcher is not None:
        launcher.where = lambda: phases.current
    try:
        join_memory_cgroup(rank)  # PC_TRAIN_CGROUP: the memory tests' per-rank caps
        memory_limits.record(rank, os.environ.get(ERROR_DIR))  # [Note: out of memory, named]
        _fatal_signals_to_file(rank, os.environ.get(ERROR_DIR))
        train(config, context, reasons, phases)
    except Exception as error:  # every rank's first exception, in one line
        if isinstance(error, RuntimeError) and health.is_peer_failure(error):
            peer = isinstance(error, health.PeerFailureError)
            failure = error if peer else health.diagnose(error)
            leave(f"error: {failure}", EXIT_FAILURE)
        code, text = describe_failure(error, config)
        if code == EXIT_FAILURE:  # not ours: the traceback goes to a file, for a bug report
            log = traceback_file(config, rank, error)
            text += f" (traceback: {log})" if log else ""
        fail(f"rank {rank} in {phases.current}: {text}", code)
    finally:
        if launcher is not None:  # its work is over: a launcher gone now ends it silently
            launcher.done = True
        health.stop_board()
        if dist.is_initialized():
            dist.destroy_process_group()


_FAULT_LOG: list[Any] = []  # the open file faulthandler writes to, kept alive


def _fatal_signals_to_file(rank: int, directory: str | None) -> None:
    """A rank killed by SIGBUS or SIGSEGV cannot leave its line; Python's
    faulthandler writes which signal and the stacks to ``rank<N>.fault``
    for the launcher instead [Note: out of memory, named]."""
    if not directory:
        return
    log = open(Path(directory) / f"rank{rank}.fault", "w")  # noqa: SIM115 (open for the process)
    _FAULT_LOG.append(log)
    faulthandler.enable(file=log, all_threads=True)


def _fatal_signal(rank: int, errors: Path) -> str | None:
    """The fatal signal faulthandler recorded for ``rank``, if any."""
    try:
        text = (errors / f"rank{rank}.fault").read_text()
    except OSError:
        return None
    for words, name in (("Bus error", "SIGBUS"), ("Segmentation fault", "SIGSEGV")):
        if words in text:
            return name
    return None


def _report_failure(failure: Any, errors: Path, config: TrainConfig) -> None:
    """Say once what went wrong: the ranks' own messages, and which rank
    failed first (a rank killed by a signal other than the SIGTERM the
    launcher stops the others with, else the earliest)."""
    notes = sorted(errors.glob("rank*.txt"), key=lambda p: int(p.stem[4:]))
    messages = list(dict.fromkeys(p.read_text() for p in notes))  # by rank, each once
    failures = failure.failures
    codes = {f.exitcode for f in failures.values()} | declared_codes(errors)  # [Note: exit codes]
    if codes == {130}:
        raise SystemExit(130)
    killed = [r for r, f in failures.items() if f.exitcode < 0 and f.signal_name() != "SIGTERM"]
    first = min(killed) if killed else min(failures, key=lambda r: failures[r].timestamp)
    cause = failures[first]
    how = (
        f"killed by {cause.signal_name()}" if cause.exitcode < 0 else f"exit code {cause.exitcode}"
    )
    named = None  # [Note: out of memory, named]
    # torch's launcher reports the first failure it polled, which may be a
    # survivor's; a rank that left no line died without a word: the OOM
    # killer's count in its cgroup says whether it was that.
    silent = [r for r in range(config.nproc) if not (errors / f"rank{r}.txt").exists()]
    for rank in dict.fromkeys([first, *silent] if killed else silent):
        named = memory_limits.explain_kill(rank, errors, machine=False)
        if named is not None:
            first = rank
            break
    if named is None and cause.signal_name() == "SIGKILL":  # the machine's OOM killer?
        named = memory_limits.explain_kill(first, errors)
    bus = [r for r in silent if _fatal_signal(r, errors) == "SIGBUS"]
    if named is None and (cause.signal_name() == "SIGBUS" or bus):
        first = first if cause.signal_name() == "SIGBUS" else bus[0]
        named = (
            "killed by SIGBUS: a shared-memory page could not be backed, "
            f"{memory_limits.shm_text()} (pc-comm's collectives keep their buffers there); "
            "enlarge it (docker run --shm-size, mount -o remount,size=... /dev/shm) or run "
            "fewer ranks here"
        )
    if named is not None:
        how = named
        codes = {*codes, EXIT_USER_ERROR}
    for message in messages:
        print(f"pc-train: {message}", file=sys.stderr)
    if killed or named or not messages:
        latest = config.checkpoint_dir
        print(
            f"pc-train: rank {first} failed first ({how}); the launcher stopped the other "
            f"ranks. Checkpoints saved so far are in {latest}; continue with --resume.",
            file=sys.stderr,
        )
    raise SystemExit(
        EXIT_USER_ERROR if EXIT_USER_ERROR in codes else EXIT_FAILURE
    )  # [Note: exit codes]


def launch_local(config: TrainConfig, reasons: Sequence[str], start_method: str) -> None:
    """Start ``config.nproc`` local ranks (each :func:`run_rank`) through
    torch's elastic launcher and wait for them; on a failure, report it once
    and exit with the job's code (130 when interrupted)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for name in ("torch.distributed.elastic", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=config.nproc,
        run_id=f"pc-train-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method=start_method,
    )
    print(
        f"pc-train: starting {config.nproc} local process(es); output in {config.output_dir}",
        flush=True,
    )
    if start_method == "fork":
        # A forked rank inherits the launcher's heap (torch, transformers:
        # ~300 MiB) shared with it, until the collector writes to an old
        # object's header and the page is copied, charged to the rank (its
        # memory cgroup): the objects alive now are left out of collection.
        gc.collect()
        gc.freeze()
    with tempfile.TemporaryDirectory(prefix="pc-train-") as errors:
        os.environ[ERROR_DIR] = errors
        try:
            elastic_launch(launch, run_rank)(config, reasons)
        except ChildFailedError as failure:
            _report_failure(failure, Path(errors), config)
        except (KeyboardInterrupt, SignalException):
            print(
                f"pc-train: interrupted; continue from the last checkpoint in "
                f"{config.checkpoint_dir} with --resume.",
                file=sys.stderr,
            )
            raise SystemExit(130) from None
        finally:
            os.environ.pop(ERROR_DIR, None)
