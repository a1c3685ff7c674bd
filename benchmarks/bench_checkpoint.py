"""Sharded checkpoints against torch DCP on FSDP2, side by side in one run.

GPT-2 (6 layers, hidden 512, 8 heads, vocab 8192: 23 M parameters, 281 MB
of fp32 parameters and Adam moments), trained one step so the optimizer
has its state, 2 ranks, gloo, one thread per rank. Rows, sampled
alternately round by round:

- torch DCP on FSDP2: ``fully_shard`` per block and on the root, the model
  and optimizer through ``torch.distributed.checkpoint.state_dict``'s
  ``get_state_dict`` / ``set_state_dict`` and ``dcp.save`` / ``dcp.load``
  (the FSDP2 recipe); its async rows ``dcp.async_save`` over a gloo group,
  staging at the call (the default) and with DCP's ``DefaultStager``
  staging in the background (``use_async_staging``: the training loop
  waits on ``staging_completion`` before its next optimizer step);
- pc TorchFSDPPlugin (the same FSDP2 model through ``Booster.save_model`` /
  ``save_optimizer(shard=True)`` and the loads), and ``use_async=True``;
- pc LowLevelZeroPlugin(stage=2) and pc GeminiPlugin, the same calls.

Each row reports the median save and load seconds (the slowest rank's),
their ratio to DCP-on-FSDP2's in the same round, the bytes each rank wrote
against an even split (total / ranks), each rank's peak resident memory
above its memory before the save or load (glibc asked to return freed
blocks, so freed memory is not counted). A second table gives each async
save's stall: the call, then one training step during which the write
goes on; the stall is how long training was blocked (the call, plus any
wait before the step's optimizer update for the host copy), over the
synchronous save of the same round; and that step's time over a plain
step's (what the background copy and write cost the step itself: on this
2-core machine the ranks' threads share the two cores).

    python benchmarks/bench_checkpoint.py [--iters 5]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _common import step_gpt2
from torch import nn

from pc_booster import Booster, GeminiPlugin, LowLevelZeroPlugin, Plugin, TorchFSDPPlugin
from pc_comm import tune_host_allocator
from pc_comm.host_allocator import HostAllocatorSettings
from pc_comm.testing import spawn

RESULTS = Path(__file__).resolve().parent.parent / "bench-results"
_HWM = re.compile(r"VmHWM:\s+(\d+)\s+kB")
_RSS = re.compile(r"VmRSS:\s+(\d+)\s+kB")


def _status(pattern: re.Pattern[str]) -> int:
    match = pattern.search(Path("/proc/self/status").read_text())
    return int(match.group(1)) * 1024 if match else 0


def _measured(fn: Callable[[], object]) -> tuple[float, int]:
    """Seconds (all ranks start together, the slowest counts) and this
    rank's peak resident memory above where it started."""
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
    before = _status(_RSS)
    start = time.perf_counter()
    fn()
    dist.barrier()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds), max(0, _status(_HWM) - before)


