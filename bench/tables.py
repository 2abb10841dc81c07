"""The output side of a bench script, written once: a Markdown table, a JSON file, a PNG plot.

A script builds its rows and draws its own axes; this module holds what every script did the same
way (the table's header and alignment row, matplotlib without a display, the folders made before
a write). Used by bench/tiers.py, bench/tiers_slo.py and bench/sparse.py --kernel.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence


def markdown_table(header: Sequence[str], align: str, rows: Iterable[Sequence[object]]) -> str:
    """A GitHub Markdown table; `align` has one letter per column, l (left) or r (right)."""
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r}: one of l or r for each of {len(header)} columns")
    lines = [_row(header), "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {row!r} has {len(row)} cells, the header {len(header)}")
        lines.append(_row(str(cell) for cell in row))
    return "\n".join(lines)


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display); imported only by a run that plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, dpi: int = 100) -> None:
    fig.tight_layout()
    _make_parent(path)
    fig.savefig(path, dpi=dpi)


def write_json(path: str, data: dict) -> None:
    _make_parent(path)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def save_outputs(json_path: str | None, data: Callable[[], dict], plot_path: str | None,
                 draw: Callable[[str], None]) -> None:
    """The --json and --plot of a run, each only where its path was given."""
    if json_path:
        write_json(json_path, data())
    if plot_path:
        draw(plot_path)


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (results are per box)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                        "unknown CPU")
    except OSError:
        return "unknown CPU"


CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16",
             "amx_int8", "amx_bf16")
"""The flags the CPU kernels' choices depend on (issue 44: say which box gave a figure)."""


def cpu_line() -> str:
    """'CPU: <model name>, <cores> cores; flags: avx2 fma ...' (those of CPU_FLAGS it has)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln.split(":", 1)[1] for ln in f if ln.startswith("flags")),
                             "").split())
    except OSError:
        pass
    have = " ".join(f for f in CPU_FLAGS if f in flags) or "none of " + " ".join(CPU_FLAGS)
    return f"CPU: {cpu_name()}, {os.cpu_count()} cores; flags: {have}"


def _make_parent(path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
