"""The plan sweep: every model family of the installed ``transformers`` that
has a tensor-parallel plan, built tiny (``families.py``), trained 3 steps
under tensor parallelism 2, tensor parallelism 2 with sequence parallelism,
and a 2-stage pipeline (1F1B), each against single-process training of the
same model on the same batch (losses and parameters, rtol 1e-4). A family
pc refuses counts as refused, with the reason.

``python integration_tests/plans/sweep.py [--families llama qwen2 ...]
[--write docs/plan-sweep.md]`` prints a table and "N of M families pass";
``nox -s plans`` runs it over every family. ``test_plan_sample.py`` runs a
sample of it in ``nox -s tests``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from families import SEQ, VOCAB, Family, Skip, build, families  # noqa: E402

STEPS, LR, BATCH = 3, 0.5, 4
RTOL, ATOL = 1e-4, 1e-5
MODES = ("tp", "sp", "pp")


class Refused(Exception):
    """pc refused the family, with the reason."""


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def _reference(family: Family) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model = build(family)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _compare(
    what: str,
    losses: list[torch.Tensor],
    state: dict[str, torch.Tensor],
    ref: tuple[list[torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    ref_losses, ref_state = ref
    torch.testing.assert_close(
        torch.stack(losses), torch.stack(ref_losses), rtol=RTOL, atol=ATOL,
        msg=lambda m: f"{what}: losses differ from single-process training: {m}",
    )  # fmt: skip
    for key, value in ref_state.items():
        if key not in state:
            continue
        torch.testing.assert_close(
            state[key].float(), value.float(), rtol=RTOL, atol=ATOL,
            msg=lambda m, key=key: f"{what}: {key} differs after {STEPS} steps: {m}",
        )  # fmt: skip


def check_tp(family: Family, sp: bool, ref: Any) -> None:
    from pc_tensor import full_state_dict, shard_model

    model = build(family)
    try:
        shard_model(model, dist.group.WORLD, sequence_parallel=sp)
    except (ValueError, TypeError) as error:
        raise Refused(str(error)) from None
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    _compare("sp" if sp else "tp", losses, full_state_dict(model), ref)


def check_pp(family: Family, ref: Any) -> None:
    from pc_booster import Booster, HybridParallelPlugin

    model = build(family)
    try:
        plugin = HybridParallelPlugin(pp_size=2, tp_size=1, num_microbatches=2)
        booster = Booster(plugin=plugin)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        pipe, opt, *_ = booster.boost(model, opt)
    except (ValueError, TypeError) as error:
        raise Refused(str(error)) from None
    losses = []
    for ids in _batches():
        out = booster.execute_pipeline(iter([{"input_ids": ids, "labels": ids}]), pipe, None, opt)
        opt.step()
        opt.zero_grad()
        losses.append(out["loss"].detach())
    state = plugin.model_state_dict(pipe)
    _compare("pp", losses, state, ref)


def _run_family(family: Family, modes: tuple[str, ...]) -> dict[str, str]:
    result: dict[str, str] = {}
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            ref = _reference(family)
        except Skip as skip:
            return {mode: f"skip: {skip}" for mode in modes}
        except Exception as error:  # noqa: BLE001
            text = f"{type(error).__name__}: {error}".splitlines()[0][:200]
            return {mode: f"skip: single-process training fails ({text})" for mode in modes}
        for mode in modes:
            try:
                if mode == "pp":
                    check_pp(family, ref)
                else:
                    check_tp(family, mode == "sp", ref)
                result[mode] = "pass"
            except Refused as refused:
                result[mode] = "refused: " + " ".join(str(refused).split())[:300]
            except Exception as error:  # noqa: BLE001
                text = " ".join(f"{type(error).__name__}: {error}".split())[:300]
                result[mode] = "FAIL: " + text
            dist.barrier()
    return result


def _worker(names: list[str], modes: tuple[str, ...], out: str) -> None:
    by_name = {f.model_type: f for f in families()}
    for name in names:
        result = _run_family(by_name[name], modes)
        results: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(results, result)
        if dist.get_rank() == 0:
            merged = {m: next((r[m] for r in results if r[m] != "pass"), "pass") for m in modes}
            with open(out, "a") as handle:
                handle.write(json.dumps({"family": name, **merged}) + "\n")


def sweep(names: list[str], modes: tuple[str, ...] = MODES, batch: int = 8) -> list[dict[str, str]]:
    from pc_comm.testing import spawn

    rows: list[dict[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.jsonl")
        todo = list(names)
        while todo:
            chunk, todo = todo[:batch], todo[batch:]
            start = time.perf_counter()
            try:
                spawn(_worker, 2, args=(chunk, modes, out), timeout=120 + 60 * len(chunk))
            except Exception as error:  # noqa: BLE001
                print(f"group failed on {chunk}: {str(error).splitlines()[0]}", file=sys.stderr)
            done = {}
            if Path(out).exists():
                for line in Path(out).read_text().splitlines():
                    row = json.loads(line)
                    done[row["family"]] = row
            for name in chunk:
                row = done.get(name) or {"family": name, **{m: "FAIL: the group crashed or hung" for m in modes}}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
            print(f"  {len(chunk)} families in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return rows


def table(rows: list[dict[str, str]], modes: tuple[str, ...]) -> str:
    lines = ["| family | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    for row in rows:
        cells = [row[m].replace("|", "\\|") for m in modes]
        lines.append(f"| {row['family']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="*", default=None)
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    parser.add_argument("--write", default=None, help="a markdown file for the table")
    args = parser.parse_args()
    names = args.families or [f.model_type for f in families()]
    modes = tuple(args.modes)
    rows = sweep(names, modes)
    built = [r for r in rows if not all(r[m].startswith("skip") for m in modes)]
    passing = [r for r in built if all(r[m] == "pass" for m in modes)]
    text = table(rows, modes)
    print(text)
    summary = f"{len(passing)} of {len(built)} families pass ({len(rows)} with a plan)"
    print(summary)
    if args.write:
        Path(args.write).write_text(text + "\n\n" + summary + "\n")


if __name__ == "__main__":
    main()
