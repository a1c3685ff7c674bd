"""The multi-process test harness every pc package's tests use.

``spawn(fn, world_size)`` runs ``fn`` on a fresh gloo process group;
``run_subtests(fn, world_size, cases)`` runs many option combinations in one
group. A rank that raises, dies or hangs fails the test within its timeout
with that rank's traceback or stack. ``run_torchrun_agents`` starts real
torchrun agents as simulated nodes; ``tiny_gpt2`` is the small model the
parity tests train; ``assert_exits_cleanly`` runs a script repeatedly and
requires a clean exit every time; ``small_tmpfs`` mounts a small file
system for the disk tests; ``host_memory`` counts what a rank holds on
the host (live tensors and shared segments). See docs/testing.md.
"""

from pc_comm.testing._fixtures import (
    assert_exits_cleanly,
    one_process_group,
    run_torchrun_agents,
    saved_storage_bytes,
    small_tmpfs,
    tiny_gpt2,
)
from pc_comm.testing._harness import (
    DistributedTestError,
    SubcaseError,
    find_free_port,
    preload,
    run_subtests,
    spawn,
)
from pc_comm.testing._memory import HostMemory, host_memory

__all__ = [
    "DistributedTestError",
    "HostMemory",
    "SubcaseError",
    "assert_exits_cleanly",
    "find_free_port",
    "host_memory",
    "one_process_group",
    "preload",
    "run_subtests",
    "run_torchrun_agents",
    "saved_storage_bytes",
    "small_tmpfs",
    "spawn",
    "tiny_gpt2",
]
