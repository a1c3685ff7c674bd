"""The multi-process test harness every pc package's tests use.

``spawn(fn, world_size)`` runs ``fn`` on a fresh gloo process group;
``run_subtests(fn, world_size, cases)`` runs many option combinations in one
group. A rank that raises, dies or hangs fails the test within its timeout
with that rank's traceback or stack. See docs/packages/pc-comm.md.
"""

from pc_comm.testing._harness import (
    DistributedTestError,
    SubcaseError,
    find_free_port,
    run_subtests,
    spawn,
)

__all__ = ["DistributedTestError", "SubcaseError", "find_free_port", "run_subtests", "spawn"]
