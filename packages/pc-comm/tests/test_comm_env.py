"""Reading torchrun's environment: every missing or inconsistent variable
gets an error naming it."""

from __future__ import annotations

import pytest

from pc_comm import DistEnv, DistEnvError, read_dist_env

GOOD = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29500",
}


def test_reads_torchrun_variables() -> None:
    env = read_dist_env(GOOD)
    assert env == DistEnv(
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=4,
        node_rank=1,
        master_addr="node0",
        master_port=29500,
    )
    assert env.num_nodes == 2


def test_single_node_defaults() -> None:
    env = read_dist_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (env.local_rank, env.local_world_size, env.node_rank) == (1, 2, 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"RANK": None}, "RANK is not set.*torchrun --nproc-per-node"),
        ({"MASTER_ADDR": None}, "MASTER_ADDR is not set"),
        ({"MASTER_PORT": None}, "MASTER_PORT is not set"),
        ({"WORLD_SIZE": "eight"}, "WORLD_SIZE must be an integer, got 'eight'"),
        ({"RANK": "8"}, r"RANK must be in \[0, WORLD_SIZE=8\), got RANK=8"),
        (
            {"LOCAL_WORLD_SIZE": "3"},
            r"WORLD_SIZE \(8\) must be a multiple of LOCAL_WORLD_SIZE \(3\)",
        ),
        ({"LOCAL_RANK": "4"}, r"LOCAL_RANK must be in \[0, LOCAL_WORLD_SIZE=4\)"),
        ({"GROUP_RANK": "2"}, r"GROUP_RANK must be in \[0, .* = 2\), got GROUP_RANK=2"),
        ({"MASTER_PORT": "70000"}, "MASTER_PORT must be a TCP port"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE must be at least 1"),
    ],
)
def test_bad_environment_names_the_variable(change: dict[str, str | None], message: str) -> None:
    environ = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(DistEnvError, match=message):
        read_dist_env(environ)


def test_env_error_is_a_value_error() -> None:
    assert issubclass(DistEnvError, ValueError)
