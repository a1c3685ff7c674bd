"""The hybrid plugin module's share of the generated combination test
(plugin_matrix.py: [Note: the plugin matrix]); PC_PLUGIN_MATRIX=full runs
its whole option space."""

from __future__ import annotations

from pathlib import Path

import pytest
from plugin_matrix import run_matrix

pytestmark = pytest.mark.timeout(4000)


def test_every_combination_trains_correctly_or_is_refused(tmp_path: Path) -> None:
    run_matrix(["hybrid"], tmp_path / "rows.json")


def check_pipeline_criterion_and_fp16_overflow(case: str) -> None:
    """The pipeline's criterion is called as Colossal-AI calls it,
    ``criterion(outputs, inputs)``, with ``outputs.logits`` / ``.loss`` /
    ``[0]``; and under fp16 an overflow on one stage only makes every stage
    skip the step and back the scale off."""
    import torch
    import torch.distributed as dist
    from plugin_matrix import Case, batch, build_model

    from pc_booster import Booster, HybridParallelPlugin

    fp16 = case == "fp16-overflow"
    plugin = HybridParallelPlugin(
        pp_size=2, zero_stage=1, num_microbatches=2, initial_scale=2.0**10, hysteresis=1
    )
    booster = Booster(plugin=plugin, mixed_precision="fp16" if fp16 else "fp32")
    model = build_model(Case("hybrid", "fp32", False, 1, False, "fp32"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer, *_ = booster.boost(model, optimizer)
    data = batch(0, 4)
    if case == "criterion":
        seen: list[set[str]] = []

        def criterion(outputs: object, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            seen.append(set(inputs))
            logits = outputs.logits  # type: ignore[attr-defined]
            assert outputs[1] is logits  # type: ignore[index]
            assert outputs[0] is outputs.loss  # type: ignore[attr-defined, index]
            own = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                inputs["labels"][:, 1:].reshape(-1),
            )
            torch.testing.assert_close(own, outputs.loss)  # type: ignore[attr-defined]
            return own

        mine = booster.execute_pipeline(iter([data]), model, criterion, optimizer)["loss"]
        optimizer.zero_grad()
        default = booster.execute_pipeline(iter([data]), model, None, optimizer)["loss"]
        torch.testing.assert_close(mine, default, rtol=0, atol=0)
        if dist.get_rank() == 1:  # the last stage computes the loss
            assert seen == [{"input_ids", "labels"}] * 2, seen
        return
    before = plugin.model_state_dict(model)
    stage_param = next(p for p in optimizer.params if p.requires_grad)
    if dist.get_rank() == 1:  # an overflow on the last stage only
        stage_param.register_hook(lambda grad: grad * float("inf"))
    booster.execute_pipeline(iter([data]), model, None, optimizer)
    optimizer.step()
    after = plugin.model_state_dict(model)
    for key, value in before.items():
        assert torch.equal(after[key], value), f"{key} moved although a stage overflowed"
    assert optimizer.scaler.scale == 2.0**9, optimizer.scaler.scale


def test_pipeline_criterion_and_fp16_overflow() -> None:
    from pc_comm.testing import run_subtests

    run_subtests(
        check_pipeline_criterion_and_fp16_overflow,
        2,
        {"case": ["criterion", "fp16-overflow"]},
        timeout=300,
    )


def check_uneven_stages_match_one_process(split: tuple[int, int]) -> None:
    """A pipeline whose stages hold different numbers of blocks
    (``num_layers_per_stage``, as pc-train's ``--layers-per-stage`` and the
    planner's uneven splits set it) trains as one process on the same
    global batch: losses over three SGD steps (rtol 1e-5, atol 1e-6)."""
    import copy

    import torch
    import torch.distributed as dist
    from plugin_matrix import Case, batch, build_model

    from pc_booster import Booster, HybridParallelPlugin

    plugin = HybridParallelPlugin(pp_size=2, zero_stage=0, num_microbatches=2,
                                  num_layers_per_stage=split)  # fmt: skip
    booster = Booster(plugin=plugin)
    model = build_model(Case("hybrid", "fp32", False, 1, False, "fp32"))
    reference = copy.deepcopy(model)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, *_ = booster.boost(model, optimizer)
    names = [n for n, _ in model.named_parameters()]  # "stages.0.<layer>.block.<...>"
    blocks = {n.split(".block.")[0] for n in names if ".block." in n}
    assert len(blocks) == split[dist.get_rank()], (split, sorted(blocks))
    for step in range(3):
        data = batch(step, 4)
        loss = booster.execute_pipeline(iter([data]), model, None, optimizer)["loss"]
        optimizer.step()
        optimizer.zero_grad()
        expected = reference(**data).loss
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        if dist.get_rank() == 1:  # the last stage has the loss
            torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)


def test_uneven_stages_match_one_process() -> None:
    from pc_comm.testing import run_subtests

    run_subtests(check_uneven_stages_match_one_process, 2, {"split": [(1, 3), (3, 1)]},
                 timeout=300)  # fmt: skip
