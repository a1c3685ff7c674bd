"""Fit the CPU constants of pc-estimate's step time ([Note: the step's
time] in pc_train.step_time) to measured calibration tables.

Each argument is the output of ``python tools/calibrate_estimate.py`` run
on this machine with nothing else running (optionally ``FILE:3,4`` to leave
rows 3 and 4 of that run out); the measured step of each row is the mean
over the runs. The step's seconds are linear in four unknowns: 1 /
efficiency, ``block_seconds``, ``call_seconds`` and
``int8_seconds_per_param``; they are found by least squares on the
relative error, and each row's predicted / measured printed with them.
``pc_train.hardware.CPU_TIMES`` holds the result.

    python tools/fit_step_time.py run1.txt run2.txt:1,2 run3.txt
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from calibrate_estimate import LAYOUTS

from pc_train.cost import estimate, model_shape
from pc_train.hardware import DeviceInfo
from pc_train.models import resolve_model

MODEL, SEQ, MICRO = "llama-small", 128, 2  # calibrate_estimate's defaults


def _measured_tokens_per_second(path: str) -> tuple[list[float], set[int]]:
    name, _, skip = path.partition(":")
    text = Path(name).read_text().splitlines()
    rows = [line for line in text if line.startswith("| ") and "MiB" in line]
    if len(rows) != len(LAYOUTS):
        raise SystemExit(f"{name}: {len(rows)} rows, expected {len(LAYOUTS)} (a whole run)")
    speeds = [float(row.split("|")[7].strip().replace(",", "")) for row in rows]
    return speeds, {int(n) for n in skip.split(",") if n}


UNKNOWNS = ("block_seconds", "call_seconds", "int8_seconds_per_param")


def _seconds(
    shape: Any, options: Any, world: int, base: DeviceInfo, efficiency: float, unit: str = ""
) -> float:
    """The predicted step with one unknown at 1 (the others at 0)."""
    values = [1.0 if name == unit else 0.0 for name in UNKNOWNS]
    device = replace(
        base, efficiency=efficiency, ranks_per_core=max(1.0, world / 2),
        block_seconds=values[0], call_seconds=values[1], int8_seconds_per_param=values[2],
    )  # fmt: skip
    return estimate(shape, options, world, MICRO, SEQ, "fp32", device).step_seconds


def main() -> int:
    runs = [_measured_tokens_per_second(path) for path in sys.argv[1:]]
    if not runs:
        print(__doc__)
        return 2
    shape = model_shape(resolve_model(MODEL, SEQ))
    base = DeviceInfo.detect(2)
    features, targets, names = [], [], []
    for number, (world, _nodes, options) in enumerate(LAYOUTS, start=1):
        if options.pp > 1:
            options = replace(options, microbatches=options.pp)

        rest = _seconds(shape, options, world, base, 1e12)  # bytes at bandwidths: no unknown
        row = [_seconds(shape, options, world, base, 1.0) - rest]
        row += [_seconds(shape, options, world, base, 1e12, name) - rest for name in UNKNOWNS]
        tokens = estimate(shape, options, world, MICRO, SEQ, "fp32", base).tokens_per_step
        measured = [tokens / speeds[number - 1] for speeds, skip in runs if number not in skip]
        features.append([*row, rest])
        targets.append(statistics.mean(measured))
        names.append(f"{options.describe()} (world {world})")
    x = torch.tensor(features, dtype=torch.float64)
    y = torch.tensor(targets, dtype=torch.float64)
    fixed = x[:, -1]
    solution = torch.linalg.lstsq(x[:, :-1] / y[:, None], ((y - fixed) / y)[:, None]).solution
    coef = solution.squeeze(1)
    print(
        f"efficiency {1 / coef[0].item():.3f}, block_seconds {coef[1].item():.3g}, "
        f"call_seconds {coef[2].item():.3g}, int8_seconds_per_param {coef[3].item():.3g}"
    )
    predicted = x[:, :-1] @ coef + fixed
    within = 0
    for name, p, m in zip(names, predicted.tolist(), targets, strict=True):
        within += abs(p / m - 1) <= 0.25
        print(f"{name:45s} predicted {p * 1e3:7.1f} ms  measured {m * 1e3:7.1f} ms  {p / m:.2f}")
    print(f"{within} of {len(names)} rows within 25 %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
