"""Process set-up that must happen before torch starts its thread pool."""

from __future__ import annotations

import os


def set_omp_env() -> None:
    """Passive OpenMP waiting: on a busy 2-core box, spinning threads make torch 4-7x slower."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def configure_threads(num_threads: int | None) -> int:
    import torch

    n = num_threads or available_cores()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
