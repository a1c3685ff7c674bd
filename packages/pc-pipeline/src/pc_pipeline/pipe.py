"""The haiscale-compatible front: ``GPipe``, ``PipeDream``, ``Interleaved1F1B``
and ``ZeroBubble`` wrap this rank's stage(s) and run a schedule per step.

Every rank of the pipeline calls ``forward_backward`` with the same batch
(the first stage reads the inputs, the last the labels); the batch is split
into ``chunks`` microbatches along dimension 0. Gradients are the sum over
microbatches of each microbatch loss's gradient, as haiscale's; with
``scale_grads=True`` the mean [Note: gradient scale] in pc_pipeline.options.
"""

from __future__ import annotations

import gc
import platform
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pc_comm import Communicator, ShmCommunicator, TorchCommunicator, on_one_host
from pc_pipeline.actions import Action
from pc_pipeline.builders import gpipe, interleaved_1f1b, one_f_one_b, zero_bubble_h1
from pc_pipeline.executor import StepInputs, run_schedule
from pc_pipeline.options import CheckpointMode, parse_checkpoint
from pc_pipeline.schedule import Schedule
from pc_pipeline.shapes import TensorMeta, infer_boundary_metas
from pc_pipeline.validation import validate

__all__ = ["GPipe", "Interleaved1F1B", "PipeDream", "Pipeline", "ZeroBubble"]

ScheduleBuilder = Callable[[int, int], Schedule]


def _split(value: Any, chunks: int, what: str) -> list[Any]:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] % chunks:
            size = value.shape[0] if value.dim() else "a scalar"
            fits = [
                c
                for c in range(1, (value.shape[0] if value.dim() else 1) + 1)
                if value.dim() and value.shape[0] % c == 0
            ]
            raise ValueError(
                f"{what} has batch size {size}, which does not split into chunks={chunks} "
                f"equal microbatches; use a batch size that is a multiple of {chunks}, or "
                f"chunks in {fits}."
            )
        return list(value.chunk(chunks))
    return [value] * chunks  # not a tensor: every microbatch gets it as is


def _concat(outputs: list[Any]) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs)
    if isinstance(first, (tuple, list)):
        return type(first)(_concat([o[k] for o in outputs]) for k in range(len(first)))
    return outputs


def _default_communicator(group: dist.ProcessGroup | None, device: torch.device) -> Communicator:
    """Shared memory between host-resident stages on one x86-64 host (no
    sockets, no transport threads; see pc_comm.shm_p2p); torch.distributed
    otherwise (NCCL for CUDA stages, gloo across hosts)."""
    x86_host = device.type == "cpu" and platform.machine().lower() in {"x86_64", "amd64"}
    if x86_host and on_one_host(group):  # the same answer on every rank, so collective-safe
        return ShmCommunicator(group)
    return TorchCommunicator(group)


