"""``pc-train``: train a ``transformers`` causal LM with any pc plugin.

Run it plainly and it starts ``--nproc`` local processes itself through
torch's elastic launcher; run it under ``torchrun`` and it joins the job
torchrun started (any number of nodes). See docs/packages/pc-train.md for
the tour.

This module is the command line (:func:`main`, ``python -m
pc_train.train``): it parses the options, plans the run
(:mod:`pc_train.plan`), picks how the local processes start, and hands
over to process supervision (:mod:`pc_train.launch`), whose ranks each
run :func:`train` (:mod:`pc_train.trainer`). The names in ``__all__`` are
importable from here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from contextlib import ExitStack

import torch

from pc_train.checkpoint import CheckpointError
from pc_train.commit import remove_unfinished
from pc_train.data import load_byte_corpus
from pc_train.failures import EXIT_USER_ERROR, describe_failure
from pc_train.launch import launch_local, run_rank
from pc_train.lock import RunLockedError, run_lock
from pc_train.models import MODEL_PRESETS
from pc_train.plan import prepare
from pc_train.train_config import TrainConfig, parse_args
from pc_train.trainer import NonFiniteLossError, Trainer, train

__all__ = [
    "MODEL_PRESETS",
    "NonFiniteLossError",
    "TrainConfig",
    "Trainer",
    "load_byte_corpus",
    "main",
    "prepare",
    "train",
]


def _start_method() -> str:
    """How the local workers start. ``fork`` where it is safe: a CPU-only
    torch on Linux, where the workers inherit the torch and transformers this
    process has imported already (several seconds less per start). It needs
    this process to have started no OpenMP thread team (GNU OpenMP hangs in a
    forked child) and no CUDA, which :func:`prepare` keeps with
    ``fork_safe``. Elsewhere ``spawn``, torch's default. ``PC_TRAIN_START_METHOD``
    overrides it."""
    chosen = os.environ.get("PC_TRAIN_START_METHOD")
    if chosen:
        if chosen not in ("fork", "spawn", "forkserver"):
            raise ValueError(
                f"PC_TRAIN_START_METHOD={chosen!r}; expected fork, spawn or forkserver."
            )
        return chosen
    cpu_only = torch.version.cuda is None and torch.version.hip is None
    return "fork" if sys.platform == "linux" and cpu_only else "spawn"


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    under_torchrun = "RANK" in os.environ
    world = int(os.environ.get("WORLD_SIZE", config.nproc)) if under_torchrun else config.nproc
    try:
        start_method = "spawn" if under_torchrun else _start_method()
        threads = torch.get_num_threads()
        if start_method == "fork":
            torch.set_num_threads(1)  # no OpenMP team in a process that forks
        try:
            config, _, reasons = prepare(config, world, fork_safe=start_method == "fork")
        finally:
            torch.set_num_threads(threads)
    except (ValueError, CheckpointError) as error:
        print(f"pc-train: error: {error}", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR) from None
    except OSError as error:  # reading the model, corpus or checkpoint
        code, text = describe_failure(error, config)
        print(f"pc-train: error: before any rank started: {text}", file=sys.stderr)
        raise SystemExit(code) from None
    with ExitStack() as held:
        # One run per output directory [Note: the run lock in pc_train.lock]:
        # the launcher holds it, or rank 0 under torchrun.
        if not under_torchrun or os.environ.get("RANK") == "0":
            try:
                held.enter_context(run_lock(config.output_dir))
            except RunLockedError as error:
                print(f"pc-train: error: {error}", file=sys.stderr)
                raise SystemExit(EXIT_USER_ERROR) from None
            removed = remove_unfinished(config.checkpoint_dir)  # ours now: the lock is held
            if removed:
                print(f"pc-train: removed {', '.join(removed)}: unfinished save(s)", flush=True)
        if under_torchrun:  # join torchrun's job
            run_rank(config, reasons)
            return
        launch_local(config, reasons, start_method)


if __name__ == "__main__":
    main()
