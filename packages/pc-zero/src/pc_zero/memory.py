"""Per-rank model-state memory: what the optimizer holds, and the ZeRO
paper's formulas to compare it with.

[Note: ZeRO memory]
With Ψ parameters on N ranks, Adam, and the paper's mixed precision
(fp16/bf16 parameters and gradients, fp32 master, momentum and variance):

    stage 1: 2Ψ params + 2Ψ grads + 12Ψ/N (master, m, v)  = 4Ψ + 12Ψ/N
    stage 2: 2Ψ params + 2Ψ/N grads + 12Ψ/N                = 2Ψ + 14Ψ/N
    stage 3: everything sharded                             = 16Ψ/N

In fp32 training the parameters are their own masters (the rank's piece of
the flat parameter buffer is what the optimizer steps), so no master copy:

    stage 1: 4Ψ params + 4Ψ grads + 8Ψ/N (m, v)           = 8Ψ + 8Ψ/N
    stage 2: 4Ψ params + 4Ψ/N grads + 8Ψ/N                 = 4Ψ + 12Ψ/N
    stage 3: 4Ψ/N params + 4Ψ/N grads + 8Ψ/N                = 16Ψ/N

Our ZeRO-3 keeps fp32 shards as masters and fp32 gradient shards; the
bf16/fp16 copies exist only while a chunk is gathered, so between steps
it holds 4 + 4 + 8 bytes per element of its shard: 16Ψ/N either way.

With ``cpu_offload=True`` the master (an fp32 copy even in fp32 training)
and the optimizer states live on the host. Padding adds at most N - 1
elements per bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelStateMemory", "zero_paper_bytes"]


@dataclass(frozen=True)
class ModelStateMemory:
    """Bytes this rank holds, by kind; ``host_bytes`` is the part of the
    total that lives in host memory."""

    params: int
    grads: int
    master: int
    optimizer_states: int
    host_bytes: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer_states


def zero_paper_bytes(stage: int, num_params: int, world_size: int, *, mixed: bool) -> float:
    """The per-rank model-state bytes [Note: ZeRO memory] predicts for Adam."""
    psi, n = float(num_params), float(world_size)
    if mixed:
        return {1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]
    return {1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]
