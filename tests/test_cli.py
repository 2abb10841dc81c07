"""The command line: a quick completion, and one-line errors for models that cannot load."""

from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierserve.server.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_generate_prints_a_completion():
    r = run("generate", "The capital of France is", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_bad_model_is_one_line_error(tmp_path):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 100)
    for model, words in [("/no/such/model.gguf", "not found"), (str(truncated), "cut.gguf")]:
        for cmd in (["generate", "hi"], ["serve", "--port", "0"]):
            r = run(*cmd, "--model", model)
            assert r.returncode == 2, (cmd, r.stderr)
            assert "Traceback" not in r.stderr
            err = [l for l in r.stderr.splitlines() if l.startswith("tierserve: error:")]
            assert len(err) == 1 and words in err[0], r.stderr
