"""The harness itself: failures on one rank, hangs and early exits must fail
the test within the timeout, with the failing rank's traceback or stack."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from pc_comm.testing import DistributedTestError, preload, run_subtests, spawn

pytestmark = pytest.mark.timeout(120)


def _sum_ranks() -> None:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    world = dist.get_world_size()
    assert t.item() == world * (world - 1) / 2
    assert os.environ["RANK"] == str(dist.get_rank())


def test_passing_group_returns() -> None:
    spawn(_sum_ranks, 2, timeout=30)


def _fail_on_rank1(x: int) -> None:
    if dist.get_rank() == 1 and x == 2:
        raise RuntimeError("boom-on-rank-1")
    # Rank 0 goes on into a collective that rank 1 never joins: the harness
    # must stop it rather than wait.
    dist.barrier()


def test_subcase_failing_on_one_rank_names_rank_and_case() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_subtests(_fail_on_rank1, 2, {"x": [1, 2, 3]}, timeout=30)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "first: rank 1" in message
    assert "--- rank 1: raised" in message
    assert "boom-on-rank-1" in message
    assert "sub-case 2/3 (x=2) failed" in message
    # Rank 0 is blocked in a barrier rank 1 never joins: it is either stopped
    # by the harness or sees gloo's "connection closed"; either way it is
    # reported after rank 1, the cause.
    assert message.index("--- rank 1:") < message.index("--- rank 0:")
    assert "sub-case 3/3" not in message
    assert elapsed < 30, f"failure took {elapsed:.1f} s to surface; the grace period is 2 s"


def _hang_on_rank1() -> None:
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.barrier()


def test_hanging_rank_fails_within_timeout_with_its_stack() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        spawn(_hang_on_rank1, 2, timeout=5)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "did not finish within the 5 s timeout (hung)" in message
    assert "_hang_on_rank1" in message  # faulthandler's stack of the hung rank
    assert elapsed < 5 + 15, f"hang surfaced after {elapsed:.1f} s; timeout was 5 s"


def _exit_early_on_rank1() -> None:
    if dist.get_rank() == 1:
        os._exit(0)
    dist.barrier()


def _killed_on_rank1() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


@pytest.mark.parametrize(
    ("fn", "verdict"),
    [
        (_exit_early_on_rank1, "rank 1: exited with code 0 before reporting a result"),
        (_killed_on_rank1, "rank 1: was killed by signal SIGKILL before reporting a result"),
    ],
)
def test_dead_rank_fails_the_test(fn: object, verdict: str) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        spawn(fn, 2, timeout=30)  # type: ignore[arg-type]
    assert verdict in str(info.value)
    assert "first: rank 1" in str(info.value)
    assert time.monotonic() - start < 30


def test_unpicklable_function_is_rejected_clearly() -> None:
    def local() -> None:
        pass

    with pytest.raises(TypeError, match="module-level function"):
        spawn(local, 2)


def test_world_size_four_runs_every_rank() -> None:
    spawn(_sum_ranks, 4, timeout=60)


def _imported(names: list[str]) -> None:
    import sys

    missing = [name for name in names if name not in sys.modules]
    assert not missing, f"not imported before the rank's function ran: {missing}"


def test_ranks_start_with_the_heavy_imports_done() -> None:
    # The server the ranks fork from imported them (pc_comm, being loaded
    # here, among them); a rank does not import them again.
    spawn(_imported, 2, args=(["torch.distributed.checkpoint", "pc_comm.shm"],), timeout=60)
    with pytest.raises(RuntimeError, match="after the first spawn"):
        preload("json")
