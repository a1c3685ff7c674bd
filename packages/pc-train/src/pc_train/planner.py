"""The planner: every layout pc trains, searched for one model on one
cluster, ranked by predicted throughput among those that fit.

[Note: the planner]
For ``nodes`` x ``per_node`` ranks and a global batch of sequences, the
candidates are every plugin with every option pc-train exposes that
changes memory or time: data parallelism (DDP; ZeRO-1/2, also sharded in
each node and replicated across nodes with ``extra_dp``), ZeRO-3 (FSDP2,
Gemini; over tensor parallelism with ``tp``; Gemini two-level), and the
hybrid plugin's tensor (with and without Megatron's sequence parallelism),
pipeline (1F1B, zero bubble, and interleaved where 2 pp stages divide the
blocks: [Note: pipeline schedules in the estimate]) and Ulysses sequence
parallelism with ZeRO 0 or 1, and for a
mixture of experts every expert-parallel split of the hybrid layouts;
offload (ZeRO-1/2's optimizer on the host, a share of Gemini's chunks on
the host) and Gemini stepping in backward (where the run does not clip);
each with no, selective or full recomputation, and every micro-batch size
dividing the rank's share of the batch (the rest accumulated, or a
pipeline's micro-batches). Tensor parallelism stays inside a node (tp
divides the ranks per node and the head counts); a pipeline's stages
divide the blocks. Each candidate is checked by its plugin's own rules
(what they refuse is not a plan), estimated
(:func:`pc_train.cost.estimate`: per-rank memory with activations and in-
flight micro-batches; step time in parts, [Note: the step's time] in
pc_train.step_time) and kept when it fits; the plans
are ranked by predicted tokens per second, equal ones in the order searched
(the simpler layout first: DDP, ZeRO-2, ZeRO-1, FSDP2, Gemini, hybrid);
the first plan is the first searched of those predicted within 5 % of the
fastest (``NEAR``: the prediction's error is larger than that,
docs/planner.md), so a measured peak a little
faster or slower on another start does not tip the choice between
layouts predicted alike (DDP and a zero-bubble pipeline of a small model
did). A layout that
does not fit with fp32 moments (Gemini: with the least share of its
chunks on the host that fits) is tried with Adam's moments in bf16, then
in 8 bits, where its plugin stores them narrow (ZeRO-1/2, Gemini): the
least narrowing that fits, since narrow moments change the numerics
(pc_offload's [Note: low-precision optimizer states]); a layout that fits
in fp32 is never narrowed. One that fits no way in memory is tried again,
fp32 first, with the least share of the host's moments on the NVMe tier
(pc_offload [Note: the NVMe tier]; Gemini, ZeRO-1/2 with CPU offload):
exact, but read and written through the disk every step, at the
bandwidth measured ([Note: the disk's bandwidth] in pc_train.hardware).
Memory is the device's and, where known, the host's share per rank (on
a CPU they are one). ``pc-estimate --search`` prints them; ``--trial K``
runs the first K on this machine and prints each rank's measured peak
against the prediction.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from pc_train.cost import Estimate, Links, ModelShape, estimate
from pc_train.hardware import DeviceInfo
from pc_train.options import NARROW_STATES, OPTIMIZER_STATES, PluginKind, PluginOptions

__all__ = ["NEAR", "Cluster", "Plan", "candidates", "rank", "search"]

_RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``per_node`` ranks of ``device``; ``inter_bandwidth``
    between nodes (bytes/s per rank; default the device's own)."""

    nodes: int
    per_node: int
    device: DeviceInfo
    inter_bandwidth: float | None = None

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def links(self) -> Links:
        return Links(self.nodes, self.inter_bandwidth)


@dataclass(frozen=True)
class Plan:
    """A layout that fits, with its micro-batch and its estimate."""

    options: PluginOptions
    micro_batch: int
    accumulation: int
    estimate: Estimate
    order: int = 0  # its place in the search (equal predictions keep it)

    @property
    def step_seconds(self) -> float:
        """One optimizer step: every micro-batch's compute (a pipeline's are
        in its estimate); the data-parallel collectives once a step, but
        ZeRO-3's two gathers once a micro-batch."""
        e, a = self.estimate, self.accumulation
        comm = e.exposed_comm_seconds
        gathers = (2 * a + 1) / 3 if e.gathers_parameters else 1.0
        return a * (e.step_seconds - comm) + comm * gathers

    @property
    def tokens_per_second(self) -> float:
        return self.estimate.tokens_per_step * self.accumulation / self.step_seconds

    def flags(self) -> str:
        """pc-train's flags for this plan (the micro-batch as accumulation)."""
        extra = f" --accumulation {self.accumulation}" if self.accumulation > 1 else ""
        pipeline = self.options.microbatches
        extra += f" --microbatches {pipeline}" if pipeline else ""
        return self.options.flags() + extra


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


