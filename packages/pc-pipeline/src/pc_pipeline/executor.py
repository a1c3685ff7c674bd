"""Run one rank's part of a schedule.

The executor only walks the action list; what to run when is the
schedule's business. Consecutive sends and receives are posted together as
one batch (asynchronously); a received tensor is waited for by the action
that consumes it; sends are waited for at the end of the step
[Note: communication semantics, in pc_pipeline.schedule].
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from pc_comm import Communicator, DistributedDataParallel, Handle, P2PKind, P2POp, PeerFailureError
from pc_pipeline.actions import Action, ActionKind
from pc_pipeline.options import CheckpointMode
from pc_pipeline.schedule import Schedule
from pc_pipeline.shapes import TensorMeta, flatten_output
from pc_pipeline.split_backward import WeightGradWork, backward_input, backward_weight

__all__ = ["StepInputs", "StepResult", "run_schedule"]

Key = tuple[int, int]  # (stage, microbatch)


@dataclass
class StepResult:
    """Per-microbatch losses and outputs; empty on ranks without the last stage."""

    losses: list[torch.Tensor] = field(default_factory=list)
    outputs: list[Any] = field(default_factory=list)
    # With StepInputs.record: (action, start, end) in seconds from the step's start.
    timeline: list[tuple[Action, float, float]] = field(default_factory=list)


@dataclass
class _State:
    inputs: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    outputs: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    input_grads: dict[Key, list[torch.Tensor | None]] = field(default_factory=dict)
    received: dict[Action, tuple[list[torch.Tensor], list[Handle]]] = field(default_factory=dict)
    weight_work: dict[Key, WeightGradWork] = field(default_factory=dict)
    sends: list[Handle] = field(default_factory=list)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    results: dict[int, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepInputs:
    microbatches: Sequence[Sequence[torch.Tensor]]
    labels: Sequence[Sequence[Any]]
    criterion: Callable[..., torch.Tensor] | None
    loss_scale: float  # each microbatch's loss is multiplied by it before backward
    return_outputs: bool
    train: bool
    checkpoint: CheckpointMode
    timeout: float  # seconds to wait for any one received tensor
    record: bool = False  # keep each compute action's wall-clock span


class _Runner:
    def __init__(
        self,
        schedule: Schedule,
        modules: dict[int, nn.Module],
        comm: Communicator,
        metas: dict[int, list[TensorMeta]],
        step: StepInputs,
        device: torch.device,
    ) -> None:
        self.schedule = schedule
        self.modules = modules
        self.comm = comm
        self.metas = metas
        self.step = step
        self.device = device
        self.last = schedule.num_stages - 1
        self.state = _State()
        acts = schedule.actions[comm.rank]
        # The last backward action of each DDP stage: its gradients are
        # reduced over the data-parallel group right after it.
        self.final_backward: dict[int, int] = {}
        for i, a in enumerate(acts):
            if a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
                self.final_backward[a.stage] = i

    # ------------------------------------------------------------ messages

    def _peer(self, action: Action) -> int:
        return self.schedule.stage_rank[action.peer_action().stage]

    def _post(self, batch: list[Action]) -> None:
        # A finished send no longer needs its tensor: let it go, so 1F1B keeps
        # its memory bound instead of holding every sent activation to the end.
        self.state.sends = [h for h in self.state.sends if not h.is_completed()]
        ops: list[P2POp] = []
        pending: list[tuple[Action, list[torch.Tensor], int]] = []
        for a in batch:
            peer = self._peer(a)
            if a.kind is ActionKind.SEND_F:
                tensors = [
                    t.detach().contiguous() for t in self.state.outputs[(a.stage, a.microbatch)]
                ]
                ops += [P2POp(P2PKind.SEND, t, peer) for t in tensors]
            elif a.kind is ActionKind.SEND_B:
                grads = self.state.input_grads.pop((a.stage, a.microbatch))
                metas = self.metas[a.stage]
                tensors = [
                    (
                        g
                        if g is not None
                        else torch.zeros(m.shape, dtype=m.dtype, device=self.device)
                    ).contiguous()
                    for g, m in zip(grads, metas, strict=True)
                    if m.requires_grad
                ]
                ops += [P2POp(P2PKind.SEND, t, peer) for t in tensors]
            else:
                stage = a.stage if a.kind is ActionKind.RECV_F else a.stage + 1
                wanted = [
                    m for m in self.metas[stage] if a.kind is ActionKind.RECV_F or m.requires_grad
                ]
                buffers = [m.empty(self.device) for m in wanted]
                start = len(ops)
                ops += [P2POp(P2PKind.RECV, b, peer) for b in buffers]
                pending.append((a, buffers, start))
        handles = self.comm.batch_p2p(ops)
        is_recv = [op.kind is P2PKind.RECV for op in ops]
        self.state.sends += [h for h, r in zip(handles, is_recv, strict=True) if not r]
        for a, buffers, start in pending:
            self.state.received[a] = (buffers, handles[start : start + len(buffers)])

    def _await_inputs(self, action: Action) -> None:
        """Wait for the tensors a compute action receives from another rank."""
        s, kind, m = action
        if kind is ActionKind.FORWARD:
            pending = Action(s, ActionKind.RECV_F, m)
        elif kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT):
            pending = Action(s, ActionKind.RECV_B, m)
        else:
            return
        if pending in self.state.received:
            self._wait(pending)

    def _take(self, action: Action) -> list[torch.Tensor]:
        self._wait(action)
        return self.state.received.pop(action)[0]

    def _wait(self, action: Action) -> None:
        _, handles = self.state.received[action]
        try:
            for handle in handles:
                handle.wait(timeout=self.step.timeout)
        except (TimeoutError, RuntimeError) as error:
            peer = self._peer(action)
            if isinstance(error, PeerFailureError):  # the communicator knows the peer died
                raise PeerFailureError(
                    f"{error} (Pipeline rank {self.comm.rank} failed while waiting for "
                    f"{action} from rank {peer}, {action.peer_action()} there, in schedule "
                    f"{self.schedule.name!r}.)",
                    error.op,
                    error.suspects,
                ) from error
            why = "nothing came" if isinstance(error, TimeoutError) else "the connection broke"
            raise RuntimeError(
                f"pipeline rank {self.comm.rank} failed while waiting for {action} from rank "
                f"{peer} ({action.peer_action()} there) in schedule {self.schedule.name!r}: "
                f"{why} within {self.step.timeout:g} s, so that rank failed or is stuck; its "
                "own error says why. Raise timeout= on the pipeline if its steps are "
                f"legitimately slower. ({type(error).__name__}: {error})"
            ) from error

    # ------------------------------------------------------------ compute

    def _stage_inputs(self, s: int, m: int) -> list[torch.Tensor]:
        if s == 0:
            return list(self.step.microbatches[m])
        metas = self.metas[s]
        if self.schedule.stage_rank[s - 1] == self.comm.rank:
            values = [t.detach() for t in self.state.outputs[(s - 1, m)]]
        else:
            values = self._take(Action(s, ActionKind.RECV_F, m))
        grad_ok = self.step.train
        return [
            v.requires_grad_(grad_ok and meta.requires_grad)
            for v, meta in zip(values, metas, strict=True)
        ]

    def forward(self, s: int, m: int) -> None:
        args = self._stage_inputs(s, m)
        module = self.modules[s]
        count = self.schedule.num_microbatches
        if self.step.train and self.step.checkpoint.applies(m, count):
            out = activation_checkpoint(module, *args, use_reentrant=False)
        else:
            out = module(*args)
        if s < self.last:
            self.state.outputs[(s, m)] = flatten_output(out, s)
            if self.step.train:
                self.state.inputs[(s, m)] = args
            return
        if self.step.return_outputs or self.step.criterion is None:
            self.state.results[m] = _detach(out)
        if self.step.criterion is not None:
            loss = self.step.criterion(out, *self.step.labels[m])
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError(
                    "criterion must return a scalar tensor (reduce the loss over the "
                    f"microbatch), got {type(loss).__name__} "
                    f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}."
                )
            self.state.losses[m] = loss.detach()
            if self.step.train:
                scaled = loss.reshape(())
                if self.step.loss_scale != 1.0:
                    scaled = scaled * self.step.loss_scale
                self.state.outputs[(s, m)] = [scaled]
                self.state.inputs[(s, m)] = args

    def _roots(self, s: int, m: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        outputs = self.state.outputs.pop((s, m))
        if s == self.last:
            return outputs, [None]
        if self.schedule.stage_rank[s + 1] == self.comm.rank:
            grads = self.state.input_grads.pop((s + 1, m))
        else:
            received: list[torch.Tensor | None] = list(self._take(Action(s, ActionKind.RECV_B, m)))
            grads = []
            it = iter(received)
            for meta in self.metas[s + 1]:
                grads.append(next(it) if meta.requires_grad else None)
        pairs = [
            (o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad and g is not None
        ]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def backward(self, s: int, m: int, split: bool) -> None:
        roots, grads = self._roots(s, m)
        inputs = self.state.inputs.pop((s, m))
        with self._no_sync(s):
            if split:
                wanted = [x for x in inputs if x.requires_grad]
                params = [p for p in self.modules[s].parameters() if p.requires_grad]
                got, work = backward_input(roots, grads, wanted, params)
                self.state.weight_work[(s, m)] = work
                by_id = {id(x): g for x, g in zip(wanted, got, strict=True)}
                input_grads = [by_id.get(id(x)) for x in inputs]
            else:
                if roots:
                    torch.autograd.backward(roots, grads)
                input_grads = [x.grad if x.requires_grad else None for x in inputs]
        if s > 0:
            self.state.input_grads[(s, m)] = input_grads

    def weight(self, s: int, m: int) -> None:
        with self._no_sync(s):
            backward_weight(self.state.weight_work.pop((s, m)))

    @contextlib.contextmanager
    def _no_sync(self, s: int) -> Iterator[None]:
        module = self.modules[s]
        if isinstance(module, DistributedDataParallel):
            with module.no_sync():
                yield
        else:
            yield

    def run(self) -> StepResult:
        acts = self.schedule.actions[self.comm.rank]
        batch: list[Action] = []
        timeline: list[tuple[Action, float, float]] = []
        origin = time.perf_counter()
        for i, a in enumerate(acts):
            if not a.kind.is_compute:
                batch.append(a)
                continue
            if batch:
                self._post(batch)
                batch = []
            s, kind, m = a
            self._await_inputs(a)  # outside the span: waiting is bubble, not work
            began = time.perf_counter()
            if kind is ActionKind.FORWARD:
                self.forward(s, m)
            elif kind is ActionKind.BACKWARD:
                self.backward(s, m, split=False)
            elif kind is ActionKind.BACKWARD_INPUT:
                self.backward(s, m, split=True)
            else:
                self.weight(s, m)
            if self.step.record:
                timeline.append((a, began - origin, time.perf_counter() - origin))
            module = self.modules[s]
            if self.final_backward.get(s) == i and isinstance(module, DistributedDataParallel):
                module.sync_gradients()
        if batch:
            self._post(batch)
        for handle in self.state.sends:
            handle.wait(timeout=self.step.timeout)
        assert not self.state.received, f"receives never consumed: {list(self.state.received)}"
        count = self.schedule.num_microbatches
        result = StepResult(timeline=timeline)
        if self.last in self.modules:
            result.losses = [self.state.losses[m] for m in range(count) if m in self.state.losses]
            result.outputs = [
                self.state.results[m] for m in range(count) if m in self.state.results
            ]
        return result


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detach(v) for v in value)
    return value


def run_schedule(
    schedule: Schedule,
    modules: dict[int, nn.Module],
    comm: Communicator,
    metas: dict[int, list[TensorMeta]],
    step: StepInputs,
    device: torch.device,
) -> StepResult:
    """Run this rank's actions of ``schedule`` (``modules``: stage -> module)."""
    with torch.set_grad_enabled(step.train):
        return _Runner(schedule, modules, comm, metas, step, device).run()
