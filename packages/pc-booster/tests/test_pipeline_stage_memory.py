"""No rank holds another pipeline stage's values ([Note: only this stage is
materialised under tensor parallelism] in ``pc_booster.plugins.
pipeline_tp``): a lazily built model boosted with tensor x pipeline
parallelism (tp 2 x pp 2, 4 ranks) leaves every parameter of the other
stage without memory (meta, or still lazy), with or without
tensor parallelism, while this stage's hold their values. Before, tensor
parallelism materialised every stage's layers and the model kept them:
each rank held 1/tp of the whole model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from plugin_matrix import Case, build_model

from pc_booster import Booster, HybridParallelPlugin
from pc_chunk import is_lazy
from pc_comm.testing import run_subtests

pytestmark = pytest.mark.timeout(300)


def _stage_case(tp: int) -> None:
    model = build_model(Case("hybrid", "fp32", False, 1, True, "fp32"), lazy=True)
    plugin = HybridParallelPlugin(tp_size=tp, pp_size=2, num_microbatches=2)
    boosted, *_ = Booster(plugin=plugin).boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    own = {id(p) for p in boosted.parameters()}
    held = [n for n, p in model.named_parameters() if id(p) in own]
    assert held, "this stage holds no parameters"
    for name, param in model.named_parameters():
        if id(param) in own:
            assert not param.is_meta, name
            assert not is_lazy(param), name
        else:  # another stage's: no memory on this rank
            assert param.is_meta or is_lazy(param), (dist.get_rank(), name)


def test_other_stages_hold_no_values() -> None:
    run_subtests(_stage_case, 4, {"tp": [2, 1]}, timeout=240)