#: Plans predicted within this share of the fastest count as equally fast.
NEAR = 0.05
_OFFLOAD_STEPS = 20  # Gemini's share of chunks on the host, in steps of 5 %


def _layouts(shape: ModelShape, cluster: Cluster) -> Iterator[PluginOptions]:
    """Every plugin and model-parallel layout [Note: the planner]."""
    world, nodes = cluster.world, cluster.nodes
    kv = shape.kv_heads or shape.heads
    tps = [t for t in _divisors(cluster.per_node, 8) if shape.heads % t == 0 and kv % t == 0]
    yield PluginOptions(PluginKind.DDP)
    # Equal predictions keep this order: ZeRO-2 before ZeRO-1 (it measured
    # faster here, each rank stepping its share).
    for kind in (PluginKind.ZERO2, PluginKind.ZERO1):
        for offload in (False, True):  # the optimizer's shards and step on the host
            yield PluginOptions(kind, cpu_offload=offload)
            if nodes > 1:
                yield PluginOptions(kind, extra_dp=nodes, cpu_offload=offload)
    for tp in tps:
        yield PluginOptions(PluginKind.FSDP, tp=tp)
        yield PluginOptions(PluginKind.GEMINI, tp=tp)
    # Stepping in backward, where nothing clips (the rules refuse it otherwise).
    yield PluginOptions(PluginKind.GEMINI, step_in_backward=True)
    if nodes > 1:
        yield PluginOptions(PluginKind.GEMINI, extra_dp=nodes)
    for tp in tps:
        for pp in range(1, min(shape.layers, 16) + 1):
            if world % (tp * pp):
                continue
            for zero in (0, 1):
                hybrid = PluginOptions(PluginKind.HYBRID, tp=tp, pp=pp, zero_stage=zero)
                if shape.layers % pp:  # named, since the plugin splits only evenly itself
                    split = ",".join(map(str, hybrid.stage_blocks(shape.layers)))
                    hybrid = replace(hybrid, layers_per_stage=split)
                if tp > 1 or pp > 1:
                    yield hybrid
                if pp > 1 and not hybrid.layers_per_stage:  # the other schedules
                    yield replace(hybrid, pp_style="zbv")
                    if shape.layers % (2 * pp) == 0:
                        yield replace(hybrid, pp_style="interleaved")
                if tp > 1:
                    yield replace(hybrid, sequence_parallel=True)
                yield from _expert_layouts(shape, hybrid, world)
    for sp in (2, 4, 8):
        if sp <= cluster.per_node and world % sp == 0 and shape.heads % sp == 0:
            yield PluginOptions(PluginKind.HYBRID, sp=sp, zero_stage=1)


def _expert_layouts(
    shape: ModelShape, hybrid: PluginOptions, world: int
) -> Iterator[PluginOptions]:
    """A mixture of experts' ``ep`` splits of one hybrid layout: every ep
    dividing its data-parallel ranks and the experts of a block."""
    if not shape.experts:
        return
    dp = hybrid.dp_size(world)
    for ep in _divisors(dp, dp):
        if ep > 1 and shape.experts % ep == 0:
            yield replace(hybrid, ep=ep)


def candidates(
    shape: ModelShape, cluster: Cluster, global_batch: int
) -> Iterator[tuple[PluginOptions, int, int]]:
    """(options, micro-batch, accumulation) of every candidate."""
    for layout in _layouts(shape, cluster):
        dp = layout.dp_size(cluster.world)
        if dp < 1 or global_batch % dp:
            continue
        share = global_batch // dp
        for recompute in _RECOMPUTE:
            options = replace(layout, activation_checkpointing=recompute)
            for micro in _divisors(share, 64):
                if options.pp > 1:  # the share is one step's pipeline micro-batches
                    chunks = share // micro
                    if chunks < options.pp:
                        continue
                    yield replace(options, microbatches=chunks), micro, 1
                else:
                    yield options, micro, share // micro


