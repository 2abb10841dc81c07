"""Module-level lazy exports: a package names what it offers without importing it (so the
torch-free parts stay torch-free until a heavy name is asked for)."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_getattr(package: str, table: dict[str, str]) -> Callable[[str], Any]:
    """A module __getattr__ that imports table[name] (a module path) on first use."""
    def __getattr__(name: str) -> Any:
        if name in table:
            return getattr(importlib.import_module(table[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__


def lazy_class(table: dict[str, str], name: str, what: str) -> type:
    """table[name] ("module:Class"), imported on first use; an unknown name is a ValueError that
    lists the valid ones (the registries of attention backends and KV tiers)."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r} (valid: {', '.join(table)})")
    module, cls = table[name].split(":")
    return getattr(importlib.import_module(module), cls)
