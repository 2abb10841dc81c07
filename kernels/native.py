"""The native CPU extension (kernels/csrc): paged decode attention, the quantized linears and the
fused element-wise ops of the model path. Compiled once per machine and version with the host's
compiler for this CPU (-march=native) and cached under ~/.cache/tierserve/ext/<tag>, the tag
keyed by the CPU, the sources, the flags, torch and Python; where it cannot be built (no
compiler, no ninja), `load_extension()` returns None with the reason logged and callers use torch
ops.

The build never depends on where the sources live: they are copied into the build folder and
compiled from there, so a second checkout, the wheel in another venv or CI's fresh clone of the
same version finds the finished module (a `built` marker beside it) and imports it without
running ninja; nothing rebuilds because another checkout started. A build logs a line per
compiled file (on 2 cores the whole build takes a few minutes, once).

TIERSERVE_NATIVE=0 builds and loads nothing (the router then uses torch SDPA and every op stays
in torch). TIERSERVE_NATIVE_OPS=0 keeps the model's linears and element-wise ops in torch (the
attention backend is chosen separately, by the router)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import glob
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import threading
import time

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


def _headers() -> list[str]:
    return sorted(glob.glob(os.path.join(_CSRC, "*.h")))


def _tag() -> str:
    """Binaries are built with -march=native against one torch and one Python: key the cache by
    this CPU, the sources' contents (not their paths), the flags and those versions."""
    import torch

    info = _cpu_info()[:4096] or platform.processor()
    h = hashlib.sha256(info.encode() + " ".join(_CFLAGS).encode())
    h.update(f"torch {torch.__version__} python {sys.version_info[:2]}".encode())
    for path in _SOURCES + _headers():
        with open(path, "rb") as f:
            h.update(os.path.basename(path).encode() + b"\0" + f.read())
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
            log.debug("removing a stale build lock %s (a build that was killed left it)", baton)
            os.remove(baton)
        yield


def _holder(guard) -> str:
    """The pid the flock's holder wrote ("unknown" before it has written it)."""
    guard.seek(0)
    return guard.read().strip() or "unknown"


@functools.cache
def load_extension():
    """The compiled module, or None (with the reason logged) where it cannot be built or
    TIERSERVE_NATIVE=0."""
    if os.environ.get("TIERSERVE_NATIVE", "1") == "0":
        log.info("native CPU kernels off (TIERSERVE_NATIVE=0): torch ops only")
        return None
    name = f"tierserve_native_{_tag()}"
    build_dir = cache_dir("ext", name)
    try:
        ext = _import_built(name, build_dir)
        if ext is None:
            os.makedirs(build_dir, exist_ok=True)
            with _build_guard(build_dir):
                ext = _import_built(name, build_dir) or _build(name, build_dir)
    except Exception as e:  # no compiler, no ninja, build error
        log.warning("native CPU kernels unavailable (%s: %s)", type(e).__name__, str(e)[:200])
        return None
    spin = os.environ.get("TIERSERVE_SPIN_US")
    if spin:
        ext.set_spin_us(int(spin))
    return ext


_MARKER = "built"
"""Written (by rename) after a build succeeded: its presence means the module beside it is whole."""


def _import_built(name: str, build_dir: str):
    """The finished module of an earlier build (any checkout, any venv with this torch), or None."""
    so = os.path.join(build_dir, name + ".so")
    if not (os.path.exists(os.path.join(build_dir, _MARKER)) and os.path.exists(so)):
        return None
    spec = importlib.util.spec_from_file_location(name, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    log.info("native CPU kernels loaded from %s", build_dir)
    return module


def _build(name: str, build_dir: str):
    """Compile from a copy of the sources inside build_dir (ninja's commands then name no
    checkout), logging each file as it is compiled; mark the result whole."""
    from torch.utils.cpp_extension import load

    src = os.path.join(build_dir, "src")
    os.makedirs(src, exist_ok=True)
    for path in _SOURCES + _headers():
        shutil.copyfile(path, os.path.join(src, os.path.basename(path)))
    sources = [os.path.join(src, os.path.basename(p)) for p in _SOURCES]
    log.info("building the native CPU kernels for this CPU: %d files, a few minutes on 2 cores, "
             "once per version and machine (%s)", len(sources), build_dir)
    done = threading.Event()
    watch = threading.Thread(target=_report_objects, args=(build_dir, sources, done), daemon=True)
    watch.start()
    try:
        ext = load(name=name, sources=sources, build_directory=build_dir, extra_cflags=_CFLAGS,
                   extra_include_paths=[src], extra_ldflags=["-fopenmp"], verbose=False)
    finally:
        done.set()
        watch.join()
    tmp = os.path.join(build_dir, f".{_MARKER}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(f"{time.time():.0f}\n")
    os.replace(tmp, os.path.join(build_dir, _MARKER))
    return ext


def _report_objects(build_dir: str, sources: list[str], done: threading.Event,
                    every_s: float = 0.5) -> None:
    """One log line per object file ninja finishes (torch's build prints nothing until the end)."""
    t0, seen = time.monotonic(), set()
    stems = {os.path.splitext(os.path.basename(s))[0]: os.path.basename(s) for s in sources}
    while True:
        finished = done.wait(every_s)
        for stem, source in stems.items():
            obj = os.path.join(build_dir, stem + ".o")
            if stem not in seen and os.path.exists(obj) and os.path.getmtime(obj) >= _START:
                seen.add(stem)
                log.info("native CPU kernels: compiled %s (%d/%d, %.0f s)", source, len(seen),
                         len(stems), time.monotonic() - t0)
        if finished:
            return


_START = time.time() - 1
"""Objects older than this process were left by an earlier build, not compiled now."""


def fused_ops():
    """The extension when the model's fused element-wise ops may use it, else None."""
    if os.environ.get("TIERSERVE_NATIVE_OPS", "1") == "0":
        return None
    return load_extension()
