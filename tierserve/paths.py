"""Where tierserve keeps files of its own: one cache root for the native extension's build, the
backend profile and the disk tier's default folder."""

from __future__ import annotations

import os

CACHE_ENV = "TIERSERVE_CACHE"


def cache_dir(*parts: str) -> str:
    """$TIERSERVE_CACHE (default ~/.cache/tierserve), joined with `parts`; not created here."""
    root = os.path.expanduser(os.environ.get(CACHE_ENV) or "~/.cache/tierserve")
    return os.path.join(root, *parts)
