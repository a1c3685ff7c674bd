"""Spawn a real process group, run a function on every rank, gather failures.

[Note: why the parent watches processes, not collectives]
A rank that raises, dies or hangs leaves its peers blocked inside a
collective that may never return. So the verdict is never taken inside the
group: each rank writes its own result file, and the parent watches process
exits and those files, sleeping until a rank exits (at most a second): it
does not wake 50 times a second on cores the ranks fill, as a 20 ms poll
did. On the first failure it gives the other ranks a short grace period to
report, then dumps their Python stacks (faulthandler on SIGUSR1, which
works even inside a blocking C++ call) and kills them. A rank
that neither finishes nor fails is killed, with its stack, at the deadline.
Nothing here depends on the backend's own timeout.

[Note: start method]
Ranks start from a forkserver that has torch imported: forking from it is
fast (no re-import per rank) and safe (the server never ran an OpenMP region,
which is what makes plain fork of a torch process unsafe). The function is
sent pickled, together with the parent's ``sys.path``, and unpickled only
after the child has extended its path, so test modules collected by pytest
import in the child.

The server imports, once, what the ranks would otherwise each import again
(:func:`_preload_list`): torch's distributed stack, the ``transformers``
model families the tests build, and every pc package this process has
imported. Without that, each rank of a 4-rank group spent about 10 s on a
2-core machine importing them; with it, starting the group takes 0.3 s.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import itertools
import json
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_exit
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["DistributedTestError", "find_free_port", "preload", "run_subtests", "spawn"]

_PROGRESS = "[pc_comm.testing]"
# Errors a rank raises because a *peer* went away: symptoms, not causes.
_PEER_SYMPTOMS = ("closed by peer", "reset by peer", "Broken pipe", "remote process")
# The parent's longest sleep between looks at the ranks: it wakes at once
# when one exits, so this only bounds how late a stuck teardown is seen.
_WATCH_S = 1.0


class DistributedTestError(AssertionError):
    """One or more ranks failed, died or hung. The message holds each failing
    rank's traceback or stack and the tail of its output."""


@dataclass(frozen=True)
class _RankSpec:
    rank: int
    world_size: int
    store_port: int
    backend: str
    timeout_s: float
    workdir: str
    sys_path: tuple[str, ...]
    payload: bytes  # pickle of (fn, args)


def find_free_port() -> int:
    """A TCP port free at the time of the call (for launching torchrun)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---------------------------------------------------------------- child side


def _write_result(workdir: str, rank: int, result: dict[str, Any]) -> None:
    path = Path(workdir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)  # the parent never reads a half-written result


def _rank_main(spec: _RankSpec) -> None:
    log = open(Path(spec.workdir) / f"rank{spec.rank}.log", "w", buffering=1)  # noqa: SIM115
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    faulthandler.enable(file=log, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    os.environ.update(
        RANK=str(spec.rank),
        LOCAL_RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(spec.store_port),
    )
    # Several ranks share the machine's cores; one thread each avoids
    # oversubscription that would make every test slower.
    torch.set_num_threads(1)
    for entry in reversed(spec.sys_path):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    try:
        fn, args = pickle.loads(spec.payload)
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        store = dist.TCPStore(  # type: ignore[attr-defined]  # not in torch's __all__
            "127.0.0.1", spec.store_port, spec.world_size, is_master=False, timeout=timeout
        )
        dist.init_process_group(
            spec.backend,
            store=store,
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timeout,
        )
        fn(*args)
    except BaseException:
        text = traceback.format_exc()
        print(text, flush=True)
        _write_result(spec.workdir, spec.rank, {"ok": False, "traceback": text})
        log.flush()
        # Peers may be blocked in a collective with us; do not run
        # destructors that could wait on them.
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    _write_result(spec.workdir, spec.rank, {"ok": True})


def _run_cases(fn: Callable[..., None], cases: list[dict[str, Any]], args: tuple[Any, ...]) -> None:
    for index, case in enumerate(cases, start=1):
        label = ", ".join(f"{k}={v!r}" for k, v in case.items())
        print(f"{_PROGRESS} sub-case {index}/{len(cases)}: {label}", flush=True)
        try:
            fn(*args, **case)
        except BaseException as error:
            raise SubcaseError(f"sub-case {index}/{len(cases)} ({label}) failed") from error


class SubcaseError(Exception):
    """Wraps the exception of a failing sub-case with the sub-case's options."""


