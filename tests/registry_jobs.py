"""Checks that ask the package registry (pip's resolver over PyPI's metadata) start in the
background as soon as the session has collected them: they wait on the network, not the CPU, so
they overlap the model tests instead of adding minutes of their own. A test module registers
each job at import (`@job("name")`), its test carries `@pytest.mark.registry("name")` and calls
`result("name")`; conftest starts every job whose test was selected (pytest_collection_finish)."""

from __future__ import annotations

import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

_JOBS: dict[str, Callable[[Path], Any]] = {}
_RUNNING: dict[str, Future] = {}
_POOL = ThreadPoolExecutor(max_workers=3, thread_name_prefix="registry")


def job(name: str):
    """Register fn(folder) -> result as the job `name` (fn gets a fresh temporary folder)."""
    def register(fn: Callable[[Path], Any]) -> Callable[[Path], Any]:
        _JOBS[name] = fn
        return fn
    return register


def _run(name: str) -> Any:
    return _JOBS[name](Path(tempfile.mkdtemp(prefix=f"registry-{name}-")))


def start(names: set[str]) -> None:
    for name in sorted(names - set(_RUNNING)):
        _RUNNING[name] = _POOL.submit(_run, name)


def result(name: str, timeout: float = 1800) -> Any:
    """The job's result (started now if nothing started it)."""
    start({name})
    return _RUNNING[name].result(timeout)
