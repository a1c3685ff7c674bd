"""Schedules without a process group: bubble and memory theory, validation
errors with the grid, drawing, the split backward, partition."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from torch import nn

import pc_pipeline as pp
from pc_pipeline import Action, ActionKind, Schedule, ScheduleError
from pc_pipeline.split_backward import backward_input, backward_weight

SIZES = [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (3, 5)]


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_gpipe_and_1f1b_bubble_equals_theory(p: int, m: int) -> None:
    theory = (p - 1) / (m + p - 1)
    for costs in (pp.Costs(), pp.Costs(forward=1.0, backward=3.0)):
        assert pp.simulate(pp.gpipe(p, m), costs).bubble_fraction == pytest.approx(theory)
        assert pp.simulate(pp.one_f_one_b(p, m), costs).bubble_fraction == pytest.approx(theory)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (2, 8), (4, 4), (4, 8), (4, 16)])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_divides_the_bubble_by_the_chunks(p: int, m: int, v: int) -> None:
    plain = pp.simulate(pp.one_f_one_b(p, m)).bubble_ratio
    assert plain == pytest.approx((p - 1) / m)  # idle / busy
    interleaved = pp.simulate(pp.interleaved_1f1b(p, m, v)).bubble_ratio
    assert interleaved == pytest.approx(plain / v)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_zb_h1_has_less_bubble_than_1f1b_at_the_same_peak(p: int, m: int) -> None:
    costs = pp.Costs(forward=1.0, backward=2.0, backward_input=1.0, backward_weight=1.0)
    one = pp.simulate(pp.one_f_one_b(p, m), costs)
    zb = pp.simulate(pp.zero_bubble_h1(p, m), costs)
    assert zb.bubble_fraction < one.bubble_fraction
    assert max(zb.peak_activations) == max(one.peak_activations) == p
    assert sum(zb.busy) == pytest.approx(sum(one.busy))


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16)])
def test_1f1b_holds_fewer_activations_than_gpipe(p: int, m: int) -> None:
    gpipe = pp.simulate(pp.gpipe(p, m)).peak_activations
    one = pp.simulate(pp.one_f_one_b(p, m)).peak_activations
    assert gpipe == (m,) * p  # every microbatch alive at the turn
    assert one == tuple(p - r for r in range(p))  # rank r: its warm-up + 1
    assert all(a < b for a, b in zip(one, gpipe, strict=True))


def test_every_builder_validates_and_round_trips_its_text() -> None:
    for schedule in (
        pp.gpipe(3, 5),
        pp.one_f_one_b(4, 6),
        pp.interleaved_1f1b(2, 4, 3),
        pp.zero_bubble_h1(4, 5),
    ):
        pp.validate(schedule)
        for acts in schedule.actions:
            for a in acts:
                assert Action.parse(str(a)) == a
        assert "rank 0" in str(schedule)


def _rebuild(schedule: Schedule, rank: int, acts: list[Action]) -> Schedule:
    lists = [list(a) for a in schedule.actions]
    lists[rank] = acts
    return Schedule(
        schedule.name, schedule.num_microbatches, schedule.stage_rank, tuple(map(tuple, lists))
    )


def test_mismatched_send_fails_validation_and_prints_the_grid() -> None:
    good = pp.one_f_one_b(2, 3)
    acts = list(good.actions[0])
    send0 = acts.index(Action(0, ActionKind.SEND_F, 0))
    send1 = acts.index(Action(0, ActionKind.SEND_F, 1))
    acts.insert(send1, acts.pop(send0))  # rank 0 now sends microbatch 1 before 0
    with pytest.raises(ScheduleError) as info:
        pp.validate(_rebuild(good, 0, acts))
    text = str(info.value)
    assert "different orders" in text
    assert "0SEND_F1 would be received by 1RECV_F0" in text
    assert "step  rank 0" in text
    assert ">0SEND_F1<" in text  # the failing cell is marked
    assert ">1RECV_F0<" in text


def test_missing_receive_and_misordered_backward_are_reported() -> None:
    good = pp.one_f_one_b(2, 2)
    acts = [a for a in good.actions[1] if a != Action(1, ActionKind.RECV_F, 1)]
    with pytest.raises(ScheduleError, match=r"0SEND_F1 has no matching 1RECV_F1"):
        pp.validate(_rebuild(good, 1, acts))
    compute = good.compute_only()
    acts = list(compute.actions[1])
    acts.insert(0, acts.pop(acts.index(Action(1, ActionKind.BACKWARD, 0))))
    with pytest.raises(ScheduleError, match=r"1B0 runs before 1F0"):
        pp.validate(pp.with_communication(_rebuild(compute, 1, acts)))


def test_deadlock_is_found_and_marked() -> None:
    # Both ranks wait for each other's backward before their forward.
    compute = pp.gpipe(2, 2).compute_only()
    rank0 = [
        Action(0, ActionKind.FORWARD, 0),
        Action(0, ActionKind.BACKWARD, 0),
        Action(0, ActionKind.FORWARD, 1),
        Action(0, ActionKind.BACKWARD, 1),
    ]
    rank1 = [
        Action(1, ActionKind.FORWARD, 1),
        Action(1, ActionKind.BACKWARD, 1),
        Action(1, ActionKind.FORWARD, 0),
        Action(1, ActionKind.BACKWARD, 0),
    ]
    schedule = Schedule("crossed", 2, compute.stage_rank, (tuple(rank0), tuple(rank1)))
    with pytest.raises(ScheduleError, match="deadlock") as info:
        pp.validate(pp.with_communication(schedule))
    assert ">" in str(info.value)


def test_impossible_setups_are_rejected_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"at least 4 microbatches"):
        pp.one_f_one_b(4, 2)
    with pytest.raises(ValueError, match=r"multiple of num_ranks"):
        pp.interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match=r"stage would be empty"):
        pp.partition(pp.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 0, 2, num_model_chunks=2)
    with pytest.raises(ValueError, match=r"balance \[1, 2\]"):
        pp.partition(pp.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), 0, 2, balance=[1, 2])
    with pytest.raises(TypeError, match=r"nn.Sequential"):
        pp.partition(nn.Linear(2, 2), 0, 2)  # type: ignore[arg-type]


def test_partition_balances_parameters_and_honours_costs() -> None:
    model = pp.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10), nn.Linear(10, 10))
    first = pp.partition(model, 0, 2)
    second = pp.partition(model, 1, 2)
    assert isinstance(first, pp.Sequential)
    assert isinstance(second, pp.Sequential)
    assert len(first) + len(second) == 4
    assert [len(s) for s in pp.partition(model, 1, 2, num_model_chunks=2)] == [1, 1]  # type: ignore[arg-type]
    heavy_first = pp.partition(model, 0, 2, costs=[10.0, 1.0, 1.0, 1.0])
    assert len(heavy_first) == 1
    assert pp.balanced_split([3, 3, 3, 1, 1, 1], 3) in ([2, 3, 1], [1, 2, 3], [2, 2, 2])
    costs = pp.measure_costs(model, torch.randn(4, 10))
    assert len(costs) == 4
    assert all(c > 0 for c in costs)


def test_text_and_png_drawings() -> None:
    sim = pp.simulate(pp.zero_bubble_h1(4, 8))
    text = pp.draw_text(sim)
    lines = text.splitlines()
    assert len(lines) == 5
    assert lines[1].startswith("rank 0 | F0 F1 F2 F3")
    assert all(len(line.split("|")[1].split()) == sim.makespan for line in lines[1:])


def test_png_is_a_valid_image(tmp_path: Path) -> None:
    sim = pp.simulate(pp.one_f_one_b(2, 4))
    path = pp.draw_png(sim, tmp_path / "t.png", pixels_per_unit=10, row_height=12)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (int(sim.makespan * 10), 24)


class _TiedStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.bias = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(torch.relu(self.a(x)))
        h = self.a(h) + self.b(h) + self.bias  # self.a used twice
        return torch.tanh(h), h.sum(-1)


@pytest.mark.parametrize("first_stage", [False, True])
def test_split_backward_equals_whole_backward(first_stage: bool) -> None:
    torch.manual_seed(0)
    stage = _TiedStage()
    x = torch.randn(4, 6, requires_grad=not first_stage)
    outs = stage(x)
    grads = [torch.randn_like(o) for o in outs]
    inputs = [] if first_stage else [x]
    want = torch.autograd.grad(outs, [*inputs, *stage.parameters()], grads, retain_graph=True)
    got_inputs, work = backward_input(list(outs), grads, inputs, list(stage.parameters()))
    after_input = {n: p.grad is not None for n, p in stage.named_parameters()}
    backward_weight(work)
    for got, ref in zip(got_inputs, want[: len(inputs)], strict=True):
        assert got is not None
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    for (name, p), ref in zip(stage.named_parameters(), want[len(inputs) :], strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-7)
    # The weight gradients really wait for W: only the twice-used weight
    # (and its bias) are computed with the input gradient.
    expected_early = set() if first_stage else {"a.weight", "a.bias"}
    assert {n for n, early in after_input.items() if early} == expected_early
