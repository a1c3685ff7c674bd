"""``haiscale.ddp``: ``DistributedDataParallel`` (pc-comm's hfreduce-style one)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from pc_comm import DistributedDataParallel as _PcDDP

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(_PcDDP):
    """haiscale's ``DistributedDataParallel(module, device_ids=None,
    process_group=None, bucket_cap_mb=..., ...)``. ``device_ids``: the one
    device this rank's replica lives on, as torch's DDP takes it; the module
    must already be there (haiscale's does not move it either), and a list
    naming more than one device is refused (one device per process)."""

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float = 25.0,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = True,
    ) -> None:
        if device_ids is not None and len(list(device_ids)) > 1:
            raise ValueError(
                f"DistributedDataParallel(device_ids={list(device_ids)}): one process drives "
                "one device; pass the one device of this rank, or None."
            )
        super().__init__(
            module,
            process_group,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            broadcast_buffers=broadcast_buffers,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
        # As given (torch's and haiscale's DDP keep it too).
        self.device_ids = list(device_ids) if device_ids is not None else None
