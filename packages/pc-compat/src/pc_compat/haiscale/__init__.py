"""``haiscale``: ``ddp``, ``fsdp``, ``pipeline`` and ``cpu_offload`` over pc."""

from __future__ import annotations

from pc_compat.haiscale import cpu_offload, ddp, fsdp, pipeline

__all__ = ["cpu_offload", "ddp", "fsdp", "pipeline"]
