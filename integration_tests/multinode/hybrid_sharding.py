"""One worker of a 2-node x 2 job (two torchrun agents on this host):
FSDP2 hybrid sharding (HYBRID_SHARD: sharded inside each node, replicated
across them), LowLevelZero and Gemini two-level sharding (extra_dp_size = nodes)
train as single-process training of the same model on the global batch
(each rank a quarter): losses and every parameter at rtol 1e-5 / atol
1e-6, 4 steps of SGD with momentum; a sharded checkpoint of each continues
at rtol 1e-5 under the same plugin, full FSDP2 sharding and ZeRO-2 over
every rank. Writes ``<out>/rank<r>.json`` with what it checked; the test
reads them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pc_booster import Booster, GeminiPlugin, LowLevelZeroPlugin, TorchFSDPPlugin
from pc_comm import init_distributed

STEPS, BATCH, WIDTH = 4, 8, 16


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        out: torch.Tensor = self.head(x)
        return out


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, 1, generator=g)


def _reference() -> tuple[nn.Module, list[float]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses


def _boosted(plugin: Any) -> tuple[Booster, Any, Any]:
    booster = Booster(plugin=plugin)
    model = _model()
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return booster, model, opt


def _steps(booster: Booster, model: Any, opt: Any, steps: range) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        x, y = (t.chunk(world)[rank] for t in _batch(step))
        loss = nn.functional.mse_loss(model(x), y)
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        losses.append(whole.item() / world)
    return losses


def _check_checkpoint(booster: Booster, model: Any, opt: Any, where: Path) -> None:
    """A sharded checkpoint of the hybrid layout continues at rtol 1e-5
    under the same plugin, full FSDP2 sharding and ZeRO-2 over every rank."""
    booster.save_model(model, where / "model", shard=True)
    booster.save_optimizer(opt, where / "optim", shard=True)
    want = _steps(booster, model, opt, range(STEPS, STEPS + 2))
    for other in (booster.plugin, TorchFSDPPlugin(), LowLevelZeroPlugin(stage=2)):
        again, model2, opt2 = _boosted(other)
        again.load_model(model2, where / "model")
        again.load_optimizer(opt2, where / "optim")
        got = _steps(again, model2, opt2, range(STEPS, STEPS + 2))
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)


def _check(plugin: Any, name: str, out: str) -> dict[str, Any]:
    reference, want = _reference()
    booster, model, opt = _boosted(plugin)
    world = dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    if name.startswith("fsdp"):  # FSDP2's 2-D mesh: replicated over nodes, sharded in each
        mesh = next(model.parameters()).device_mesh
        assert tuple(mesh.shape) == (world // local, local), mesh
    elif name.startswith("gemini"):  # chunks sharded over the node's ranks
        assert plugin.boosted(model).model.comm.world_size == local
    else:  # ZeRO over the node's ranks
        from pc_booster.wrappers import inner_optimizer

        assert inner_optimizer(opt).world_size == local
    got = _steps(booster, model, opt, range(STEPS))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6)
    state = plugin.model_state_dict(model)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
    _check_checkpoint(booster, model, opt, Path(out) / f"checkpoint-{name}")
    return {"plugin": name, "losses": got}


def main(out: str) -> None:
    init_distributed()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = dist.get_world_size() // local
    checked = {
        "node": int(os.environ["GROUP_RANK"]),
        "local_world_size": local,
        "runs": [
            _check(TorchFSDPPlugin(sharding_strategy="HYBRID_SHARD"), "fsdp-hybrid", out),
            _check(
                TorchFSDPPlugin(sharding_strategy="_HYBRID_SHARD_ZERO2"), "fsdp-hybrid-zero2", out
            ),
            _check(LowLevelZeroPlugin(stage=2, extra_dp_size=nodes), "zero2-two-level", out),
            _check(GeminiPlugin(extra_dp_size=nodes, chunk_size=256), "gemini-two-level", out),
        ],
    }
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(checked))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
