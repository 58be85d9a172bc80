"""Aligned text tables for ``atopgpu``: the one helper both its tables (the figures, ``--health``) are drawn with."""

from __future__ import annotations

from typing import Sequence

from atopgpud_tw import codec


def columns(header: Sequence[str], rows: list[list[str]], left: set[int]) -> list[str]:
    """Header and rows as aligned lines: columns in `left` to the left, the rest right.

    Every cell is shown as data (`codec.printable`): names, bus ids and labels
    come from a daemon, a metrics page or another user's process.
    """
    table = [list(header), *([codec.printable(cell) for cell in row] for row in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = []
    for row in table:
        cells = [cell.ljust(width) if i in left else cell.rjust(width) for i, (cell, width) in
                 enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return lines
