"""The backend profile: measured attention times per model shape, written by
`tierserve bench-backends` and read by the router.

File format (JSON):
    {"version": 1, "shapes": {SHAPE_KEY: {"prefill": {backend: ms}, "decode": {backend: ms}}}}
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tierserve.paths import cache_dir

VERSION = 1


def default_profile_path() -> Path:
    return Path(cache_dir("backend_profile.json"))


def shape_key(device_type: str, capability: tuple[int, int] | None, dtype: torch.dtype,
              kv_dtype: str, num_heads: int, num_kv_heads: int, head_dim: int,
              page_size: int) -> str:
    """One key per device class and attention shape (what the timings depend on)."""
    cc = f"sm{capability[0]}{capability[1]}" if capability else "any"
    return (f"{device_type}/{cc}/{str(dtype).removeprefix('torch.')}/kv-{kv_dtype}/"
            f"h{num_heads}-kv{num_kv_heads}-d{head_dim}/p{page_size}")


def load_profile(path: str | Path | None) -> dict[str, dict[str, dict[str, float]]]:
    """Shapes -> phase -> backend -> ms; empty when the file is absent or unreadable."""
    p = Path(path) if path else default_profile_path()
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return {}
    return data.get("shapes", {})


def save_profile(path: str | Path | None, key: str, timings: dict[str, dict[str, float]]) -> Path:
    """Merge one shape's timings into the profile file (other shapes are kept)."""
    p = Path(path) if path else default_profile_path()
    shapes = load_profile(p)
    shapes[key] = timings
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"version": VERSION, "shapes": shapes}, indent=1, sort_keys=True))
    return p
