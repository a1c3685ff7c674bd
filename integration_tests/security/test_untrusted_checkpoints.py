"""A checkpoint from someone else never runs code [Note: loading runs no
code]. In every file of every checkpoint form pc writes that a loader
unpickles, a pickle whose ``__reduce__`` runs a shell command is planted
(the file stays well-formed and every checksum pc keeps is updated, so
only the loader's refusal to run code stands in the way); each load is
refused, naming the file, on every rank, and the command never runs:

- pc-train ``--resume``: the launcher's preflight, and the ranks' loads of
  ``model/.metadata``, ``optimizer/.metadata``, the optimizer's non-tensor
  items, ``scheduler.pt`` and each rank's RNG state;
- ``pc-export`` of such a checkpoint;
- the Booster's single files (model ``.pt``, optimizer, LR scheduler) and
  its sharded model and optimizer directories under every plugin;
- pc-zero's own sharded checkpoints (GeminiDDP, FSDP), their object items
  as written now and as bare pickles (earlier versions);
- the compatibility edge's ``GeneralCheckpointIO``.

That the payload runs when unpickled is checked too, so the test cannot
pass because the planted file is inert."""

from __future__ import annotations

import contextlib
import io
import pickle
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "fault"))  # the fault tests' short runs
import fault_runs
import plant
import pytest
import torch
import torch.distributed as dist

from pc_booster import (
    Booster,
    DDPPlugin,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    Plugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from pc_comm.testing import run_subtests, spawn, tiny_gpt2
from pc_train.checkpoint import CheckpointError, load_trainer_state
from pc_train.train import train
from pc_train.train_config import TrainConfig

pytestmark = pytest.mark.timeout(600)

SETTINGS = fault_runs.settings(2)
REFUSED = r"could run code|Weights only load failed|does not load"


def test_the_payload_runs_when_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(plant.Payload(marker)))
    assert marker.read_text() == "ran\n"


# -- pc-train ---------------------------------------------------------------------

TRAIN_FILES: dict[str, Callable[[Path, Path], object]] = {
    "model-metadata": lambda ckpt, m: plant.plant_metadata(ckpt / "model", m),
    "optimizer-metadata": lambda ckpt, m: plant.plant_metadata(ckpt / "optimizer", m),
    "optimizer-items": lambda ckpt, m: plant.plant_items(ckpt / "optimizer", m),
    "scheduler": lambda ckpt, m: plant.plant_pt(ckpt / "scheduler.pt", m),
    "rng-rank0": lambda ckpt, m: plant.plant_pt(ckpt / "rng-rank0.pt", m),
    "rng-rank1": lambda ckpt, m: plant.plant_pt(ckpt / "rng-rank1.pt", m),
}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fault_runs.saved_run(SETTINGS, tmp_path_factory)


def _planted_run(saved_run: Path, root: Path, target: str) -> tuple[Path, Path, Path]:
    out, marker = root / target, root / f"{target}.ran"
    shutil.copytree(saved_run, out)
    latest = out / "checkpoints" / "step-000002"
    planted = TRAIN_FILES[target](latest, marker)
    assert planted != 0, f"{target}: nothing to plant"
    plant.refresh_checksums(latest)
    return out, latest, marker


def _resume(root: str, target: str) -> None:
    config = TrainConfig(
        **{**SETTINGS, "steps": 4, "extend_schedule": True},
        output_dir=str(Path(root) / target),
        resume="latest",
    )
    with pytest.raises(CheckpointError, match=REFUSED):
        train(config, fault_runs.context())
    dist.barrier()  # every rank raised it


def test_pc_train_resume_runs_no_code_from_any_checkpoint_file(
    saved_run: Path, tmp_path: Path
) -> None:
    markers = [_planted_run(saved_run, tmp_path, t)[2] for t in TRAIN_FILES]
    config = TrainConfig(
        **{**SETTINGS, "steps": 4, "extend_schedule": True}, output_dir=str(tmp_path / "x")
    )
    # The launcher's preflight (one process, before any rank starts) reads
    # the model's metadata: refused there, with a CheckpointError (exit 2).
    with pytest.raises(CheckpointError, match="could run code"):
        load_trainer_state(tmp_path / "model-metadata" / "checkpoints" / "step-000002", config)
    run_subtests(_resume, 2, {"target": list(TRAIN_FILES)}, args=(str(tmp_path),), timeout=300)
    assert [m.name for m in markers if m.exists()] == []