def _step(
    model: nn.Module,
    optimizer: Any,
    booster: Booster | None = None,
    before_step: Callable[[], None] = lambda: None,
) -> None:
    ids = torch.randint(0, 8192, (2, 128), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    if booster is not None:
        booster.backward(loss, optimizer)
    else:
        loss.backward()
    before_step()
    optimizer.step()
    optimizer.zero_grad()


class _Async:
    """An async save under way: what the training loop calls before its
    next optimizer step, the seconds that blocked, and the wait for all."""

    def __init__(
        self,
        finish: Callable[[], None],
        before_step: Callable[[], None] = lambda: None,
        waited: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.finish, self._before_step, self._waited = finish, before_step, waited
        self.blocked = 0.0

    def before_step(self) -> None:
        began = time.perf_counter()
        self._before_step()
        self.blocked += time.perf_counter() - began

    def waited(self) -> float:
        """Seconds blocked before the step: by the loop's own wait, and
        inside the optimizer step (pc's step pre-hook)."""
        return self.blocked + self._waited()


class _Row:
    """One way of saving and loading a trained model and optimizer."""

    def save(self, path: str) -> None: ...
    def load(self, path: str) -> None: ...
    def step(self, before_step: Callable[[], None] = lambda: None) -> None: ...

    def save_async(self, path: str, variant: str) -> _Async:
        raise NotImplementedError

    asyncs: tuple[str, ...] = ()


class _DcpFsdp2(_Row):
    def __init__(self) -> None:
        from torch.distributed.fsdp import fully_shard

        self.model = step_gpt2()
        for block in self.model.transformer.h:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        _step(self.model, self.optimizer)
        self.group = dist.new_group(backend="gloo")  # async writes beside training

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def save(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict_saver import save

        save(self._state(), checkpoint_id=path)

    def load(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        state = self._state()
        load(state, checkpoint_id=path)
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )  # fmt: skip

    asyncs = ("torch DCP async_save", "torch DCP async_save, background staging")

    def step(self, before_step: Callable[[], None] = lambda: None) -> None:
        _step(self.model, self.optimizer, before_step=before_step)

    def save_async(self, path: str, variant: str) -> _Async:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import async_save

        if variant == self.asyncs[0]:
            future: Any = async_save(self._state(), checkpoint_id=path, process_group=self.group)
            return _Async(lambda: future.result())
        stager = DefaultStager(StagingOptions(False, False, True, False))  # host, background
        response: Any = async_save(
            self._state(), checkpoint_id=path, process_group=self.group, async_stager=stager
        )

        def finish() -> None:
            response.upload_completion.result()
            stager.close()

        return _Async(finish, before_step=lambda: response.staging_completion.result())


class _Pc(_Row):
    asyncs = ("use_async=True",)

    def __init__(self, plugin: Plugin) -> None:
        self.booster = Booster(plugin=plugin)
        model = step_gpt2()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.model, self.optimizer, *_ = self.booster.boost(model, optimizer)
        _step(self.model, self.optimizer, self.booster)

    def save(self, path: str) -> None:
        self.booster.save_model(self.model, f"{path}/model", shard=True)
        self.booster.save_optimizer(self.optimizer, f"{path}/optimizer", shard=True)

    def load(self, path: str) -> None:
        self.booster.load_model(self.model, f"{path}/model")
        self.booster.load_optimizer(self.optimizer, f"{path}/optimizer")

    def step(self, before_step: Callable[[], None] = lambda: None) -> None:
        _step(self.model, self.optimizer, self.booster, before_step)

    def save_async(self, path: str, variant: str) -> _Async:
        booster = self.booster
        began = booster.async_save_waits
        booster.save_model(self.model, f"{path}/model", shard=True, use_async=True)
        booster.save_optimizer(self.optimizer, f"{path}/optimizer", shard=True, use_async=True)
        return _Async(booster.wait_for_saves, waited=lambda: booster.async_save_waits - began)


ROWS: dict[str, Callable[[], _Row]] = {
    "torch DCP on FSDP2": _DcpFsdp2,
    "pc TorchFSDPPlugin": lambda: _Pc(TorchFSDPPlugin()),
    "pc LowLevelZero stage 2": lambda: _Pc(LowLevelZeroPlugin(stage=2)),
    "pc Gemini": lambda: _Pc(GeminiPlugin()),
}


def _written(path: str) -> list[int]:
    """Bytes each rank's data file holds (DCP names them __<rank>_0.distcp)."""
    sizes = [0] * dist.get_world_size()
    for file in Path(path).rglob("__*_*.distcp"):
        sizes[int(file.name.split("_")[2])] += file.stat().st_size
    return sizes


def _bench(iters: int, out: str) -> None:
    torch.set_num_threads(1)
    tune_host_allocator(HostAllocatorSettings(mmap_threshold=1 << 20, trim_threshold=1 << 20))
    rows = {name: make() for name, make in ROWS.items()}
    root = [tempfile.mkdtemp(prefix="pc-bench-ckpt-") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(root)
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in rows}
    memory: dict[str, dict[str, list[int]]] = {name: {} for name in rows}
    written: dict[str, list[int]] = {}

    def record(name: str, what: str, seconds: float, peak: int) -> None:
        samples[name].setdefault(what, []).append(seconds)
        memory[name].setdefault(what, []).append(peak)

    names = list(rows)
    for i in range(iters):
        for name in names if i % 2 == 0 else reversed(names):
            row, path = rows[name], f"{root[0]}/{i}-{names.index(name)}"
            record(name, "save", *_measured(partial(row.save, path)))
            written[name] = _written(path)
            record(name, "load", *_measured(partial(row.load, path)))
            for variant in row.asyncs:
                _async_round(row, name, variant, f"{path}a{row.asyncs.index(variant)}", record)
            if dist.get_rank() == 0:
                shutil.rmtree(path, ignore_errors=True)
                for k in range(len(row.asyncs)):
                    shutil.rmtree(f"{path}a{k}", ignore_errors=True)
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, memory)
    if dist.get_rank() == 0:
        result = {"samples": samples, "written": written, "peaks": peaks}
        Path(out).write_text(json.dumps(result))
        shutil.rmtree(root[0], ignore_errors=True)


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _async_round(
    row: _Row, name: str, variant: str, path: str, record: Callable[[str, str, float, int], None]
) -> None:
    """One async save, one training step beside its write, then a plain step."""
    pending: list[_Async] = []
    call, peak = _measured(lambda: pending.append(row.save_async(path, variant)))
    save = pending[0]
    dist.barrier()
    began = time.perf_counter()
    row.step(save.before_step)
    beside = _slowest(time.perf_counter() - began)
    stall = call + _slowest(save.waited())
    save.finish()
    dist.barrier()
    began = time.perf_counter()
    row.step()
    plain = _slowest(time.perf_counter() - began)
    record(name, f"{variant}: stall", stall, peak)
    record(name, f"{variant}: call", call, peak)
    record(name, f"{variant}: step beside / plain", beside / plain, 0)


def _table(result: dict[str, Any]) -> None:
    samples, written, peaks = result["samples"], result["written"], result["peaks"]
    base = "torch DCP on FSDP2"

    def paired(name: str, what: str) -> float:
        ours, theirs = samples[name][what], samples[base][what]
        return float(statistics.median(a / b for a, b in zip(ours, theirs, strict=True)))

    print("\n## Sharded checkpoints, 2 ranks (GPT-2 23 M parameters + AdamW)\n")
    print("| | save (s) | / DCP-FSDP2 | load (s) | / DCP-FSDP2 | bytes per rank / even split "
          "| peak MiB per rank (save, load) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|---|")
    for name in samples:
        save, load = (
            statistics.median(samples[name]["save"]),
            statistics.median(samples[name]["load"]),
        )
        even = sum(written[name]) / len(written[name])
        spread = ", ".join(f"{b / even:.3f}" for b in written[name])
        mem = "; ".join(
            f"{max(r[name]['save']) / 2**20:.0f}, {max(r[name]['load']) / 2**20:.0f}" for r in peaks
        )
        print(f"| {name} | {save:.3f} | {paired(name, 'save'):.3f} | {load:.3f} | "
              f"{paired(name, 'load'):.3f} | {spread} ({sum(written[name]) / 2**20:.0f} MiB) | "
              f"{mem} |")  # fmt: skip
    print("\n## Async saves: the stall, and one training step beside the write\n")
    print("| | call (s) | stall (s) | stall / sync save | step beside the write / plain step "
          "| peak MiB per rank (call) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|")
    for name in samples:
        for what in samples[name]:
            if not what.endswith(": stall"):
                continue
            variant = what.removesuffix(": stall")
            stalls, saves = samples[name][what], samples[name]["save"]
            ratio = statistics.median(a / b for a, b in zip(stalls, saves, strict=True))
            call = statistics.median(samples[name][f"{variant}: call"])
            beside = statistics.median(samples[name][f"{variant}: step beside / plain"])
            mem = "; ".join(f"{max(r[name][what]) / 2**20:.0f}" for r in peaks)
            label = variant if variant.startswith("torch") else f"{name}, {variant}"
            print(f"| {label} | {call:.3f} | {statistics.median(stalls):.3f} | {ratio:.3f} | "
                  f"{beside:.3f} | {mem} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "checkpoint.json"
    spawn(_bench, 2, args=(args.iters, str(out)), timeout=1800, name="checkpoint benchmark")
    _table(json.loads(out.read_text()))


if __name__ == "__main__":
    main()
