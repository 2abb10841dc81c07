"""The native extension's build lock (kernels/native.py: _build_guard): a build killed while it
holds the lock leaves nothing the next start waits on; a live build is waited for, by name. No
compiler needed: the guard alone, held by real processes."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

from tierserve.kernels.native import _build_guard

# A process that takes the guard, then, as torch's build does, creates its `lock` baton, says so
# and builds for `argv[2]` seconds.
_HOLDER = """
import os, sys, time
from tierserve.kernels.native import _build_guard
with _build_guard(sys.argv[1]):
    open(os.path.join(sys.argv[1], "lock"), "w").close()
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    os.remove(os.path.join(sys.argv[1], "lock"))
"""


def _start_holder(build_dir, seconds: float) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(build_dir), str(seconds)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def _enter_guard(build_dir, timeout: float) -> float | None:
    """Seconds until this process held the guard, or None if it waited past `timeout` (a daemon
    thread: a hang fails the test instead of hanging the run)."""
    took = []

    def enter():
        t0 = time.monotonic()
        with _build_guard(str(build_dir)):
            took.append(time.monotonic() - t0)

    t = threading.Thread(target=enter, daemon=True)
    t.start()
    t.join(timeout)
    return took[0] if took else None


def test_a_build_killed_holding_the_lock_does_not_hang_the_next_start(tmp_path):
    holder = _start_holder(tmp_path, 600)
    assert (tmp_path / "tierserve.flock").read_text().strip() == str(holder.pid)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert (tmp_path / "lock").exists()  # what the killed build left

    assert _enter_guard(tmp_path, timeout=10) is not None
    assert not (tmp_path / "lock").exists()
    assert (tmp_path / "tierserve.flock").read_text().strip() == str(os.getpid())


def test_a_live_build_is_waited_for_and_named(tmp_path, caplog):
    holder = _start_holder(tmp_path, 1.5)
    try:
        with caplog.at_level(logging.INFO, logger="tierserve.kernels.native"):
            waited = _enter_guard(tmp_path, timeout=60)
        assert holder.wait(timeout=30) == 0  # it finished its build, baton and all
    finally:
        holder.kill()
    assert waited is not None and waited > 0.5  # this process went on only after that
    assert f"waiting for process {holder.pid}," in caplog.text
    assert "stale" not in caplog.text
