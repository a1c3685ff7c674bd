"""Draw a simulated schedule: a text timeline or a PNG, no plotting library.

In the text form each column is one time unit (the simulation's
``resolution``), each row a rank; a cell shows the action kind and the
microbatch (``F3``, ``B0``), ``.`` is idle.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from pc_pipeline.actions import ActionKind
from pc_pipeline.simulate import Simulation

__all__ = ["draw_png", "draw_text"]

_COLORS = {
    ActionKind.FORWARD: (66, 133, 244),
    ActionKind.BACKWARD: (52, 168, 83),
    ActionKind.BACKWARD_INPUT: (129, 201, 149),
    ActionKind.BACKWARD_WEIGHT: (251, 188, 5),
}
_IDLE = (240, 240, 240)
_EDGE = (40, 40, 40)


def draw_text(sim: Simulation, resolution: float = 1.0) -> str:
    """One row per rank, one column per ``resolution`` time units."""
    if resolution <= 0:
        raise ValueError(f"resolution must be positive, got {resolution}.")
    width = round(sim.makespan / resolution)
    cell = max(
        (len(f"{s.action.kind.value}{s.action.microbatch}") for r in sim.spans for s in r),
        default=2,
    )
    lines = [f"{sim.schedule.name}: bubble {sim.bubble_fraction:.1%}, makespan {sim.makespan:g}"]
    for rank, spans in enumerate(sim.spans):
        row = ["." * cell] * width
        for span in spans:
            label = f"{span.action.kind.value}{span.action.microbatch}".ljust(cell)
            for t in range(round(span.start / resolution), round(span.end / resolution)):
                row[t] = label
        lines.append(f"rank {rank} | " + " ".join(row))
    return "\n".join(lines)


def _png(width: int, height: int, rows: list[bytes]) -> bytes:
    def chunk(tag: bytes, data: bytes) -> bytes:
        body = tag + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    raw = b"".join(b"\x00" + row for row in rows)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw, 9))
        + chunk(b"IEND", b"")
    )


def draw_png(
    sim: Simulation, path: str | Path, *, pixels_per_unit: int = 24, row_height: int = 24
) -> Path:
    """Write the timeline as a PNG: one band per rank; forward blue,
    backward green, input gradient light green, weight gradient yellow,
    idle grey. Returns the path."""
    width = max(1, round(sim.makespan * pixels_per_unit))
    height = max(1, sim.schedule.num_ranks * row_height)
    image = [[_IDLE] * width for _ in range(height)]
    for rank, spans in enumerate(sim.spans):
        top = rank * row_height
        for span in spans:
            x0 = round(span.start * pixels_per_unit)
            x1 = max(x0 + 1, round(span.end * pixels_per_unit))
            color = _COLORS[span.action.kind]
            for y in range(top + 1, top + row_height - 1):
                for x in range(x0, min(x1, width)):
                    edge = x in (x0, x1 - 1) or y in (top + 1, top + row_height - 2)
                    image[y][x] = _EDGE if edge else color
    rows = [bytes(v for pixel in row for v in pixel) for row in image]
    out = Path(path)
    out.write_bytes(_png(width, height, rows))
    return out
