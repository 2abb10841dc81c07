"""The command line as a user types it: a quick completion, one-line errors for models that cannot
load, and one-line start-up errors for settings, flags and the port, before the model loads."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import httpx
import pytest

from server_fixtures import MODEL, free_port, server_process, wait_healthy

TIERSERVE = shutil.which("tierserve", path=str(Path(sys.executable).parent)) or \
    shutil.which("tierserve")
"""The installed console script (.venv/bin/tierserve), what a user runs."""
STARTUP_LINES = (" INFO tierserve.engine.build: device: ",
                 " INFO tierserve.engine.worker.backend_choice: attention backends:",
                 " INFO tierserve.engine.llm_engine: engine ready: ")
"""Start-up lines the engine logs at info, the default level of serve and generate alike."""
FAST_S = 15.0
"""A start-up error comes this soon: before the model loads (a first load compiles for minutes)."""


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierserve.server.cli", *args], capture_output=True,
                          text=True, timeout=300)


def clean_env() -> dict[str, str]:
    """This environment without TIERSERVE_* settings, so only the test's own reach the server."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TIERSERVE_")} | \
        {"OMP_WAIT_POLICY": "PASSIVE"}


def refused(*args: str) -> str:
    """Run `tierserve ARGS`; it must exit non-zero within FAST_S with one line on stderr (blank
    lines aside) and no traceback. Returns that line."""
    assert TIERSERVE, "the tierserve console script is not installed next to this Python"
    start = time.monotonic()
    r = subprocess.run([TIERSERVE, *args], capture_output=True, text=True, timeout=120,
                       env=clean_env())
    took = time.monotonic() - start
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1, r.stderr
    assert took < FAST_S, f"{took:.1f} s: {r.stderr}"
    return lines[0]


def test_generate_prints_a_completion():
    r = run("generate", "The capital of France is", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    # info by default: the engine's start-up shows on stderr, as serve's does (minutes of a
    # first native build are not silent); stdout holds only the completion
    assert all(line in r.stderr for line in STARTUP_LINES), r.stderr
    assert "INFO" not in r.stdout


def test_bad_model_is_one_line_error(tmp_path):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 100)
    for model, words, cmd in [("/no/such/model.gguf", "not found", ["generate", "hi"]),
                              (str(truncated), "cut.gguf", ["serve", "--port", "0"])]:
        r = run(*cmd, "--model", model)
        assert r.returncode == 2, (cmd, r.stderr)
        assert "Traceback" not in r.stderr
        err = [l for l in r.stderr.splitlines() if l.startswith("tierserve: error:")]
        assert len(err) == 1 and words in err[0], r.stderr
        if words == "not found":  # found before the engine starts building (and imports torch)
            assert "device:" not in r.stderr, r.stderr


# ---- start-up errors: one line, in seconds, before the model loads ----------------------------


def test_a_missing_model_is_refused_before_torch_loads():
    """serve's first check after the settings and the port: a model that is neither a file, a
    folder nor an alias is one line within a second or so (nothing imported torch yet)."""
    line = refused("serve", "/no/such/model.gguf", "--log-level", "warning")
    assert line == ("tierserve: error: model '/no/such/model.gguf' not found: not a file, a "
                    "directory or one of ['smollm2-135m']")


def test_busy_port_is_refused_before_the_model_loads():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        line = refused("serve", "--port", str(port))
    assert line == f"tierserve serve: port {port} on 127.0.0.1 is in use; use --port"


@pytest.mark.parametrize("yaml_text,words", [
    ("port: 9000\nmax_num_seqs: lots\n", "c.yaml:2: max_num_seqs: expected an integer, got 'lots'"),
    ("port: 9000\nenable_prefix_caching: sometimes\n",
     "c.yaml:2: enable_prefix_caching: expected one of 1/true/yes/0/false/no, got 'sometimes'"),
    ("port: 9000\n  max_num_seqs: [8\n", "c.yaml:2:15: not valid YAML: mapping values are not "
                                         "allowed here"),
    ("max_num_seq: 8\n", "c.yaml:1: unknown setting 'max_num_seq'; did you mean 'max_num_seqs'?"),
])
def test_bad_yaml_is_one_line_naming_file_line_and_key(tmp_path, yaml_text, words):
    (tmp_path / "c.yaml").write_text(yaml_text)
    line = refused("serve", "--config", str(tmp_path / "c.yaml"))
    assert line.startswith("tierserve serve: ") and line.endswith(words), line


@pytest.mark.parametrize("args,words", [
    # no abbreviations: a near miss is an error, never silently another flag
    (["serve", "--max-num-seq", "8"], "unknown flag --max-num-seq (did you mean --max-num-seqs?)"),
    (["serve", "--max-num-seqs", "lots"], "argument --max-num-seqs: expected an integer, got 'lots'"),
    (["serve", "--kv-cache-memory-bytes", "lots"], "not a byte size: 'lots'"),
    (["serve", "--log-level", "loud"], "log_level must be one of critical, error, warning"),
    (["serve", "other-model", "--model", MODEL], f"two models given: 'other-model' and --model "
                                                 f"'{MODEL}'; give one"),
    (["serv"], "unknown command 'serv'; did you mean serve?"),
])
def test_bad_flag_is_one_line_with_the_nearest_real_one(args, words):
    line = refused(*args)
    assert line.startswith("tierserve") and words in line, line


def test_version_and_the_bare_command():
    assert TIERSERVE
    r = subprocess.run([TIERSERVE, "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == f"tierserve {version('tierserve')}\n", r.stderr
    # alone, like `git`: the commands, one line each, and a usage exit status
    r = subprocess.run([TIERSERVE], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr == "", r.stderr
    listed = {ln.split()[0] for ln in r.stdout.splitlines() if ln.startswith("  ")}
    assert listed == {"serve", "generate", "route", "bench-backends"}, r.stdout


def test_serve_takes_the_model_positionally(tmp_path):
    """`tierserve serve MODEL`, as `vllm serve MODEL`; SIGTERM then ends it cleanly."""
    assert TIERSERVE
    port = free_port()
    cmd = [TIERSERVE, "serve", MODEL, "--port", str(port), "--kv-cache-memory-bytes", "256MiB",
           "--max-model-len", "1024", "--disk-tier-dir", str(tmp_path / "kv")]
    with server_process(cmd, port, tmp_path / "server.log", clean_env()) as server:
        wait_healthy(server, 300)
        models = httpx.get(server.v1 + "/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
    assert server.proc.returncode == 0, server.log()
    assert all(line in server.log() for line in STARTUP_LINES), server.log()
    assert "Traceback" not in server.log()
