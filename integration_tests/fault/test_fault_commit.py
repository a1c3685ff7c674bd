"""Issue 44, nothing committed that was not verified: a file removed from,
or changed in, ``step-N.partial`` between the ranks' writes and the commit
(pc-train's save, 2 ranks, ZeRO-2) leaves it uncommitted, keeps the
earlier checkpoint (no pruning), and raises a CheckpointError naming the
file on every rank (an async save: on rank 0, whose failure pc-train's
launcher reports for the others)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pc_booster import Booster, LowLevelZeroPlugin
from pc_comm.testing import run_subtests
from pc_train.checkpoint import CheckpointError, save_checkpoint
from pc_train.models import build_model, resolve_model

pytestmark = pytest.mark.timeout(300)


# Each damage is done by one rank once every rank's files are written: rank 1
# for a save (a barrier follows), rank 0 for an async one (its commit follows
# in the same thread; the others do not wait for it).


def _lose(partial: Path) -> None:
    (partial / "model" / "__1_0.distcp").unlink()  # the file rank 1 wrote


def _garble(partial: Path) -> None:
    path = partial / "optimizer" / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _drop_rng(partial: Path) -> None:
    (partial / "rng-rank1.pt").unlink()


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "lost": (_lose, r"missing: model/__1_0\.distcp"),
    "garbled": (_garble, r"changed: optimizer/__0_0\.distcp \(checksum crc32:"),
    "rng": (_drop_rng, r"missing: rng-rank1\.pt"),
}


def _commit_case(out: str, damage: str, use_async: bool) -> None:
    root = Path(out) / f"{damage}-{use_async}" / "checkpoints"
    booster = Booster(plugin=LowLevelZeroPlugin(stage=2))
    net = build_model(resolve_model("gpt2-tiny", 16), seed=0)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    net, optimizer, _, _, schedule = booster.boost(net, optimizer, lr_scheduler=schedule)

    def save(step: int, written: Callable[[], None] | None) -> Path:
        return save_checkpoint(
            booster, net, optimizer, schedule, root, step, {"step": step}, {}, written=written,
            use_async=use_async, keep_last=1,
        ).result()  # fmt: skip

    good = save(2, None)
    dist.barrier()  # an async save: rank 0's commit is done once its future is
    assert good.is_dir()
    hurt, message = DAMAGE[damage]
    partial = root / "step-000004.partial"

    def written() -> None:
        if dist.get_rank() == (0 if use_async else 1):
            hurt(partial)

    if not use_async or dist.get_rank() == 0:
        expected = r"step-000004\.partial was not committed.*" + message
        with pytest.raises(CheckpointError, match=expected):
            save(4, written)
    else:
        save(4, written)
    dist.barrier()
    assert good.is_dir(), "the earlier checkpoint was pruned"
    assert not (root / "step-000004").exists(), "a damaged checkpoint was committed"
    assert partial.is_dir()


def test_a_damaged_partial_checkpoint_is_not_committed(tmp_path: Path) -> None:
    cases: dict[str, list[object]] = {"damage": list(DAMAGE), "use_async": [False, True]}
    run_subtests(_commit_case, 2, cases, args=(str(tmp_path),), timeout=240)
