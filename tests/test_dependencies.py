"""Our pins resolve on a real Linux box. PyPI's torch 2.13.0 for Linux pins triton and the CUDA 13
packages itself; a developer's box gets a local `+cpu` build that pins nothing, so a conflict (a
dev extra pinning triton==3.9.0) only shows on a user's machine. Here pip's resolver runs for Linux
x86-64 against torch's own requirement lines (tests/data, copied verbatim from the wheel's
METADATA) and every requirement of ours: the package, the `dev` and `gpu` extras.

The resolver fetches metadata from the package registry (the `--platform` options make it pick the
Linux wheels, not this machine's). torch itself stands in as a small wheel carrying its lines: the
real one is ~0.5 GB and its CUDA runtime packages (which no requirement of ours names: checked) are
GBs more, so those lines are checked by name instead."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import registry_jobs

ROOT = Path(__file__).resolve().parent.parent
TORCH_LINES = ROOT / "tests" / "data" / "torch-2.13.0-linux-x86_64.requires"
STAND_IN = "torch-linux-requires"
PLATFORM = ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64", "--python-version", "3.11",
            "--implementation", "cp", "--only-binary=:all:"]


def torch_requirements() -> list[Requirement]:
    lines = TORCH_LINES.read_text().splitlines()
    return [Requirement(ln.split(":", 1)[1]) for ln in lines if ln.startswith("Requires-Dist:")]


def _cuda_runtime(req: Requirement) -> bool:
    return req.name.startswith(("nvidia-", "cuda-"))


def our_requirements(extras: tuple[str, ...] = ("dev", "gpu")) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    return [Requirement(r) for r in lines]


def _stand_in_wheel(folder: Path, requires: list[Requirement]) -> None:
    """A wheel named STAND_IN 2.13.0 that requires what torch requires on Linux."""
    info = f"{STAND_IN.replace('-', '_')}-2.13.0.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {STAND_IN}\nVersion: 2.13.0\n" + \
        "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {f"{info}/METADATA": meta,
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    with zipfile.ZipFile(folder / f"{STAND_IN.replace('-', '_')}-2.13.0-py3-none-any.whl", "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in (*files, f"{info}/RECORD")))


def resolve(requirements: list[str], tmp: Path) -> tuple[int, str, dict]:
    """pip's resolver for Linux x86-64 over `requirements` and torch's lines (stand-in wheel)."""
    _stand_in_wheel(tmp, [r for r in torch_requirements() if not _cuda_runtime(r)])
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
           "--target", str(tmp / "target"), "--report", str(tmp / "report.json"),
           "--find-links", str(tmp), "--progress-bar", "off", *PLATFORM,
           f"{STAND_IN}==2.13.0", *requirements]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    report = json.loads((tmp / "report.json").read_text()) if r.returncode == 0 else {}
    return r.returncode, r.stdout + r.stderr, report


def _ours_without_torch(reqs: list[Requirement]) -> list[str]:
    return [str(r) for r in reqs if r.name != "torch"]


def test_we_pin_the_torch_release_the_lines_describe():
    (torch,) = [r for r in our_requirements(()) if r.name == "torch"]
    assert str(torch.specifier) == "==2.13.0"
    assert "Version: 2.13.0" in TORCH_LINES.read_text()
    # torch's CUDA runtime packages are left out of the resolution: nothing of ours may name one
    assert not [r for r in our_requirements() if _cuda_runtime(r)]


def test_every_package_both_pin_agrees():
    """The quick check, offline: where torch and we name the same package, torch's pinned version
    satisfies ours."""
    pins = {r.name: r for r in torch_requirements() if r.marker is None or
            r.marker.evaluate({"platform_system": "Linux", "python_version": "3.11", "extra": ""})}
    for ours in our_requirements():
        theirs = pins.get(ours.name)
        if theirs is None:
            continue
        exact = [s.version for s in theirs.specifier if s.operator == "=="]
        for version in exact:
            assert ours.specifier.contains(version, prereleases=True), \
                f"{ours} excludes torch's own pin {theirs}"


@registry_jobs.job("resolve-ours")
def _resolve_ours(tmp: Path):
    return resolve(_ours_without_torch(our_requirements()), tmp)


@registry_jobs.job("resolve-conflict")
def _resolve_conflict(tmp: Path):
    """What the dev extra held before: triton==3.9.0 beside torch 2.13.0's triton==3.7.1."""
    return resolve(["triton==3.9.0"], tmp)


@pytest.mark.slow
@pytest.mark.registry("resolve-ours")
def test_the_package_and_its_extras_resolve_against_torch_on_linux():
    code, out, report = registry_jobs.result("resolve-ours")
    assert code == 0, out[-4000:]
    chosen = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
    assert chosen["triton"] == "3.7.1"  # torch's, whoever else asks for triton
    for req in torch_requirements():  # a CUDA package pulled in by someone else agrees with torch
        if _cuda_runtime(req) and req.name in chosen:
            assert req.specifier.contains(chosen[req.name], prereleases=True), (req, chosen)


@pytest.mark.slow
@pytest.mark.registry("resolve-conflict")
def test_a_conflicting_pin_fails_the_resolution():
    code, out, _ = registry_jobs.result("resolve-conflict")
    assert code != 0
    assert "triton" in out and ("conflict" in out.lower() or "ResolutionImpossible" in out), out[-3000:]
