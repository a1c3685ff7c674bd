"""Issue 52, no file touched outside the directory the user named
([Note: paths pc touches] in ``pc_booster.checkpoint.paths``):

- an index planted in an export directory naming ``../x``, an absolute
  path, or a file through a symlinked folder: ``pc-export``,
  ``Booster.save_model(model, d)``, ``save_model(model, d, shard=True)``
  and its transformers form leave every outside file as it was (and say
  which names they left alone);
- links planted where those saves write their own files by name (DCP's
  shard files and metadata, the shards, ``config.json``, the export's
  staging folder) are replaced, never written through;
- pc-train: a symlinked ``step-N.partial`` or ``step-N`` is replaced (the
  link only), a symlinked ``checkpoints/``, ``logs/`` or ``tensorboard/``
  refused with one line and exit code 2; nothing is written outside;
- checkpoint names compare by step number (``step-1000000`` is newer than
  ``step-999999``) in ``latest``, keep-last and resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "fault"))  # the fault tests' short runs
import fault_runs
import pytest
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

from pc_booster import Booster, LowLevelZeroPlugin
from pc_booster.checkpoint.export import import_pretrained
from pc_booster.checkpoint.paths import OutsidePathWarning
from pc_comm.testing import run_subtests
from pc_train.checkpoint import find_checkpoint, prune_checkpoints

pytestmark = pytest.mark.timeout(300)

INDEX = "model.safetensors.index.json"
# The files outside the target directory, and what each holds.
OUTSIDE = {"victim.txt": "relative", "absolute.txt": "absolute", "linked/via-link.txt": "link"}
# Names pc writes by name in a target, planted as links to outside files.
PLANTED_LINKS = ("config.json", "model.safetensors", "__0_0.distcp", "__1_0.distcp",
                 ".metadata", ".metadata.tmp", ".checksums.json")  # fmt: skip


# What each save form writes by name (where a link was planted).
WRITTEN = {
    "whole": ("model.safetensors", "config.json"),
    "sharded": (".metadata", ".checksums.json", "__0_0.distcp", "__1_0.distcp", "config.json"),
    "pretrained": ("config.json", INDEX),
}


def _outside(root: Path) -> Path:
    outside = root / "outside"
    for name, text in OUTSIDE.items():
        (outside / name).parent.mkdir(parents=True, exist_ok=True)
        (outside / name).write_text(text)
    for name in PLANTED_LINKS:
        (outside / f"target-of-{name}").write_text("not pc's")
    return outside


def _plant(target: Path, outside: Path) -> None:
    """An old index naming files outside ``target`` three ways, and links
    where pc writes its own files."""
    target.mkdir(parents=True, exist_ok=True)
    (target / "sub").symlink_to(outside / "linked")
    weight_map = {
        "a.weight": "../outside/victim.txt",
        "b.weight": str(outside / "absolute.txt"),
        "c.weight": "sub/via-link.txt",
        # Names of what the save itself writes: never removed after it is written.
        "d.weight": INDEX,
        "e.weight": ".metadata",
        "f.weight": "config.json",
    }
    (target / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in PLANTED_LINKS:
        (target / name).symlink_to(outside / f"target-of-{name}")
    (target / ".pc-export").symlink_to(outside / "linked", target_is_directory=True)


def _intact(outside: Path) -> None:
    for name, text in OUTSIDE.items():
        assert (outside / name).read_text() == text, name
    for name in PLANTED_LINKS:
        assert (outside / f"target-of-{name}").read_text() == "not pc's", name
    assert sorted(p.name for p in (outside / "linked").iterdir()) == ["via-link.txt"]


def _gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                      n_head=2))  # fmt: skip


def _save_every_form(root: str) -> None:
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2))
    model = _gpt2()
    model, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    forms = {"whole": {}, "sharded": {"shard": True},
             "pretrained": {"shard": True, "use_safetensors": True}}  # fmt: skip
    for name, kwargs in forms.items():
        target = Path(root) / name
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            booster.save_model(model, target, **kwargs)  # type: ignore[arg-type]
        if dist.get_rank() == 0:
            named = " ".join(str(w.message) for w in caught if w.category is OutsidePathWarning)
            assert "../outside/victim.txt" in named, (name, named)
            assert "sub/via-link.txt" in named, (name, named)
        dist.barrier()
        for link in WRITTEN[name]:  # replaced, never written through
            assert not (target / link).is_symlink(), (name, link)
            assert (target / link).is_file(), (name, link)


def test_booster_saves_touch_nothing_outside(tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    for name in ("whole", "sharded", "pretrained"):
        _plant(tmp_path / name, outside)
    run_subtests(_save_every_form, 2, {}, args=(str(tmp_path),), timeout=240)
    _intact(outside)
    assert (tmp_path / "whole" / "model.safetensors").is_file()
    assert (tmp_path / "sharded" / ".metadata").is_file()
    index = json.loads((tmp_path / "pretrained" / INDEX).read_text())
    assert all("/" not in f for f in index["weight_map"].values())
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "pretrained")
    torch.testing.assert_close(loaded.lm_head.weight, _gpt2().lm_head.weight)


def test_pc_export_touches_nothing_outside(tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    _gpt2().save_pretrained(tmp_path / "hf")
    import_pretrained(tmp_path / "hf", tmp_path / "sharded")
    out = tmp_path / "exported"
    _plant(out, outside)
    done = subprocess.run(
        [sys.executable, "-m", "pc_train.export", str(tmp_path / "sharded"), str(out)],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "../outside/victim.txt" in done.stderr, done.stderr
    assert "left alone" in done.stderr, done.stderr
    _intact(outside)
    assert not (out / "config.json").is_symlink()
    loaded = GPT2LMHeadModel.from_pretrained(out)
    torch.testing.assert_close(loaded.lm_head.weight, _gpt2().lm_head.weight)


def test_symlinked_step_directories_are_replaced(tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    out = tmp_path / "run"
    checkpoints = out / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / "step-000002.partial").symlink_to(outside / "linked")
    (checkpoints / "step-000004").symlink_to(outside / "linked")
    run_subtests(fault_runs.train_with, 2, {}, args=(fault_runs.settings(4), str(out)),
                 timeout=240)  # fmt: skip
    _intact(outside)
    for step in ("step-000002", "step-000004"):
        assert not (checkpoints / step).is_symlink(), step
        assert (checkpoints / step / "trainer_state.json").is_file()
    assert not (checkpoints / "step-000002.partial").exists()


@pytest.mark.parametrize("folder", ["checkpoints", "logs", "tensorboard"])
def test_a_symlinked_run_directory_is_refused(folder: str, tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / folder).symlink_to(outside / "linked", target_is_directory=True)
    argv = [sys.executable, "-m", "pc_train.train", *fault_runs.argv(2), "--output-dir", str(out)]
    done = fault_runs.run_command(argv, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert "is a symbolic link" in lines[0], done.stderr
    assert "--output-dir" in lines[0]
    _intact(outside)


def test_checkpoints_compare_by_step_number(tmp_path: Path) -> None:
    """1,000,001 steps' naming: step-1000000 sorts after step-999999."""
    root = tmp_path / "checkpoints"
    for step in (999_998, 999_999, 1_000_000, 1_000_001):
        (root / f"step-{step:06d}").mkdir(parents=True)
    (root / "step-1000002").symlink_to(tmp_path, target_is_directory=True)  # not pc's
    assert find_checkpoint(root, "latest").name == "step-1000001"
    prune_checkpoints(root, 2)
    assert sorted(p.name for p in root.iterdir()) == ["step-1000000", "step-1000001",
                                                       "step-1000002"]  # fmt: skip
    assert os.path.islink(root / "step-1000002")  # left alone, and what it points to
    # A run gone back to an older step (--resume PATH) prunes only up to
    # the step it commits: the line it left, and a planted high number,
    # neither count nor remove the checkpoint just committed.
    for step in (50, 60, 9_999_999):
        (root / f"step-{step:06d}").mkdir()
    prune_checkpoints(root, 1, newest=60)
    assert (root / "step-000060").is_dir()
    assert (root / "step-9999999").is_dir()
    assert not (root / "step-000050").exists()