def test_pc_export_runs_no_code_from_the_checkpoint(saved_run: Path, tmp_path: Path) -> None:
    from pc_train.export import main as export_main

    _, latest, marker = _planted_run(saved_run, tmp_path, "model-metadata")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stop:
        export_main([str(latest), str(tmp_path / "exported")])
    assert stop.value.code == 2, err.getvalue()
    assert "could run code" in err.getvalue(), err.getvalue()
    assert "posix.system" in err.getvalue(), err.getvalue()
    assert not marker.exists()


# -- the Booster ------------------------------------------------------------------


def _one_step(booster: Booster, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ids = torch.arange(16).remainder(97).reshape(2, 8)
    loss = model(input_ids=ids, labels=ids).loss
    booster.backward(loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()


def _single_files(root: str) -> None:
    booster = Booster(plugin=TorchDDPPlugin())
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, _, _, schedule = booster.boost(model, optimizer, lr_scheduler=schedule)
    _one_step(booster, model, optimizer)
    base = Path(root)
    files = {"model": base / "model.pt", "optimizer": base / "optimizer.pt"}
    files["scheduler"] = base / "scheduler.pt"
    booster.save_model(model, files["model"])
    booster.save_optimizer(optimizer, files["optimizer"])
    booster.save_lr_scheduler(schedule, files["scheduler"])
    loads: dict[str, Callable[[], object]] = {
        "model": lambda: booster.load_model(model, files["model"]),
        "optimizer": lambda: booster.load_optimizer(optimizer, files["optimizer"]),
        "scheduler": lambda: booster.load_lr_scheduler(schedule, files["scheduler"]),
    }
    for name, load in loads.items():
        load()  # the file as saved loads
        marker = base / f"{name}.ran"
        plant.plant_pt(files[name], marker)
        with pytest.raises(pickle.UnpicklingError, match=r"posix\.system"):
            load()
        assert not marker.exists(), name


def test_booster_single_files_run_no_code(tmp_path: Path) -> None:
    spawn(_single_files, 1, args=(str(tmp_path),), timeout=120)


PLUGINS: dict[str, Callable[[], Plugin]] = {
    "torch-ddp": TorchDDPPlugin,
    "ddp": DDPPlugin,
    "zero1": lambda: LowLevelZeroPlugin(stage=1),
    "zero2": lambda: LowLevelZeroPlugin(stage=2),
    "torch-fsdp": TorchFSDPPlugin,
    "gemini": GeminiPlugin,
    "hybrid-tp2-zero1": lambda: HybridParallelPlugin(tp_size=2, zero_stage=1),
    "hybrid-tp2": lambda: HybridParallelPlugin(tp_size=2),
}
SHARDED_TARGETS: dict[str, tuple[str, Callable[[Path, Path], object]]] = {
    "model-metadata": ("model", lambda d, m: plant.plant_metadata(d, m)),
    "optimizer-metadata": ("optimizer", lambda d, m: plant.plant_metadata(d, m)),
    "optimizer-items": ("optimizer", lambda d, m: plant.plant_items(d, m)),
    "optimizer-bare-pickles": ("optimizer", lambda d, m: plant.plant_items(d, m, raw_pickle=True)),
}


def _sharded(root: str, plugin: str) -> None:
    booster = Booster(plugin=PLUGINS[plugin]())
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, *_ = booster.boost(model, optimizer)
    _one_step(booster, model, optimizer)
    saved = Path(root) / plugin
    booster.save_model(model, saved / "model", shard=True)
    booster.save_optimizer(optimizer, saved / "optimizer", shard=True)
    for target, (part, plant_it) in SHARDED_TARGETS.items():
        copy, marker = Path(root) / f"{plugin}-{target}", Path(root) / f"{plugin}-{target}.ran"
        if dist.get_rank() == 0:
            shutil.copytree(saved, copy)
            assert plant_it(copy / part, marker) != 0, target
            plant.refresh_checksums(copy)
        dist.barrier()
        # A bare pickle in an item DCP reads as bytes: pc refuses the bytes
        # where it expects the groups, and never unpickles them.
        refused = "not a list of dicts" if target.endswith("bare-pickles") else REFUSED
        if part == "optimizer":
            booster.load_model(model, copy / "model")  # untouched: loads
        load = booster.load_model if part == "model" else booster.load_optimizer
        with pytest.raises(ValueError, match=refused):
            load(model if part == "model" else optimizer, copy / part)
        dist.barrier()  # every rank raised
        assert not marker.exists(), (plugin, target)


def test_booster_sharded_checkpoints_run_no_code_under_every_plugin(tmp_path: Path) -> None:
    run_subtests(_sharded, 2, {"plugin": list(PLUGINS)}, args=(str(tmp_path),), timeout=400)


# -- pc-zero's own sharded checkpoints and the compatibility edge -----------------


def _pc_zero(root: str, kind: str) -> None:
    from pc_zero import (
        FullyShardedDataParallel,
        GeminiDDP,
        load_sharded_checkpoint,
        save_sharded_checkpoint,
    )

    model: torch.nn.Module = tiny_gpt2()
    wrapped = GeminiDDP(model) if kind == "gemini" else FullyShardedDataParallel(model)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    ids = torch.arange(16).remainder(97).reshape(2, 8)
    loss = wrapped(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    saved = Path(root) / kind
    save_sharded_checkpoint(saved, wrapped, optimizer)
    load_sharded_checkpoint(saved, wrapped, optimizer)
    for target, raw in [("metadata", False), ("items", False), ("bare-pickles", True)]:
        copy, marker = Path(root) / f"{kind}-{target}", Path(root) / f"{kind}-{target}.ran"
        if dist.get_rank() == 0:
            shutil.copytree(saved, copy)
            if target == "metadata":
                plant.plant_metadata(copy, marker)
            else:
                assert plant.plant_items(copy, marker, raw_pickle=raw) != 0
        dist.barrier()
        with pytest.raises(pickle.UnpicklingError, match=REFUSED):
            load_sharded_checkpoint(copy, wrapped, optimizer)
        dist.barrier()
        assert not marker.exists(), (kind, target)


def test_pc_zero_sharded_checkpoints_run_no_code(tmp_path: Path) -> None:
    run_subtests(_pc_zero, 2, {"kind": ["gemini", "fsdp"]}, args=(str(tmp_path),), timeout=240)


def test_compat_general_checkpoint_io_runs_no_code(tmp_path: Path) -> None:
    from pc_compat.colossalai.checkpoint_io import GeneralCheckpointIO

    io_ = GeneralCheckpointIO()
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    files = {k: tmp_path / f"{k}.pt" for k in ("model", "optimizer", "scheduler")}
    io_.save_model(model, files["model"])
    io_.save_optimizer(optimizer, files["optimizer"])
    io_.save_lr_scheduler(schedule, files["scheduler"])
    loads: dict[str, Callable[[], object]] = {
        "model": lambda: io_.load_model(model, files["model"]),
        "optimizer": lambda: io_.load_optimizer(optimizer, files["optimizer"]),
        "scheduler": lambda: io_.load_lr_scheduler(schedule, files["scheduler"]),
    }
    for name, load in loads.items():
        load()
        marker = tmp_path / f"{name}.ran"
        plant.plant_pt(files[name], marker)
        with pytest.raises(pickle.UnpicklingError, match=r"posix\.system"):
            load()
        assert not marker.exists(), name


def test_an_older_pc_zero_blob_with_a_tensor_still_loads() -> None:
    """pc-zero's object items were bare pickles before they went through
    torch.save; an optimizer's 0-d step tensor among them loads (its
    storage through the weights-only unpickler), a payload does not run."""
    from pc_zero.safe_load import UnsafeCheckpointError, legacy_loads

    step = torch.tensor(3.0)
    loaded = legacy_loads(pickle.dumps({"step": step, "betas": (0.9, 0.99)}), "an old blob")
    assert torch.equal(loaded["step"], step)
    assert loaded["betas"] == (0.9, 0.99)
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system"):
        legacy_loads(pickle.dumps(plant.Payload(Path("/nonexistent/ran"))), "an old blob")


def test_metadata_naming_a_file_outside_its_directory_is_refused(tmp_path: Path) -> None:
    """A .metadata whose items point at another path (../../etc/passwd)
    would have DCP read it as tensor bytes: refused before any read."""
    from torch.distributed.checkpoint.state_dict_saver import save

    from pc_zero.safe_load import UnsafeCheckpointError, read_metadata

    save({"w": torch.zeros(4)}, checkpoint_id=str(tmp_path), no_dist=True)
    metadata = pickle.loads((tmp_path / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match="outside its directory"):
        read_metadata(tmp_path)
