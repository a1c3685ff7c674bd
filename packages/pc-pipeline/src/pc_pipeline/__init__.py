"""Pipeline parallelism with schedules as data.

A :class:`Schedule` lists, per rank, the actions of one step (``F``, ``B``,
split ``I``/``W``, sends and receives). Builders make GPipe, 1F1B,
interleaved 1F1B and ZB-H1 schedules; :func:`validate`, :func:`simulate`
and :func:`draw_text` / :func:`draw_png` work without a process group; the
executor runs a schedule over pc-comm. ``GPipe``, ``PipeDream``,
``Interleaved1F1B``, ``SequentialModel``, ``partition`` and
``make_subgroups`` keep haiscale's names and call shapes (and its summed
microbatch gradients; ``scale_grads=True`` averages them).
"""

from pc_comm import make_subgroups
from pc_pipeline.actions import Action, ActionKind
from pc_pipeline.builders import gpipe, interleaved_1f1b, one_f_one_b, zero_bubble_h1
from pc_pipeline.draw import draw_png, draw_text
from pc_pipeline.options import CheckpointMode
from pc_pipeline.partition import (
    Sequential,
    SequentialModel,
    balanced_split,
    measure_costs,
    partition,
)
from pc_pipeline.pipe import GPipe, Interleaved1F1B, PipeDream, Pipeline, ZeroBubble
from pc_pipeline.schedule import Schedule, ScheduleError, format_grid, with_communication
from pc_pipeline.simulate import Costs, Simulation, Span, simulate
from pc_pipeline.validation import validate

__version__ = "0.1.0"

__all__ = [
    "Action",
    "ActionKind",
    "CheckpointMode",
    "Costs",
    "GPipe",
    "Interleaved1F1B",
    "PipeDream",
    "Pipeline",
    "Schedule",
    "ScheduleError",
    "Sequential",
    "SequentialModel",
    "Simulation",
    "Span",
    "ZeroBubble",
    "balanced_split",
    "draw_png",
    "draw_text",
    "format_grid",
    "gpipe",
    "interleaved_1f1b",
    "make_subgroups",
    "measure_costs",
    "one_f_one_b",
    "partition",
    "simulate",
    "validate",
    "with_communication",
    "zero_bubble_h1",
]
