"""GPU only: async saves of CUDA state ([Note: staging beside training]).
The host copy is made on a side stream ordered after the work queued at the
call, into pinned buffers, on the stager thread; what lands is the state of
the call even when the GPU is still busy writing it then and training
changes it afterwards. Then end to end: a Booster over NCCL (world 1) saves
asynchronously on the GPU under each sharded plugin family and the
checkpoint loads back to the values of the call."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pc_booster import Booster, GeminiPlugin, LowLevelZeroPlugin, Plugin, TorchFSDPPlugin
from pc_booster.plugins import sharded
from pc_comm.testing import tiny_gpt2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

_SPIN = 200_000_000  # GPU cycles, ~0.1 s: the copy must wait for queued work


def test_staged_copy_follows_the_work_queued_at_the_call() -> None:
    torch.cuda.set_device(0)
    big = torch.zeros(1 << 20, device="cuda")
    small = torch.zeros(16, device="cuda")
    buffer = torch.zeros(1 << 17, device="cuda")
    torch.cuda._sleep(_SPIN)  # type: ignore[no-untyped-call]
    big.fill_(1.0)  # still queued behind the spin when held() returns
    small.fill_(2.0)
    buffer.fill_(3.0)
    taken = sharded.held({"big": big, "small": small, "buffer": buffer, "lr": 0.5}, [buffer])
    assert taken.ready is not None
    assert taken.state["small"].data_ptr() != small.data_ptr()  # copied at the call
    assert taken.state["buffer"].data_ptr() != buffer.data_ptr()
    assert taken.state["big"].data_ptr() == big.data_ptr()  # left to the stager
    small.fill_(-1.0)  # training changes these before the copy is made
    buffer.fill_(-1.0)
    result: dict[str, object] = {}
    worker = threading.Thread(target=lambda: result.update(sharded.staged(taken)))
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the staged copy did not finish"
    big.fill_(-1.0)  # the step, after the copy
    torch.cuda.synchronize()
    for key, value in (("big", 1.0), ("small", 2.0), ("buffer", 3.0)):
        host = result[key]
        assert isinstance(host, torch.Tensor)
        assert host.device.type == "cpu", key
        assert host.is_pinned(), key
        torch.testing.assert_close(host, torch.full_like(host, value), rtol=0, atol=0, msg=key)
    assert result["lr"] == 0.5


PLUGINS = {
    "zero2": lambda: LowLevelZeroPlugin(stage=2),
    "torch-fsdp": TorchFSDPPlugin,
    "gemini": GeminiPlugin,
    "gemini-step-in-backward": lambda: GeminiPlugin(step_in_backward=True),
}


def _boosted(make: object) -> tuple[Booster, torch.nn.Module, torch.optim.Optimizer]:
    plugin: Plugin = make()  # type: ignore[operator]
    booster = Booster(plugin=plugin)
    torch.manual_seed(0)
    model = tiny_gpt2(vocab_size=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, *_ = booster.boost(model, optimizer)
    return booster, model, optimizer


def _step(
    booster: Booster, model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int
) -> None:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed)).cuda()
    torch.cuda._sleep(_SPIN)  # type: ignore[no-untyped-call]
    booster.backward(model(input_ids=ids, labels=ids).loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture
def nccl_world_1() -> object:
    torch.cuda.set_device(0)
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


@pytest.mark.parametrize("name", list(PLUGINS))
def test_async_save_on_the_gpu_holds_the_values_of_the_call(
    name: str, tmp_path: Path, nccl_world_1: object
) -> None:
    booster, model, optimizer = _boosted(PLUGINS[name])
    assert next(model.parameters()).is_cuda
    _step(booster, model, optimizer, 0)
    then = copy.deepcopy(booster.plugin.model_state_dict(model))
    moments = copy.deepcopy(booster.plugin.optimizer_state_dict(optimizer))
    saves = [
        booster.save_model(model, tmp_path / "model", shard=True, use_async=True),
        booster.save_optimizer(optimizer, tmp_path / "optimizer", shard=True, use_async=True),
    ]
    for seed in (1, 2):  # each step waits for the copies, then changes the state
        _step(booster, model, optimizer, seed)
    booster.wait_for_saves()
    assert all(s is not None and s.done() for s in saves)
    now = booster.plugin.model_state_dict(model)
    assert any(not torch.equal(now[k].cpu(), v.cpu()) for k, v in then.items())

    other, loaded, loaded_optimizer = _boosted(PLUGINS["zero2"])
    other.load_model(loaded, tmp_path / "model")
    other.load_optimizer(loaded_optimizer, tmp_path / "optimizer")
    state = other.plugin.model_state_dict(loaded)
    for key, value in then.items():
        torch.testing.assert_close(
            state[key].float().cpu(), value.float().cpu(), rtol=0, atol=0, msg=key
        )
    got = other.plugin.optimizer_state_dict(loaded_optimizer)
    for param, entry in moments["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(
                torch.as_tensor(got["state"][param][key]).float().cpu(),
                torch.as_tensor(value).float().cpu(),
                rtol=0,
                atol=0,
                msg=f"{param}.{key}",
            )
