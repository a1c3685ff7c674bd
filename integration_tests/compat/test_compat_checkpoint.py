"""Colossal-AI's checkpoint call shapes on the Booster, written from their
public signatures: ``save_model(model, "model.pt")`` writes one file that
``torch.load`` and ``load_model`` read back (into a boosted model under
another plugin, or a model that was never boosted); ``use_safetensors``;
``shard=True`` with ``size_per_shard`` (each rank's share over files of
about that size) and with ``use_safetensors=True`` (transformers' sharded
files, which ``from_pretrained`` loads); ``low_cpu_mem_mode``; and the
arguments pc refuses, with their messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

from pc_booster import Booster, GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from pc_comm.testing import run_subtests

pytestmark = pytest.mark.timeout(300)


def _gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    return GPT2LMHeadModel(config)


def _trained(
    plugin: str,
) -> tuple[Booster, torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    booster = Booster(plugin=GeminiPlugin() if plugin == "gemini" else LowLevelZeroPlugin(stage=2))
    built = _gpt2()
    model, optimizer, *_ = booster.boost(built, torch.optim.AdamW(built.parameters(), lr=1e-2))
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    booster.backward(model(input_ids=ids, labels=ids).loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()
    state = {k: v.clone() for k, v in booster.plugin.model_state_dict(model).items()}
    return booster, model, optimizer, state


def _same(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for key, value in want.items():
        torch.testing.assert_close(state[key].float(), value.float(), rtol=0, atol=0)


def _fresh_under_ddp(path: Path) -> dict[str, torch.Tensor]:
    other = Booster(plugin=TorchDDPPlugin())
    fresh, *_ = other.boost(_gpt2(seed=1))
    other.load_model(fresh, path)
    return other.plugin.model_state_dict(fresh)


def check_file_forms(root: str, plugin: str) -> None:
    booster, model, _, want = _trained(plugin)
    out = Path(root) / plugin
    booster.save_model(model, out / "model.pt")
    assert (out / "model.pt").is_file()
    _same(torch.load(out / "model.pt", weights_only=True), want)  # what an eval script does
    _same(_fresh_under_ddp(out / "model.pt"), want)
    plain = _gpt2(seed=2)  # never boosted
    booster.load_model(plain, out / "model.pt")
    _same(plain.state_dict(), want)
    # safetensors: by suffix, or asked for under another name
    from safetensors.torch import load_file

    booster.save_model(model, out / "model.safetensors")
    _same(load_file(str(out / "model.safetensors")), want)
    booster.save_model(model, out / "weights.bin", use_safetensors=True)
    _same(load_file(str(out / "weights.bin")), want)
    _same(_fresh_under_ddp(out / "weights.bin"), want)
    # the directory form (from_pretrained reads it)
    booster.save_model(model, out / "pretrained")
    _same(GPT2LMHeadModel.from_pretrained(out / "pretrained").state_dict(), want)
    dist.barrier()


def test_single_file_forms(tmp_path: Path) -> None:
    run_subtests(check_file_forms, 2, {"plugin": ["zero2", "gemini"]}, args=(str(tmp_path),),
                 timeout=280)  # fmt: skip


def _files(path: Path, pattern: str) -> list[Path]:
    return sorted(path.glob(pattern))


def check_sharded_forms(root: str, plugin: str) -> None:
    booster, model, optimizer, want = _trained(plugin)
    out = Path(root) / plugin
    booster.save_model(model, out / "one", shard=True)
    assert len(_files(out / "one", "*.distcp")) == dist.get_world_size()  # one per rank
    booster.save_model(model, out / "many", shard=True, size_per_shard=1)
    booster.save_optimizer(optimizer, out / "optim", shard=True, size_per_shard=1)
    booster.load_optimizer(optimizer, out / "optim")
    _same(_fresh_under_ddp(out / "many"), want)
    # Colossal-AI's sharded form: transformers' safetensors files with the index.
    booster.save_model(model, out / "hf", shard=True, use_safetensors=True, size_per_shard=1)
    index = json.loads((out / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 1
    _same(GPT2LMHeadModel.from_pretrained(out / "hf").state_dict(), want)
    other = Booster(plugin=TorchDDPPlugin())
    fresh, *_ = other.boost(_gpt2(seed=1))
    other.load_model(fresh, out / "hf", low_cpu_mem_mode=False)
    _same(other.plugin.model_state_dict(fresh), want)
    plain = _gpt2(seed=2)
    booster.load_model(plain, out / "one")  # a DCP checkpoint into a model never boosted
    _same(plain.state_dict(), want)
    dist.barrier()


def test_sharded_forms(tmp_path: Path) -> None:
    run_subtests(check_sharded_forms, 2, {"plugin": ["zero2", "gemini"]},
                 args=(str(tmp_path),), timeout=280)  # fmt: skip


def check_size_per_shard_splits(root: str) -> None:
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2))
    torch.manual_seed(0)
    built = GPT2LMHeadModel(GPT2Config(vocab_size=4096, n_positions=32, n_embd=256, n_layer=2,
                                       n_head=4))  # fmt: skip
    model, *_ = booster.boost(built, torch.optim.AdamW(built.parameters()))
    want = {k: v.clone() for k, v in booster.plugin.model_state_dict(model).items()}
    out = Path(root) / "split"
    booster.save_model(model, out, shard=True, size_per_shard=1)  # ~6 MiB a rank
    per_rank = len(_files(out, "*.distcp")) / dist.get_world_size()
    assert per_rank >= 4, per_rank
    sizes = [f.stat().st_size for f in _files(out, "*.distcp")]
    largest = max(t.numel() * t.element_size() for t in want.values())
    assert max(sizes) <= 2**20 + largest + 2**16, sizes  # about 1 MiB, plus one tensor
    _same(_fresh_under_ddp_big(out), want)
    dist.barrier()


def _fresh_under_ddp_big(path: Path) -> dict[str, torch.Tensor]:
    other = Booster(plugin=TorchDDPPlugin())
    torch.manual_seed(5)
    fresh = GPT2LMHeadModel(GPT2Config(vocab_size=4096, n_positions=32, n_embd=256, n_layer=2,
                                       n_head=4))  # fmt: skip
    fresh, *_ = other.boost(fresh)
    other.load_model(fresh, path)
    return other.plugin.model_state_dict(fresh)


def test_size_per_shard_splits_each_share(tmp_path: Path) -> None:
    run_subtests(check_size_per_shard_splits, 2, {}, args=(str(tmp_path),), timeout=200)


def check_refusals(root: str) -> None:
    booster, model, optimizer, _ = _trained("zero2")
    out = Path(root)
    with pytest.raises(ValueError, match="prefix='run1': pc names a sharded checkpoint's files"):
        booster.save_model(model, out / "p", shard=True, prefix="run1")
    # size_per_shard and use_async have no effect on one file (as Colossal-AI's
    # own tests pass them): the file is written whole before save_model returns.
    future = booster.save_model(model, out / "model.pt", size_per_shard=10, use_async=True)
    assert future is not None
    assert future.done()
    assert (out / "model.pt").is_file()
    with pytest.raises(ValueError, match="gather_dtensor=False with shard=False"):
        booster.save_model(model, out / "model.pt", gather_dtensor=False)
    with pytest.raises(ValueError, match=r"use_safetensors=False asks for a torch\.save file"):
        booster.save_model(model, out / "directory", use_safetensors=False)
    with pytest.raises(ValueError, match="num_threads=4; pc reads with one thread per rank"):
        booster.load_model(model, out / "model.pt", num_threads=4)
    future = booster.save_optimizer(optimizer, out / "optimizer.pt", size_per_shard=10,
                                    use_async=True)  # fmt: skip
    assert future is not None
    assert future.done()
    assert (out / "optimizer.pt").is_file()
    booster.load_optimizer(optimizer, out / "optimizer.pt")
    dist.barrier()


def test_refused_arguments(tmp_path: Path) -> None:
    run_subtests(check_refusals, 2, {}, args=(str(tmp_path),), timeout=120)
