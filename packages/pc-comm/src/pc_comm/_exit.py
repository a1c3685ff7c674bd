"""Let torch's backend threads finish before the interpreter tears down.

[Note: threads at interpreter exit]
gloo's work loop drops its reference to a finished collective's tensors on
its own thread, just after the caller saw the collective complete. When a
tensor's Python object died first (a temporary, such as the clone that
pc-tensor's sequence-parallel reduce-scatter all-reduces on gloo), that
last drop needs the GIL. If the main thread keeps the GIL from the last
collective until the interpreter starts tearing down (a short script that
ends right after it), the work-loop thread is made to exit while it waits
for the GIL, inside C++ code that may not unwind, and the process aborts
with "terminate called without an active exception" after its last line:
about one run in three of pc-tensor's sequence-parallel doc example, with
gdb showing ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllreduceWork`` ->
``TensorImpl::decref_pyobject`` -> ``take_gil``. Exit handlers run before
that teardown; sleeping in one releases the GIL, so such a thread takes
it, finishes and sleeps again. Importing :mod:`pc_comm` registers the
handler once; it runs after handlers registered later (last in, first
out), such as the health board's stop.
"""

from __future__ import annotations

import atexit
import time

# Long enough for a thread waiting on the GIL to take it, drop a few tensors
# and release it; short enough not to be noticed at exit.
_GRACE_S = 0.01


def _let_backend_threads_finish() -> None:
    time.sleep(_GRACE_S)


atexit.register(_let_backend_threads_finish)
