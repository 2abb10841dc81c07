"""Start `tierserve serve` as a subprocess on a free loopback port, for the server tests."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import httpx

if TYPE_CHECKING:
    from tierserve.server.config import ServerConfig

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
    """The server with small, fast settings plus `args`, healthy; stopped at exit. The disk tier
    (on by default) gets a folder of its own under `tmp_dir`: no server sees another's blocks."""
    port = free_port()
    own_disk = [] if "--disk-tier-dir" in args else ["--disk-tier-dir", str(tmp_dir / f"kv-{port}")]
    cmd = [sys.executable, "-m", "tierserve.server.cli", "serve", "--port", str(port),
           "--kv-cache-memory-bytes", "256MiB", "--max-model-len", "2048", "--log-level",
           "warning", *own_disk, *args]
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    with server_process(cmd, port, tmp_dir / f"server-{port}.log", env) as server:
        wait_healthy(server, timeout)
        yield server


@contextlib.contextmanager
def server_process(cmd: list[str], port: int, log_path: Path, env: dict[str, str], *,
                   cwd: Path = ROOT, stop_grace: float = 30.0,
                   preexec_fn: Callable[[], None] | None = None) -> Iterator[RunningServer]:
    """`cmd`, a server that listens on 127.0.0.1:`port`, run with its output in `log_path`;
    not waited on (see `wait_healthy`). At exit, `stop_server`."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=preexec_fn)
    server = RunningServer(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        yield server
    finally:
        stop_server(server, stop_grace)


def stop_server(server: RunningServer, grace: float = 30.0) -> None:
    """SIGTERM (a clean shutdown), then SIGKILL if it lingers past `grace` s."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(grace)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()


def wait_healthy(server: RunningServer, timeout: float) -> None:
    """Until GET /health answers 200; raises (with the log) if it exits or `timeout` s pass."""
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


@contextlib.contextmanager
def serve_in_process(config: ServerConfig):
    """The app `tierserve serve` runs, on uvicorn in a thread of this process, so a test can
    read the engine's tiers while it talks to the server over HTTP."""
    import uvicorn

    from tierserve.engine.async_engine import AsyncEngine
    from tierserve.engine.llm import build_config
    from tierserve.engine.llm_engine import LLMEngine
    from tierserve.server.app import build_app

    if config.disk_tier_dir is None:  # the default disk tier: a folder of this server's own
        config = dataclasses.replace(config, disk_tier_dir=tempfile.mkdtemp(prefix="kv-"))
    engine = AsyncEngine(LLMEngine(build_config(**config.engine_kwargs())), config.max_queue)
    app = build_app(config, engine)
    engine.start()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=config.port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield engine
    finally:
        server.should_exit = True
        thread.join(30)
        engine.stop()
        engine.engine.close()
