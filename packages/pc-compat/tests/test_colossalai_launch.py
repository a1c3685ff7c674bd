"""Colossal-AI's launch-level names at the edge: ``launch``,
``DistCoordinator``, ``get_dist_logger``, ``get_accelerator``. Each accepted
argument is checked for its effect; each refusal for its message. One
spawn of 2 ranks runs the distributed sub-cases (the last one replaces the
harness's group by one that ``launch`` starts)."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pc_comm.testing import find_free_port, run_subtests
from pc_compat.colossalai import launch, launch_from_torch
from pc_compat.colossalai.accelerator import CpuAccelerator, get_accelerator
from pc_compat.colossalai.cluster import DistCoordinator
from pc_compat.colossalai.logging import get_dist_logger

pytestmark = pytest.mark.timeout(120)

CONFIG_REFUSAL = (
    "(config=...) got {what}, and pc reads no config. Colossal-AI's config (parallel "
    "sizes, fp16, zero, gradient clipping) is given in pc as the options of the plugin "
    "passed to pc_booster.Booster, and the seed, backend and logging as arguments of this "
    "function (see docs/migrate-colossalai.md). Pass config={} or leave it out."
)


# ------------------------------------------------------------ no process group


def test_non_empty_config_is_refused_with_what_pc_does_instead() -> None:
    message = "launch_from_torch" + CONFIG_REFUSAL.replace(
        "{what}", "a config with keys ['fp16', 'zero']"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        launch_from_torch(config={"fp16": {}, "zero": {}})
    message = "launch_from_torch" + CONFIG_REFUSAL.replace(
        "{what}", "the config file './config.py'"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        launch_from_torch(config="./config.py")
    with pytest.raises(ValueError, match=re.escape(message)):
        launch_from_torch("./config.py")  # the old positional order
    message = "launch" + CONFIG_REFUSAL.replace("{what}", "the config file 'cfg.py'")
    with pytest.raises(ValueError, match=re.escape(message)):
        launch(config=Path("cfg.py"), rank=0, world_size=1, host="127.0.0.1", port=1)
    with pytest.raises(TypeError, match=r"config must be a dict, a file path or None, got int"):
        launch_from_torch(config=3)  # type: ignore[arg-type]


def test_launch_argument_checks() -> None:
    with pytest.raises(
        TypeError, match=r"rank must be an int, got \{\}\. Colossal-AI's old launch"
    ):
        launch({}, 0, 2, "127.0.0.1", 29500)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        launch(rank=2, world_size=2, host="127.0.0.1", port=29500)
    with pytest.raises(ValueError, match=r"port must be in \[1, 65536\), got 0"):
        launch(rank=0, world_size=1, host="127.0.0.1", port=0)
    with pytest.raises(TypeError, match="seed must be an int or None"):
        launch_from_torch(seed=1.5)  # type: ignore[arg-type]


def test_launch_refuses_values_that_contradict_the_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match=r"rank=0, but the environment says RANK=1"):
        launch(rank=0, world_size=2, host="127.0.0.1", port=29500)


def test_coordinator_needs_a_process_group() -> None:
    with pytest.raises(
        RuntimeError, match="DistCoordinator needs an initialised default process group"
    ):
        DistCoordinator()


def test_logger_levels_files_and_ranks(tmp_path: Path) -> None:
    logger = get_dist_logger("pc-test-levels")
    assert get_dist_logger("pc-test-levels")._logger is logger._logger  # one logger per name
    out = io.StringIO()
    with contextlib.redirect_stderr(out):
        logger.info("shown")
        logger.debug("hidden at INFO")
        logger.info("not rank 0", ranks=[1])  # no group: this is rank 0
        logger.set_level("WARNING")
        logger.info("hidden at WARNING")
        logger.warning("warned")
        logger.set_level("DEBUG")
        logger.debug("debug shown")
    text = out.getvalue()
    assert "INFO" in text
    assert "shown" in text
    assert "warned" in text
    assert "debug shown" in text
    assert "hidden" not in text
    assert "not rank 0" not in text
    assert "test_colossalai_launch.py" in text  # the caller's location, not the logger's
    logger.set_level("ERROR")
    path = logger.log_to_file(tmp_path / "logs", level="DEBUG", suffix="x")
    assert path == tmp_path / "logs" / "rank_0_x.log"
    with contextlib.redirect_stderr(io.StringIO()) as console:
        logger.debug("to the file only")
    assert "to the file only" in path.read_text()  # the file's level, not the console's
    assert console.getvalue() == ""
    for handler in list(logger._logger.handlers):
        if isinstance(handler, logging.FileHandler):
            handler.close()
            logger._logger.removeHandler(handler)
    with pytest.raises(
        ValueError, match=r"level must be one of \['DEBUG', 'ERROR', 'INFO', 'WARNING'\]"
    ):
        logger.set_level("LOUD")
    with pytest.raises(TypeError, match=r"ranks must be a list of ranks such as \[0\], got 0"):
        logger.info("x", ranks=0)  # type: ignore[arg-type]
    (tmp_path / "file.log").write_text("")
    with pytest.raises(ValueError, match="log_to_file takes a directory"):
        logger.log_to_file(tmp_path / "file.log")
    with pytest.raises(ValueError, match="mode must be 'a'"):
        logger.log_to_file(tmp_path, mode="r")


def test_cpu_accelerator_answers_for_the_host_process() -> None:
    acc = CpuAccelerator()
    if not torch.cuda.is_available():
        assert isinstance(get_accelerator(), CpuAccelerator)
    assert (acc.name, acc.communication_backend, acc.get_current_device()) == (
        "cpu",
        "gloo",
        torch.device("cpu"),
    )
    assert acc.device_count() == 1
    assert acc.current_device() == 0
    assert acc.is_available()
    acc.synchronize()
    acc.set_device("cpu")
    with pytest.raises(ValueError, match="the CPU accelerator has one device, 'cpu'; got 'cuda:0'"):
        acc.set_device("cuda:0")
    # Memory: the resident set moves with a 200 MB tensor, the peak follows
    # and is reset.
    acc.empty_cache()
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    assert before > 0
    assert acc.max_memory_allocated() >= before
    block = torch.ones(50_000_000)  # 200 MB, touched
    during = acc.memory_allocated()
    assert during - before > 150e6
    # Linux counts resident pages per thread and sums them lazily: a read
    # can lag by a few hundred KB.
    slack = 4 << 20
    assert acc.max_memory_allocated() >= during - slack
    assert acc.memory_stats()["allocated_bytes.all.peak"] >= during - slack
    del block
    acc.empty_cache()
    assert acc.memory_allocated() < during - 150e6
    assert acc.max_memory_allocated() >= during - slack  # the peak remembers
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() < during - 150e6
    assert "resident" in acc.memory_summary()
    # Random numbers: the CPU generator, as torch.manual_seed sets it.
    acc.manual_seed(11)
    ours = torch.rand(4)
    torch.manual_seed(11)
    assert torch.equal(ours, torch.rand(4))
    assert acc.initial_seed() == 11
    state = acc.get_rng_state()
    first = torch.rand(3)
    acc.set_rng_state(state)
    assert torch.equal(first, torch.rand(3))
    # autocast does cast (Colossal-AI's CPU accelerator returns a no-op).
    a = torch.randn(4, 4)
    with acc.autocast(dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
    with acc.autocast(enabled=False, dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.float32
    with pytest.raises(
        RuntimeError, match="set_per_process_memory_fraction has no meaning on the CPU"
    ):
        acc.set_per_process_memory_fraction(0.5)
    with acc.stream(acc.Stream()):
        assert acc.current_stream() is not None
    module = acc.set_to_device(torch.nn.Linear(2, 2))
    assert isinstance(module, torch.nn.Linear)


# ------------------------------------------------------------- two ranks


def _coordinator_case() -> None:
    coordinator = DistCoordinator()
    rank = dist.get_rank()
    assert (coordinator.rank, coordinator.world_size, coordinator.local_rank) == (rank, 2, rank)
    assert coordinator.is_master() == (rank == 0)
    assert coordinator.is_node_master() == (rank == 0)
    assert coordinator.is_last_process() == (rank == 1)
    sub = dist.new_group([1])
    if rank == 1:  # rank 1 is rank 0 of the group of itself
        assert coordinator.is_master(sub)
        assert coordinator.is_last_process(sub)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        coordinator.print_on_master("from master")
        coordinator.print_on_node_master("from node master")
        calls = coordinator.on_master_only()(lambda x: x * 2)(21)
    expected = "from master\nfrom node master\n" if rank == 0 else ""
    assert out.getvalue() == expected
    assert calls == (42 if rank == 0 else None)
    coordinator.block_all()


def _priority_case(tmp: str) -> None:
    coordinator = DistCoordinator()
    marker = Path(tmp) / "made-by-executor"
    with coordinator.priority_execution(executor_rank=1):
        if dist.get_rank() == 1:
            marker.write_text("once")
        else:
            assert marker.read_text() == "once"  # the executor went first
    # The executor fails: the others raise instead of waiting forever.
    failure = OSError if dist.get_rank() == 0 else RuntimeError
    message = (
        "download failed" if dist.get_rank() == 0 else "rank 0 raised inside priority_execution"
    )
    with pytest.raises(failure, match=message), coordinator.priority_execution():
        _download_that_fails()
    bad = r"executor_rank must be a rank in \[0, 2\), got 2"
    with pytest.raises(ValueError, match=bad), coordinator.priority_execution(executor_rank=2):
        pass
    coordinator.block_all()


def _download_that_fails() -> None:
    if dist.get_rank() == 0:
        raise OSError("download failed")
    raise AssertionError("the body ran after the executor failed")


def _logger_case(tmp: str) -> None:
    logger = get_dist_logger("pc-test-ranks")
    out = io.StringIO()
    with contextlib.redirect_stderr(out):
        logger.info("master only", ranks=[0])
        logger.warning("last only", ranks=[1])
        logger.error("everyone")
    text = out.getvalue()
    rank = dist.get_rank()
    assert ("master only" in text) == (rank == 0)
    assert ("last only" in text) == (rank == 1)
    assert "everyone" in text
    path = logger.log_to_file(tmp)
    logger.info(f"hello from {rank}")
    assert path.name == f"rank_{rank}.log"
    assert f"hello from {rank}" in path.read_text()


def _fresh_port() -> int:
    """A port chosen on rank 0 and told to every rank through the current group."""
    port = [find_free_port() if dist.get_rank() == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    return int(port[0])


def _launch_case(tmp: str) -> None:
    rank = dist.get_rank()
    port = _fresh_port()
    DistCoordinator().destroy()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(key)  # as in a process no launcher started
    out = io.StringIO()
    with contextlib.redirect_stderr(out):
        context = launch(
            rank=rank, world_size=2, host="localhost", port=port, seed=1234, verbose=True
        )
    assert dist.is_initialized()
    assert dist.get_rank() == rank
    assert context.backend == "gloo"
    # torchrun's variables, derived from the host names
    assert os.environ["LOCAL_RANK"] == str(rank)
    assert os.environ["LOCAL_WORLD_SIZE"] == "2"
    assert (os.environ["GROUP_RANK"], os.environ["MASTER_PORT"]) == ("0", str(port))
    assert DistCoordinator().local_rank == rank
    # verbose: one line, on rank 0
    assert ("Distributed environment is initialized, world size: 2" in out.getvalue()) == (
        rank == 0
    )
    # seed: the generators as torch.manual_seed / random.seed leave them
    drawn = (torch.rand(3), random.random())
    torch.manual_seed(1234)
    random.seed(1234)
    assert torch.equal(drawn[0], torch.rand(3))
    assert drawn[1] == random.random()
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    assert total.item() == 3.0
    # launch again: the group is kept; seed=None leaves the generators alone
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    with contextlib.redirect_stderr(io.StringIO()) as quiet:
        launch(rank=rank, world_size=2, host="localhost", port=port, seed=None, verbose=False)
    assert torch.equal(torch.rand(2), expected)
    assert quiet.getvalue() == ""


def _case(tmp: str, case: str) -> None:
    {
        "coordinator": lambda: _coordinator_case(),
        "priority": lambda: _priority_case(tmp),
        "logger": lambda: _logger_case(tmp),
        "launch": lambda: _launch_case(tmp),
    }[case]()


def test_colossal_names_on_two_ranks(tmp_path: Path) -> None:
    run_subtests(
        _case,
        2,
        {"case": ["coordinator", "priority", "logger", "launch"]},
        args=(str(tmp_path),),
        timeout=90,
    )