# --------------------------------------------------------------- parent side


_context: Any = None
_extra_preload: list[str] = []

# Imported by the forkserver when they are installed (a missing one is skipped).
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.bert.modeling_bert",
    "transformers.models.opt.modeling_opt",
    "transformers.models.bloom.modeling_bloom",
)


def preload(*modules: str) -> None:
    """Import ``modules`` once in the server the ranks fork from, instead of
    on every rank of every group. Call it before the first :func:`spawn` of
    the process (from a ``conftest.py``); afterwards it raises RuntimeError.
    A module that fails to import there is skipped, and each rank imports
    it itself as before."""
    if _context is not None:
        raise RuntimeError(
            f"preload({', '.join(map(repr, modules))}) after the first spawn: the server the "
            "ranks fork from is running already. Call preload from conftest.py."
        )
    _extra_preload.extend(modules)


def _preload_list() -> list[str]:
    ours = sorted(name for name in sys.modules if name.split(".")[0].startswith("pc_"))
    return list(dict.fromkeys([*_PRELOAD, *ours, *_extra_preload]))


def _forkserver() -> Any:
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_preload_list())
    return _context


@dataclass
class _RankState:
    rank: int
    process: Any
    verdict: str | None = None  # None while running
    failed_at: float | None = None
    traceback: str | None = None


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _last_subcase(path: Path) -> str | None:
    with contextlib.suppress(FileNotFoundError):
        marks = [ln for ln in path.read_text(errors="replace").splitlines() if _PROGRESS in ln]
        if marks:
            return marks[-1].split(_PROGRESS, 1)[1].strip()
    return None


def _poll(state: _RankState, workdir: Path, now: float) -> None:
    if state.verdict is not None:
        return
    result_path = workdir / f"rank{state.rank}.json"
    exitcode = state.process.exitcode
    if result_path.exists():
        result = json.loads(result_path.read_text())
        if not result["ok"]:
            state.verdict, state.traceback, state.failed_at = "raised", result["traceback"], now
        elif exitcode is not None:
            state.verdict = "ok" if exitcode == 0 else f"reported success, then exited {exitcode}"
            if exitcode != 0:
                state.failed_at = now
        return
    if exitcode is not None:
        if exitcode < 0:
            name = signal.Signals(-exitcode).name
            state.verdict = f"was killed by signal {name} before reporting a result"
        else:
            state.verdict = f"exited with code {exitcode} before reporting a result"
        state.failed_at = now


def _stop(states: list[_RankState], why: str) -> None:
    alive = [s for s in states if s.process.exitcode is None]
    for state in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(state.process.pid, signal.SIGUSR1)  # faulthandler stack dump
    if alive:
        time.sleep(0.5)
    for state in alive:
        state.process.kill()
        state.process.join(5)
        if state.verdict is None:
            state.verdict = why


def _blame_order(state: _RankState) -> tuple[int, float, int]:
    """Sort key putting the likely cause first: a rank that died, then one
    that raised an error of its own, then one whose error says a peer went
    away, then ranks stopped or hung; earliest first within each class."""
    if state.traceback is None and state.failed_at is not None:
        kind = 0
    elif state.traceback is not None:
        kind = 2 if any(sym in state.traceback for sym in _PEER_SYMPTOMS) else 1
    else:
        kind = 3
    return (kind, state.failed_at or 0.0, state.rank)


def _report(states: list[_RankState], workdir: Path, fn_name: str, world_size: int) -> str:
    failed = sorted((s for s in states if s.verdict != "ok"), key=_blame_order)
    lines = [
        f"{fn_name} failed on {len(failed)} of {world_size} ranks (first: rank {failed[0].rank})."
    ]
    for state in failed:
        log = workdir / f"rank{state.rank}.log"
        lines.append(f"\n--- rank {state.rank}: {state.verdict}")
        where = _last_subcase(log)
        if where and state.traceback is None:
            lines.append(f"    last sub-case started: {where}")
        if state.traceback:
            lines.append(state.traceback.rstrip())
        else:
            tail = _tail(log, 40)
            if tail:
                lines.append("    output and stack (last 40 lines):")
                lines.append(tail)
    return "\n".join(lines)


