"""Activation CPU offload, fast CPU optimizers and a pinned-memory pool.

Status: skeleton. Nothing is exported yet; issue 4: `CPUOffload`,
`CPUAdam`/`CPUAdamW`/`HybridAdam`, the pinned-memory pool and async copy engine
land here.
"""

__all__: list[str] = []
