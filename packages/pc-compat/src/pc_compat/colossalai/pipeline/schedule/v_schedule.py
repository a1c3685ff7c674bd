"""``colossalai.pipeline.schedule.v_schedule``: ``PipelineGraph``, the
zero-bubble V schedule's builder. pc builds its own ZB-V schedule
(``pc_pipeline.zero_bubble_h1``, ``HybridParallelPlugin(pp_style="zbv")``)
from the stage and micro-batch counts; the costs and memory bounds
Colossal-AI's search weighs have no effect on it, so ``get_v_schedule()``
returns a token the edge's HybridParallelPlugin accepts as
``scheduler_nodes`` with ``pp_style="zbv"``."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PcVSchedule", "PipelineGraph"]


@dataclass(frozen=True)
class PcVSchedule:
    """What ``PipelineGraph.get_v_schedule()`` returns: pc's ZB-V schedule
    for ``stages`` x ``microbatches`` (pc builds the actions itself)."""

    stages: int
    microbatches: int


class PipelineGraph:
    """Colossal-AI's ``PipelineGraph(n_stage, n_micro, f_cost, b_cost,
    w_cost, c_cost, f_mem, b_mem, w_mem, max_mem=None)``."""

    def __init__(
        self,
        n_stage: int,
        n_micro: int,
        f_cost: float,
        b_cost: float,
        w_cost: float,
        c_cost: float,
        f_mem: float,
        b_mem: float,
        w_mem: float,
        max_mem: float | None = None,
    ) -> None:
        if n_stage < 1 or n_micro < 1:
            raise ValueError(
                f"PipelineGraph: n_stage and n_micro must be >= 1, got {n_stage}, {n_micro}."
            )
        # The schedule's size; the costs and memory bounds have no effect on pc's.
        self.n_stage, self.n_micro = n_stage, n_micro

    def get_v_schedule(self, only_run_time: bool = False) -> PcVSchedule:
        return PcVSchedule(self.n_stage, self.n_micro)
