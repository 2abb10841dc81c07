"""The native CPU extension (kernels/csrc): paged decode attention and the fused element-wise ops
of the model path. Compiled on first use with the host's compiler for this CPU (-march=native)
and cached under ~/.cache/tierserve/ext, keyed by the CPU, the sources and the flags. Where it
cannot be built (no compiler, no ninja), `load_extension()` returns None with the reason logged
and callers use torch ops.

TIERSERVE_NATIVE_OPS=0 keeps the model's element-wise ops in torch (the attention backend is
chosen separately, by the router)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import hashlib
import logging
import os
import platform

from tierserve.paths import cache_dir

log = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = sorted(glob.glob(os.path.join(_CSRC, "*.cpp")))
# -fopenmp for the `omp simd` loops; parallel loops run on the extension's own worker pool
# (csrc/thread_pool.h: workers that stay awake for a bounded time between loops; TIERSERVE_SPIN_US
# sets that time, default 100 us, 0 sleeps at once as PASSIVE OpenMP does). (fused_ops.cpp turns FMA
# contraction off for itself; attention keeps it: 25% faster.)
# TIERSERVE_NATIVE_MARCH builds for another x86 level than this CPU's (e.g. haswell: AVX2 + FMA
# without AVX-512), so one box can check the kernels' other paths (tests/test_quant.py).
_CFLAGS = ["-O3", f"-march={os.environ.get('TIERSERVE_NATIVE_MARCH', 'native')}", "-fopenmp"]


@functools.cache
def _cpu_info() -> str:
    """The CPU's model name and flag lines ("" where /proc/cpuinfo cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(l for l in f if l.startswith(("model name", "flags")))
    except OSError:
        return ""


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists this CPU flag (amx_bf16, avx512f, ...)."""
    return any(flag in line.split() for line in _cpu_info().splitlines()
               if line.startswith("flags"))


def _tag() -> str:
    """Binaries are built with -march=native: key the cache by this CPU, the sources and flags."""
    info = _cpu_info()[:4096] or platform.processor()
    h = hashlib.sha256(info.encode() + " ".join(_CFLAGS).encode())
    for path in _SOURCES + glob.glob(os.path.join(_CSRC, "*.h")):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


@contextlib.contextmanager
def _build_guard(build_dir: str):
    """One tierserve process builds or loads the extension at a time, under an flock the OS
    releases when its holder dies, so a killed build never leaves a lock that is waited on. The
    holder writes its pid into the flock file: a waiter names the process it waits for. torch's
    own build lock (a `lock` file that waiters poll until it disappears) does stay behind when a
    build is killed, and every later start would wait on it forever; holding the flock, any such
    file is stale and is removed."""
    # "a+": opening must not truncate the file, which holds the current holder's pid
    with open(os.path.join(build_dir, "tierserve.flock"), "a+") as guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for process %s, which builds or loads the native CPU kernels in %s",
                     _holder(guard), build_dir)
            fcntl.flock(guard, fcntl.LOCK_EX)
        guard.truncate(0)
        guard.write(f"{os.getpid()}\n")
        guard.flush()
        baton = os.path.join(build_dir, "lock")
        if os.path.exists(baton):
            log.warning("removing a stale build lock %s (a build that was killed left it)", baton)
            os.remove(baton)
        yield


def _holder(guard) -> str:
    """The pid the flock's holder wrote ("unknown" before it has written it)."""
    guard.seek(0)
    return guard.read().strip() or "unknown"


@functools.cache
def load_extension():
    """The compiled module, or None (with the reason logged) where it cannot be built."""
    from torch.utils.cpp_extension import load

    name = f"tierserve_native_{_tag()}"
    build_dir = cache_dir("ext", name)
    os.makedirs(build_dir, exist_ok=True)
    try:
        with _build_guard(build_dir):
            ext = load(name=name, sources=_SOURCES, build_directory=build_dir,
                       extra_cflags=_CFLAGS, extra_include_paths=[_CSRC],
                       extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, build error
        log.warning("native CPU kernels unavailable (%s: %s)", type(e).__name__, str(e)[:200])
        return None
    spin = os.environ.get("TIERSERVE_SPIN_US")
    if spin:
        ext.set_spin_us(int(spin))
    return ext


def fused_ops():
    """The extension when the model's fused element-wise ops may use it, else None."""
    if os.environ.get("TIERSERVE_NATIVE_OPS", "1") == "0":
        return None
    return load_extension()
