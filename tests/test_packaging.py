"""The wheel is the whole product: one `tierserve` package, the native kernels' sources and the
presets inside, nothing installed at the top level but `tierserve`. And Hugging Face's `kernels`
distribution (which transformers needs) lives beside it without a collision."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: float = 600):
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r


def test_wheel_holds_one_package_and_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"tierserve"}
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["tierserve"]
    # every C++ source and header the native build reads, and every preset
    for pattern, inside in (("kernels/csrc", "tierserve/kernels/csrc"), ("configs", "tierserve/configs")):
        for f in (ROOT / pattern).iterdir():
            if f.suffix in (".cpp", ".h", ".yaml"):
                assert f"{inside}/{f.name}" in names, f.name
    # every Python package of the checkout (a new subpackage must be listed in pyproject.toml)
    for folder, pkg in (("server", "server"), ("engine", "engine"), ("kernels", "kernels")):
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.relative_to(ROOT / folder).as_posix()
            assert f"tierserve/{pkg}/{rel}" in names, rel


@pytest.mark.slow
def test_installed_wheel_runs_outside_the_checkout(wheel_venv, tmp_path):
    """The wheel in a fresh venv (conftest's wheel_venv: installed --no-deps, dependencies from the
    test environment's site-packages). From a folder outside the checkout: import, and `tierserve
    generate` on the embedded model with the native extension the checkout's tests built: the
    same version elsewhere compiles nothing (the build folder is keyed by the sources' contents,
    not their place)."""
    venv, py, site = wheel_venv.root, wheel_venv.python, wheel_venv.site
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("PYTHONPATH", None)
    from tierserve.kernels.native import load_extension
    assert load_extension() is not None  # built here, from the checkout (at most once a version)

    r = _run([str(py), "-c", "import tierserve, tierserve.kernels.native as n, tierserve.configs as c;"
              "print(tierserve.__version__, tierserve.__file__, n._CSRC, c.resolve('default'))"],
             cwd=work, env=env)
    version, init, csrc, preset = r.stdout.split()
    assert version == __import__("tierserve").__version__
    for path in (init, csrc, preset):
        assert path.startswith(str(site)) and os.path.exists(path), path
    for name in ("server", "engine", "kernels"):
        assert not (site / name).exists()

    t0 = time.monotonic()
    r = _run([str(venv / "bin" / "tierserve"), "generate", "The capital of France is",
              "--max-tokens", "8"], cwd=work, env=env)
    assert "Paris" in r.stdout
    assert "backend cpu_native" in r.stderr, r.stderr[-2000:]
    assert "native CPU kernels loaded from" in r.stderr
    assert "building the native CPU kernels" not in r.stderr and "unavailable" not in r.stderr
    assert time.monotonic() - t0 < 60


def test_hf_kernels_and_tierserve_side_by_side(tmp_path):
    """transformers >= 5.25 imports Hugging Face's top-level `kernels`; ours is tierserve.kernels."""
    code = ("import kernels, transformers, tierserve, tierserve.kernels\n"
            "from transformers import LlamaForCausalLM\n"
            "from tierserve import LLM, SamplingParams\n"
            "from tierserve.kernels import create_backend\n"
            "assert 'site-packages' in kernels.__file__, kernels.__file__\n"
            "print(transformers.__version__)\n")
    _run([sys.executable, "-c", code], cwd=tmp_path)
