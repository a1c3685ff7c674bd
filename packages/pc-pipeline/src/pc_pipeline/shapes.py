"""What crosses each stage boundary: shapes, dtypes, requires_grad.

[Note: shapes before the step]
A rank posts a receive before the tensor's producer has run (the schedule
may post it early; see pc_pipeline.schedule), so it must know the shapes in
advance. They depend only on the microbatch's shapes, which every rank
knows (every rank gets the same batch). On the first step with new shapes,
the ranks pass small headers along the stages in order; each rank runs its
stages on fake tensors (no compute, no random numbers drawn; buffers a
forward would update are restored) to find its outputs; a stage fake tensors
cannot run (a kernel without a fake implementation on this device) runs
once on zeros instead, with a forked random generator. The table is cached
per microbatch signature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from pc_comm import Communicator

__all__ = ["TensorMeta", "flatten_output", "infer_boundary_metas"]

_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
_MAX_TENSORS = 16
_MAX_DIMS = 8
_HEADER = 1 + _MAX_TENSORS * (3 + _MAX_DIMS)


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        return cls(tuple(tensor.shape), tensor.dtype, tensor.requires_grad)

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def flatten_output(output: Any, stage: int) -> list[torch.Tensor]:
    """A stage returns a tensor or a tuple/list of tensors."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in output):
        return list(output)
    raise TypeError(
        f"stage {stage} returned {type(output).__name__}; a pipeline stage must return a "
        "tensor or a tuple of tensors (the next stage is called with them as arguments)."
    )


def _encode(metas: Sequence[TensorMeta], device: torch.device) -> torch.Tensor:
    if len(metas) > _MAX_TENSORS:
        raise ValueError(f"a stage passes {len(metas)} tensors on; at most {_MAX_TENSORS} fit.")
    header = torch.zeros(_HEADER, dtype=torch.int64)
    header[0] = len(metas)
    for k, meta in enumerate(metas):
        if len(meta.shape) > _MAX_DIMS or meta.dtype not in _DTYPES:
            raise ValueError(
                f"cannot pass a {meta.dtype} tensor of shape {meta.shape} between stages: "
                f"supported are up to {_MAX_DIMS} dims and dtypes {_DTYPES}."
            )
        base = 1 + k * (3 + _MAX_DIMS)
        header[base] = _DTYPES.index(meta.dtype)
        header[base + 1] = int(meta.requires_grad)
        header[base + 2] = len(meta.shape)
        header[base + 3 : base + 3 + len(meta.shape)] = torch.tensor(meta.shape)
    return header.to(device)


def _decode(header: torch.Tensor) -> list[TensorMeta]:
    values = header.tolist()
    metas = []
    for k in range(values[0]):
        base = 1 + k * (3 + _MAX_DIMS)
        ndim = values[base + 2]
        shape = tuple(values[base + 3 : base + 3 + ndim])
        metas.append(TensorMeta(shape, _DTYPES[values[base]], bool(values[base + 1])))
    return metas


def _real_forward(
    module: nn.Module, metas: Sequence[TensorMeta], stage: int, device: torch.device
) -> list[TensorMeta]:
    """The fallback for a stage fake tensors cannot run (kernels without a
    fake implementation on this device, such as grouped expert matmuls on
    the CPU): one forward on zeros, its random numbers drawn from a forked
    generator, its graph dropped at once."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        args = []
        for meta in metas:
            zeros = torch.zeros(meta.shape, dtype=meta.dtype, device=device)
            args.append(zeros.requires_grad_(meta.requires_grad))
        out = flatten_output(module(*args), stage)
        return [TensorMeta.of(t) for t in out]


def _fake_forward(
    module: nn.Module,
    metas: Sequence[TensorMeta],
    stage: int,
    device: torch.device | None = None,
) -> list[TensorMeta]:
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        with torch.enable_grad(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
            args = []
            for meta in metas:
                fake = mode.from_tensor(torch.empty(meta.shape, dtype=meta.dtype))
                args.append(fake.requires_grad_(meta.requires_grad))
            out = flatten_output(module(*args), stage)
            return [TensorMeta.of(t) for t in out]
    except (TypeError, ValueError):
        raise  # the stage refuses its inputs or its model: its own words
    except Exception as error:
        if device is not None:
            try:
                return _real_forward(module, metas, stage, device)
            except (TypeError, ValueError):
                raise
            except Exception as real:
                raise RuntimeError(
                    f"could not find the output shapes of stage {stage}: it fails on fake "
                    f"tensors ({type(error).__name__}: {error}) and on zeros "
                    f"({type(real).__name__}: {real})."
                ) from real
        raise RuntimeError(
            f"could not find the output shapes of stage {stage} by running it on fake "
            f"tensors ({type(error).__name__}: {error}). Stages must be traceable with "
            "torch's FakeTensorMode (no data-dependent shapes)."
        ) from error
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def infer_boundary_metas(
    modules: dict[int, nn.Module],
    stage_rank: Sequence[int],
    comm: Communicator,
    first_inputs: Sequence[torch.Tensor],
    device: torch.device,
    timeout: float | None = None,
) -> dict[int, list[TensorMeta]]:
    """Input metas of every stage this rank runs (after stage 0), and output
    metas of every stage it runs but the last [Note: shapes before the step].
    ``timeout``: seconds to wait for a previous stage's shapes.
    Keys: ``s`` for stage ``s``'s input; the output of ``s`` is the input of
    ``s + 1``."""
    me = comm.rank
    last = len(stage_rank) - 1
    metas: dict[int, list[TensorMeta]] = {
        0: [TensorMeta(tuple(t.shape), t.dtype, False) for t in first_inputs]
    }
    for s in range(len(stage_rank)):
        if stage_rank[s] != me:
            continue
        if s > 0 and stage_rank[s - 1] != me:
            header = torch.empty(_HEADER, dtype=torch.int64, device=device)
            handle = comm.recv(header, stage_rank[s - 1], async_op=True)
            try:
                handle.wait(timeout)
            except (TimeoutError, RuntimeError) as error:
                raise RuntimeError(
                    f"pipeline rank {me} waited for the shapes stage {s - 1} sends from rank "
                    f"{stage_rank[s - 1]} (the first step with new shapes): nothing came "
                    f"within {timeout} s, so that rank failed or is stuck; its own error "
                    f"says why. ({type(error).__name__}: {error})"
                ) from error
            metas[s] = _decode(header.cpu())
        if s == last:
            continue
        metas[s + 1] = _fake_forward(modules[s], metas[s], s, device)
        if stage_rank[s + 1] != me:
            comm.send(_encode(metas[s + 1], device), stage_rank[s + 1])
    return metas