class Pipeline(nn.Module):
    """Run this rank's stages under any schedule.

    ``modules`` are this rank's stages in chunk order (stage ``c *
    num_ranks + rank`` for chunk ``c``); ``schedule`` is a builder
    ``(num_ranks, num_microbatches) -> Schedule`` or a fixed ``Schedule``.
    If a peer fails mid-step, this rank raises within ``timeout`` seconds
    instead of waiting for it forever. Stages talk through ``communicator``:
    by default shared memory when every rank is on this (x86-64) host and the
    stages live in host memory, torch.distributed over ``process_group``
    otherwise. The wrappers below take ``timeout``
    and ``checkpoint`` as keywords too.

    ``checkpoint``: ``"never"`` (or False), ``"always"`` (or True) or
    ``"except_last"`` (every microbatch but the last recomputes its
    activations in backward). ``scale_grads``: False sums the microbatch
    gradients (haiscale's semantics: divide each microbatch's loss by
    ``chunks`` in the criterion for the batch mean), True divides each
    microbatch's loss by ``chunks`` first [Note: gradient scale].
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        chunks: int,
        schedule: ScheduleBuilder | Schedule,
        process_group: dist.ProcessGroup | None = None,
        *,
        checkpoint: bool | str | CheckpointMode = False,
        timeout: float = 300.0,
        communicator: Communicator | None = None,
        scale_grads: bool = False,
    ) -> None:
        super().__init__()
        if communicator is not None and process_group is not None:
            raise ValueError(
                "pass either process_group or communicator, not both: a communicator "
                "already knows its ranks."
            )
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout}.")
        self.timeout = timeout  # a failed peer surfaces as an error here within it
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(
                f"chunks must be a positive int (microbatches per step), got {chunks!r}."
            )
        if not modules:
            raise ValueError("a pipeline rank needs at least one stage module.")
        params = [p for m in modules for p in m.parameters()]
        self.device = params[0].device if params else torch.device("cpu")
        self.comm = (
            communicator
            if communicator is not None
            else _default_communicator(process_group, self.device)
        )
        if not isinstance(scale_grads, bool):
            raise TypeError(f"scale_grads must be True or False, got {scale_grads!r}.")
        self.chunks = chunks
        self.checkpoint = parse_checkpoint(checkpoint)  # which microbatches recompute
        # [Note: gradient scale]: False sums microbatch gradients (haiscale).
        self.scale_grads = scale_grads
        ranks, rank = self.comm.world_size, self.comm.rank
        # The builder, kept so set_chunks can build the schedule for another count.
        self._builder = None if isinstance(schedule, Schedule) else schedule
        self.schedule = schedule if isinstance(schedule, Schedule) else schedule(ranks, chunks)
        validate(self.schedule)
        if self.schedule.num_ranks != ranks or self.schedule.num_microbatches != chunks:
            raise ValueError(
                f"schedule {self.schedule.name!r} is for {self.schedule.num_ranks} ranks and "
                f"{self.schedule.num_microbatches} microbatches; this pipeline has {ranks} "
                f"ranks and chunks={chunks}."
            )
        stages = self.schedule.stages_of(rank)
        if len(stages) != len(modules):
            raise ValueError(
                f"rank {rank} runs stages {stages} under schedule {self.schedule.name!r} but "
                f"got {len(modules)} module(s); pass one module per stage."
            )
        self.stages = nn.ModuleList(modules)  # registered: .parameters() feeds the optimizer
        self._by_stage = dict(zip(stages, modules, strict=True))
        self._eval_schedule = self.schedule.forwards()
        self._metas: dict[tuple[Any, ...], dict[int, list[TensorMeta]]] = {}
        # Set record_timeline = True to keep the next steps' compute spans
        # in self.timeline: (action, start, end) seconds from the step start.
        self.record_timeline = False
        self.timeline: list[tuple[Action, float, float]] = []

    def set_chunks(self, chunks: int) -> None:
        """Split the next steps' batches into ``chunks`` microbatches (the
        schedule is rebuilt for that count; the same on every rank)."""
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(
                f"chunks must be a positive int (microbatches per step), got {chunks!r}."
            )
        if chunks == self.chunks:
            return
        if self._builder is None:
            raise ValueError(
                f"this pipeline runs the fixed schedule {self.schedule.name!r} for "
                f"{self.chunks} microbatches; build it from a schedule builder to change it."
            )
        schedule = self._builder(self.comm.world_size, chunks)
        validate(schedule)
        self.schedule, self.chunks = schedule, chunks
        self._eval_schedule = schedule.forwards()

    @property
    def module(self) -> nn.Module:
        """This rank's stage module as it was passed in (a pc-comm DDP wrapper
        included), whose ``state_dict()`` is the stage's own keys: what
        haiscale programs save. With several stages (interleaved), an
        ``nn.ModuleList`` of them in chunk order."""
        return self.stages[0] if len(self.stages) == 1 else self.stages

    @property
    def is_first_stage(self) -> bool:
        return 0 in self._by_stage

    @property
    def is_last_stage(self) -> bool:
        return self.schedule.num_stages - 1 in self._by_stage

    def _boundary_metas(self, first: Sequence[torch.Tensor]) -> dict[int, list[TensorMeta]]:
        key = tuple((tuple(t.shape), t.dtype) for t in first)
        if key not in self._metas:
            self._metas[key] = infer_boundary_metas(
                self._by_stage, self.schedule.stage_rank, self.comm, first, self.device,
                timeout=self.timeout,
            )  # fmt: skip
            # [Note: shape inference leaves cycles] Running a stage on fake
            # tensors (and, where they fail, on zeros) leaves reference cycles
            # (torch's fake-tensor caches, an exception's traceback and its
            # frames) that hold tensors until the garbage collector runs, so
            # the first steps' peak depended on when it did (measured: 3.4 MiB
            # of a Mixtral stage's tensors alive through the next step). Once
            # per input shape, they are collected here.
            gc.collect()
        return self._metas[key]

    def _run(
        self,
        schedule: Schedule,
        inputs: tuple[Any, ...],
        criterion: Callable[..., torch.Tensor] | None,
        labels: Sequence[Any],
        return_outputs: bool,
        train: bool,
    ) -> tuple[torch.Tensor | None, Any]:
        if not inputs:
            raise ValueError("pass the batch's inputs (every rank passes the same batch).")
        for x in inputs:
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"pipeline inputs must be tensors, got {type(x).__name__}.")
        parts = [_split(x, self.chunks, f"input {k}") for k, x in enumerate(inputs)]
        micro = [tuple(p[m] for p in parts) for m in range(self.chunks)]
        label_parts = [_split(y, self.chunks, f"label {k}") for k, y in enumerate(labels)]
        micro_labels = [tuple(p[m] for p in label_parts) for m in range(self.chunks)]
        metas = self._boundary_metas(micro[0])
        step = StepInputs(
            microbatches=micro,
            labels=micro_labels,
            criterion=criterion,
            loss_scale=1.0 / self.chunks if self.scale_grads else 1.0,
            return_outputs=return_outputs,
            train=train,
            checkpoint=self.checkpoint,
            timeout=self.timeout,
            record=self.record_timeline,
        )
        result = run_schedule(schedule, self._by_stage, self.comm, metas, step, self.device)
        self.timeline = result.timeline
        if not self.is_last_stage:
            return None, None
        losses = torch.stack(result.losses) if result.losses else None
        outputs = _concat(result.outputs) if result.outputs else None
        return losses, outputs

    def forward_backward(
        self,
        *inputs: torch.Tensor,
        criterion: Callable[..., torch.Tensor],
        labels: Sequence[Any] = (),
        return_outputs: bool = False,
    ) -> tuple[torch.Tensor | None, Any]:
        """One training step's forward and backward. On the last stage's
        rank: ``(losses, outputs)`` with one loss per microbatch and the
        outputs concatenated (None unless ``return_outputs``); elsewhere
        ``(None, None)``. ``criterion(output, *labels)`` returns a
        microbatch's scalar loss; the gradients are the sum of the
        microbatch losses' gradients, or their mean with ``scale_grads=True``
        [Note: gradient scale]. The losses returned are the criterion's."""
        if not callable(criterion):
            raise TypeError("forward_backward needs criterion=callable(output, *labels) -> loss.")
        return self._run(self.schedule, inputs, criterion, labels, return_outputs, train=True)

    def forward(self, *inputs: torch.Tensor) -> Any:
        """Evaluation forward under ``no_grad``: the output on the last
        stage's rank, None elsewhere."""
        _, outputs = self._run(self._eval_schedule, inputs, None, (), True, train=False)
        return outputs


