"""The CUDA paths: pinned buffers, side-stream copies, offload and host
optimizers with device parameters. Run by `nox -s gpu` on a GPU machine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pc_offload import CopyEngine, CPUAdamW, CPUOffload, HybridAdam, PinnedPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_pinned_round_trip_on_a_side_stream() -> None:
    engine = CopyEngine(PinnedPool(64 << 20))
    assert engine.pool.pinned
    x = torch.randn(1 << 20, device="cuda")
    host = engine.to_host(x)
    back = engine.to_device(host.wait(), x.device)
    torch.cuda.synchronize()
    assert torch.equal(back.wait(), x)
    engine.release_after(back, host.result)
    engine.synchronize()
    assert engine.pool.stats().in_use_bytes == 0


def test_offload_gradients_match_on_cuda() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(8)]).cuda()
    x = torch.randn(64, 256, device="cuda")
    model(x).square().mean().backward()
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    for ratio in (0.25, 0.5, 1.0):
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with CPUOffload(offload_ratio=ratio, tag=f"cuda-{ratio}") as offload:
                loss = model(x).square().mean()
            loss.backward()
            got = [p.grad for p in model.parameters() if p.grad is not None]
            for a, b in zip(got, expected, strict=True):
                assert torch.equal(a, b)
            assert offload.stats.offloaded_tensors > 0


@pytest.mark.parametrize("make", [CPUAdamW, HybridAdam])
def test_bf16_device_parameters_step_from_fp32_masters(make: type) -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(257, 3, device="cuda").bfloat16())]
    masters = [nn.Parameter(params[0].detach().float().clone())]
    ours, ref = make(params, lr=1e-2), torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.0)
    for group in ours.param_groups:
        group["weight_decay"] = 0.0
    for _ in range(10):
        g = torch.randn(257, 3, device="cuda").bfloat16()
        params[0].grad, masters[0].grad = g, g.float()
        ours.step()
        ref.step()
    master = ours.state[params[0]]["master"]
    assert master.device.type == ("cpu" if make is CPUAdamW else "cuda")
    torch.testing.assert_close(master.to("cuda"), masters[0].detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(params[0].detach(), master.to("cuda").bfloat16())


def test_pinned_empty_is_exact_and_page_locked() -> None:
    import gc

    from pc_offload import pinned_empty

    host = pinned_empty((3, 100_003), torch.float32)
    assert host.shape == (3, 100_003)
    assert host.is_pinned()
    assert host.untyped_storage().nbytes() == 3 * 100_003 * 4  # not rounded up
    x = torch.randn(3, 100_003, device="cuda")
    host.copy_(x, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host, x.cpu())
    view = host[1]
    del host
    gc.collect()
    assert view.is_pinned()  # a view keeps the registration alive
    back = view.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, x[1])
