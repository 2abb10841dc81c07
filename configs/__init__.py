"""YAML presets, installed as package data: `tierserve serve --config NAME` takes a preset by name
(default, ...) as well as a path."""

from __future__ import annotations

from pathlib import Path

DIR = Path(__file__).resolve().parent


def presets() -> list[str]:
    return sorted(p.stem for p in DIR.glob("*.yaml"))


def resolve(name_or_path: str | Path) -> Path:
    """A path as given when it exists, else the preset of that name (with or without .yaml)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    preset = DIR / f"{path.name.removesuffix('.yaml')}.yaml"
    if path.parent == Path(".") and preset.is_file():
        return preset
    raise FileNotFoundError(f"no config file {str(name_or_path)!r} and no preset of that name; "
                            f"presets: {', '.join(presets())}")