def spawn(
    fn: Callable[..., None],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 60.0,
    backend: str = "gloo",
    grace: float = 2.0,
    name: str | None = None,
) -> None:
    """Run ``fn(*args)`` on ``world_size`` fresh processes joined in a process
    group, and raise :class:`DistributedTestError` unless every rank returns.

    ``fn`` must be a module-level function (it is pickled by name). Inside it,
    the default group is initialised (``dist.get_rank()`` works) and
    torchrun's environment variables are set. The whole group must finish
    within ``timeout`` seconds; after the first failing rank, the others get
    ``grace`` seconds to report before they are stopped. ``name`` labels the
    report (default: the function's name).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}.")
    payload = _pickled(fn, args)
    fn_name = name or str(getattr(fn, "__qualname__", repr(fn)))
    context = _forkserver()
    store = dist.TCPStore(  # type: ignore[attr-defined]  # not in torch's __all__
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )
    with tempfile.TemporaryDirectory(prefix="pc-spawn-") as tmp:
        workdir = Path(tmp)
        states = [
            _start_rank(
                context,
                _RankSpec(
                    rank=rank,
                    world_size=world_size,
                    store_port=store.port,
                    backend=backend,
                    timeout_s=timeout,
                    workdir=tmp,
                    sys_path=tuple(sys.path),
                    payload=payload,
                ),
            )
            for rank in range(world_size)
        ]
        _watch(states, workdir, timeout, grace)
        for state in states:
            state.process.join(5)
        if any(s.verdict != "ok" for s in states):
            raise DistributedTestError(_report(states, workdir, fn_name, world_size))


def _pickled(fn: Callable[..., None], args: Sequence[Any]) -> bytes:
    """``(fn, args)`` as the ranks receive them [Note: start method]."""
    try:
        return pickle.dumps((fn, tuple(args)))
    except (pickle.PicklingError, AttributeError, TypeError) as error:
        raise TypeError(
            f"spawn needs a module-level function and picklable args; {fn!r} or its "
            f"args could not be pickled ({error}). Move the function to module level."
        ) from error


def _start_rank(context: Any, spec: _RankSpec) -> _RankState:
    process = context.Process(target=_rank_main, args=(spec,), daemon=True)
    process.start()
    return _RankState(rank=spec.rank, process=process)


def _watch(states: list[_RankState], workdir: Path, timeout: float, grace: float) -> None:
    """Until every rank has a verdict: on the first failure the others get
    ``grace`` seconds, and everyone still running at the deadline is
    stopped [Note: why the parent watches processes, not collectives]."""
    deadline = time.monotonic() + timeout
    while True:
        now = time.monotonic()
        for state in states:
            _poll(state, workdir, now)
        if all(s.verdict is not None for s in states):
            return
        first_failure = min((s.failed_at for s in states if s.failed_at), default=None)
        if first_failure is not None and now > first_failure + grace:
            culprit = min((s for s in states if s.failed_at), key=_blame_order)
            _stop(states, f"was stopped after rank {culprit.rank} failed")
            return
        if now > deadline:
            _stop(states, f"did not finish within the {timeout:g} s timeout (hung)")
            return
        # Sleep until a rank exits (a rank that raised exits right after
        # writing its result), looking at least once a second: the ranks
        # get every core, with no wake-ups of ours between their steps.
        limit = deadline if first_failure is None else min(deadline, first_failure + grace)
        wait_for_exit(
            [s.process.sentinel for s in states if s.verdict is None],
            timeout=max(0.0, min(_WATCH_S, limit - now)),
        )


def run_subtests(
    fn: Callable[..., None],
    world_size: int,
    cases: Mapping[str, Sequence[Any]],
    *,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
) -> None:
    """Run ``fn(*args, **case)`` for every combination of ``cases`` in one
    process group (spawned once), in order. The first failing sub-case ends
    the run; the report names it and the rank it failed on.

    ``run_subtests(check, 2, {"dtype": [torch.float32, torch.bfloat16],
    "op": [ReduceOp.SUM, ReduceOp.AVG]})`` runs four sub-cases.
    """
    keys = list(cases)
    combos = [dict(zip(keys, values, strict=True)) for values in itertools.product(*cases.values())]
    if not combos:
        raise ValueError("cases produced no combinations; every option list needs a value.")
    spawn(
        _run_cases,
        world_size,
        args=(fn, combos, tuple(args)),
        timeout=timeout,
        name=getattr(fn, "__qualname__", repr(fn)),
    )
