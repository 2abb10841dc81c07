"""Start `tierserve serve` as a subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
API_KEY = "test-key"


@dataclass
class RunningServer:
    base_url: str
    """http://127.0.0.1:PORT (no /v1)."""
    proc: subprocess.Popen
    log_path: Path

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def run_server(tmp_dir: Path, *args: str, timeout: float = 180.0) -> Iterator[RunningServer]:
    """The server with small, fast settings plus `args`; stopped (SIGTERM, then kill) at exit."""
    port = free_port()
    log_path = tmp_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "tierserve.server.cli", "serve", "--port", str(port),
           "--kv-cache-memory-bytes", "256MiB", "--max-model-len", "2048", "--log-level",
           "warning", *args]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    server = RunningServer(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        _wait_healthy(server, timeout)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_healthy(server: RunningServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server not healthy after {timeout}s:\n{server.log()}")


def scrape(server: RunningServer) -> dict[str, float]:
    """/metrics as {'name{labels}': value} via prometheus_client's text parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k != "model_name")
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out