def search(
    shape: ModelShape,
    cluster: Cluster,
    global_batch: int,
    seq_len: int,
    precision: str = "bf16",
    max_norm: float = 1.0,
) -> list[Plan]:
    """Every plan that fits, fastest first [Note: the planner].
    ``max_norm``: the run's clipping (0: none), which some plans refuse
    (Gemini stepping in backward cannot clip by the global norm)."""
    plans: list[Plan] = []
    for options, micro, accumulation in candidates(shape, cluster, global_batch):

        def accepted(options: PluginOptions, accumulation: int = accumulation) -> bool:
            try:
                options.check(
                    cluster.world,
                    precision,
                    shape.layers,
                    max_norm=max_norm,
                    accumulation=accumulation,
                    heads=shape.heads,
                )
            except ValueError:
                return False  # the plugin's own rules refuse it
            return True

        if not accepted(options):
            continue

        def run(options: PluginOptions, micro: int = micro) -> Estimate:
            return estimate(
                shape, options, cluster.world, micro, seq_len, precision, cluster.device,
                cluster.links,
            )  # fmt: skip

        options, result = _least_change(options, run, accepted)
        if result.fits:
            plans.append(Plan(options, micro, accumulation, result, order=len(plans)))
    return rank(plans)


def rank(plans: list[Plan]) -> list[Plan]:
    """``plans`` by predicted tokens per second, equal ones in search
    order; first, the first searched of those within ``NEAR`` of the
    fastest [Note: the planner]. Rank again after choosing among plans."""
    ranked = sorted(plans, key=lambda p: (-p.tokens_per_second, p.order))
    if ranked:
        fastest = ranked[0].tokens_per_second
        first = min(
            (p for p in ranked if p.tokens_per_second >= (1 - NEAR) * fastest),
            key=lambda p: p.order,
        )
        ranked.remove(first)
        ranked.insert(0, first)
    return ranked


def _least_change(
    options: PluginOptions,
    run: Callable[[PluginOptions], Estimate],
    accepted: Callable[[PluginOptions], bool],
) -> tuple[PluginOptions, Estimate]:
    """``options`` as given when they fit; otherwise the least change that
    fits [Note: the planner]: Gemini's least share on the host, then Adam's
    moments narrower, fp32 -> bf16 -> int8, where the plugin keeps them
    narrow on the device and its rules accept them; then the same with the
    least share of the host's moments on the NVMe tier (Gemini, ZeRO-1/2
    with CPU offload). The last tried (not fitting) when nothing does."""
    given = options
    order = OPTIMIZER_STATES[OPTIMIZER_STATES.index(options.optimizer_states) :]
    if options.kind not in NARROW_STATES:
        order = order[:1]
    result = run(options)
    for disk in (False, True):
        if disk and (result.fits or not _takes_disk(options)):
            break
        for states in order:
            narrowed = replace(given, optimizer_states=states)  # placed anew
            if narrowed != options:
                if not accepted(narrowed):
                    break
                options, result = narrowed, run(narrowed)
            if not result.device_fits and options.kind is PluginKind.GEMINI and options.tp == 1:
                options, result = _least_offload(options, run)
            if disk and not result.fits:
                options, result = _least_share(options, run, "nvme_offload_fraction")
                if not accepted(options):
                    return given, run(given)
            if result.fits:
                break
    return options, result


def _takes_disk(options: PluginOptions) -> bool:
    """Whether the NVMe tier can hold a share of these options' moments."""
    if options.kind is PluginKind.GEMINI:
        return options.tp == 1
    return options.kind in (PluginKind.ZERO1, PluginKind.ZERO2) and options.cpu_offload


def _least_offload(
    options: PluginOptions, run: Callable[[PluginOptions], Estimate]
) -> tuple[PluginOptions, Estimate]:
    """Gemini with the least share of its chunks on the host that fits the
    device (more on the host never needs more device memory)."""
    return _least_share(options, run, "offload_frac")


def _least_share(
    options: PluginOptions, run: Callable[[PluginOptions], Estimate], name: str
) -> tuple[PluginOptions, Estimate]:
    """``options`` with the least share ``name`` (in steps of 5 %) that
    fits, found by bisection: the device for Gemini's ``offload_frac``,
    everything for ``nvme_offload_fraction`` (more on disk never needs
    more of either memory); 100 % and its estimate when nothing does."""

    def at(step: int) -> PluginOptions:
        share = step / _OFFLOAD_STEPS
        if name == "offload_frac":
            return replace(options, offload_frac=share)
        return replace(options, nvme_offload_fraction=share)

    def fits(e: Estimate) -> bool:
        return e.device_fits if name == "offload_frac" else e.fits

    low, high = 0, _OFFLOAD_STEPS  # low does not fit; high is tried last
    while high - low > 1:
        middle = (low + high) // 2
        if fits(run(at(middle))):
            high = middle
        else:
            low = middle
    options = at(high)
    return options, run(options)
