"""The links between a run's nodes, as pc-estimate's step time counts
the data-parallel collectives over them."""

from __future__ import annotations

from dataclasses import dataclass

from pc_train.hardware import DeviceInfo

__all__ = ["Links"]


@dataclass(frozen=True)
class Links:
    """The nodes a run spans and the bandwidth between them (bytes/s per
    rank); inside a node collectives run at the device's bandwidth."""

    nodes: int = 1
    inter_bandwidth: float | None = None

    def data_parallel_seconds(
        self, units: int, model_bytes: float, n: int, two_level: bool, device: DeviceInfo
    ) -> float:
        """Seconds of the data-parallel collectives over ``n`` ranks, each
        moving ``units`` times the model part's ``model_bytes`` (2: an
        all-reduce, or a reduce-scatter and an all-gather; 3: ZeRO-3's two
        gathers and a reduce-scatter). With a node-aware algorithm over k
        nodes of m of the group's ranks, (m - 1) / m of each moves inside a
        node and (k - 1) / k of it crosses nodes, split over the node's m
        ranks (benchmarks/bench_internode_bytes.py counts the same);
        two-level sharding keeps every collective in the node but one
        all-reduce of each rank's 1/m across the nodes."""
        if n <= 1:
            return 0.0
        k = min(self.nodes, n)
        if k == 1:
            return units * (n - 1) / n * model_bytes / device.bandwidth
        m = n / k
        inside = units * (m - 1) / m * model_bytes
        across = (2 if two_level else units) * (k - 1) / k * model_bytes / m
        return inside / device.bandwidth + across / (self.inter_bandwidth or device.bandwidth)