class _OneStagePipeline(Pipeline):
    """A pipeline with one stage per rank under the class's ``builder``."""

    builder: ScheduleBuilder

    def __init__(
        self,
        module: nn.Module,
        chunks: int,
        process_group: dist.ProcessGroup | None = None,
        *,
        checkpoint: bool | str | CheckpointMode = False,
        timeout: float = 300.0,
        communicator: Communicator | None = None,
        scale_grads: bool = False,
    ) -> None:
        super().__init__(
            [module],
            chunks,
            type(self).builder,
            process_group,
            checkpoint=checkpoint,
            timeout=timeout,
            communicator=communicator,
            scale_grads=scale_grads,
        )


class GPipe(_OneStagePipeline):
    """GPipe: all microbatches forward, then all backward."""

    builder = staticmethod(gpipe)


class PipeDream(_OneStagePipeline):
    """1F1B (PipeDream-flush): GPipe's bubble with at most ``num_ranks``
    microbatches' activations alive per rank."""

    builder = staticmethod(one_f_one_b)


class ZeroBubble(_OneStagePipeline):
    """ZB-H1: 1F1B with backward split into input and weight gradients;
    weight gradients fill the bubble. Under activation checkpointing the input and
    the weight gradient each recompute the stage's forward (two backward
    passes over one graph), so it costs one forward more than elsewhere."""

    builder = staticmethod(zero_bubble_h1)


class Interleaved1F1B(Pipeline):
    """Interleaved 1F1B: ``modules`` are this rank's model chunks (from
    ``partition(..., num_model_chunks=v)``); the bubble shrinks by ``v``."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        chunks: int,
        process_group: dist.ProcessGroup | None = None,
        *,
        checkpoint: bool | str | CheckpointMode = False,
        timeout: float = 300.0,
        communicator: Communicator | None = None,
        scale_grads: bool = False,
    ) -> None:
        if not isinstance(modules, (list, tuple, nn.ModuleList)):
            raise TypeError(
                "Interleaved1F1B takes this rank's list of model chunks; use "
                "partition(model, rank, world_size, num_model_chunks=v)."
            )
        count = len(modules)

        def build(ranks: int, microbatches: int) -> Schedule:
            return interleaved_1f1b(ranks, microbatches, count)

        super().__init__(
            list(modules),
            chunks,
            build,
            process_group,
            checkpoint=checkpoint,
            timeout=timeout,
            communicator=communicator,
            scale_grads=scale_grads,
        )
