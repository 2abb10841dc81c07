"""Device and dtype choice, and GPU KV cache sizing, as pure functions of what torch reports; plus
the command line on this (GPU-less) machine."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tierserve.engine.worker.device import (DeviceError, choose_device, choose_dtype, detect,
                                     gpu_kv_cache_bytes)

GiB = 1 << 30


def h100(i: int) -> str:
    return "NVIDIA H100, capability 9.0"


@pytest.mark.parametrize("requested, available, count, device, reason", [
    ("auto", True, 1, "cuda:0", "auto: CUDA available (NVIDIA H100, capability 9.0)"),
    ("auto", False, 0, "cpu", "auto: no GPU, using the CPU"),
    ("auto", False, 2, "cpu", "auto: no GPU, using the CPU"),  # count without a usable driver
    ("cpu", True, 1, "cpu", "requested"),
    ("cuda", True, 2, "cuda:0", "requested (NVIDIA H100, capability 9.0)"),
    ("CUDA:1", True, 2, "cuda:1", "requested (NVIDIA H100, capability 9.0)"),
])
def test_choose_device(requested, available, count, device, reason):
    choice = choose_device(requested, available, count, h100)
    assert (choice.device, choice.reason) == (device, reason)


@pytest.mark.parametrize("requested, available, count, words", [
    ("cuda", False, 0, "no GPU is visible"),
    ("cuda:0", False, 0, "no GPU is visible"),
    ("cuda:2", True, 2, "only 2 GPU(s) visible (cuda:0 .. cuda:1)"),
    ("tpu", True, 1, "expected one of auto, cpu, cuda, cuda:N"),
    ("cuda:x", True, 1, "expected one of"),
])
def test_choose_device_refuses(requested, available, count, words):
    with pytest.raises(DeviceError) as e:
        choose_device(requested, available, count)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("requested, device_type, cap, dtype, reason", [
    ("auto", "cuda", (9, 0), "bfloat16", "auto: bfloat16 on compute capability 9.0 >= 8.0"),
    ("auto", "cuda", (8, 0), "bfloat16", "auto: bfloat16 on compute capability 8.0 >= 8.0"),
    ("auto", "cuda", (7, 5), "float16", "auto: float16 on compute capability 7.5 < 8.0"),
    ("auto", "cpu", None, "float32", "auto: float32 on the CPU"),
    ("float32", "cuda", (9, 0), "float32", "requested"),
    ("float16", "cuda", (9, 0), "float16", "requested"),
    ("bfloat16", "cpu", None, "bfloat16", "requested"),
])
def test_choose_dtype(requested, device_type, cap, dtype, reason):
    choice = choose_dtype(requested, device_type, cap)
    assert (choice.dtype, choice.reason) == (dtype, reason)


def test_choose_dtype_refuses_unknown():
    with pytest.raises(DeviceError, match="expected one of auto, float32, float16, bfloat16"):
        choose_dtype("int8", "cpu", None)


def test_detect_here_is_cpu_float32():
    dev, dt = detect("auto", "auto")
    assert (dev.device, dt.dtype) == ("cpu", "float32")


def test_gpu_kv_cache_bytes():
    # 0.9 x 80 GiB = 72 GiB; minus 16 GiB weights, 2 GiB activations, 1 GiB outside torch.
    assert gpu_kv_cache_bytes(80 * GiB, 0.9, 16 * GiB, 2 * GiB, GiB) == 53 * GiB
    assert gpu_kv_cache_bytes(80 * GiB, 1.0, 16 * GiB, 2 * GiB) == 62 * GiB
    assert gpu_kv_cache_bytes(1000, 0.5, 100, 150) == 250


def test_gpu_kv_cache_bytes_nothing_left():
    with pytest.raises(DeviceError) as e:
        gpu_kv_cache_bytes(80 * GiB, 0.5, 38 * GiB, 2 * GiB)
    msg = str(e.value)
    assert "no GPU memory left for the KV cache" in msg and "\n" not in msg
    assert "40.00 GiB" in msg and "38.00 GiB" in msg and "2.00 GiB" in msg
    assert "--gpu-memory-utilization" in msg and "--max-num-batched-tokens" in msg


@pytest.mark.parametrize("utilization", [0.0, -0.1, 1.5])
def test_gpu_kv_cache_bytes_bad_utilization(utilization):
    with pytest.raises(DeviceError, match="expected a fraction in"):
        gpu_kv_cache_bytes(80 * GiB, utilization, GiB, GiB)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierserve", *args], capture_output=True,
                          text=True, timeout=300)


def test_serve_on_cuda_without_gpu_is_one_line_error():
    r = run("serve", "--device", "cuda", "--port", "0")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    err = [line for line in r.stderr.splitlines() if line.startswith("tierserve: error:")]
    assert len(err) == 1 and "no GPU is visible" in err[0], r.stderr


def test_generate_auto_picks_cpu_float32():
    r = run("generate", "The capital of France is", "--max-tokens", "4", "--device", "auto",
            "--dtype", "auto", "--log-level", "info")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "device: cpu (auto: no GPU, using the CPU); dtype: float32 (auto: float32 on the CPU)" \
        in r.stderr


def test_settings_reach_the_engine_config():
    from tierserve.engine.llm import build_config
    from tierserve.server.cli import build_parser
    from tierserve.server.config import FIELDS, load_config

    args = build_parser().parse_args(["serve", "--device", "cuda:1", "--dtype", "float16",
                                      "--gpu-memory-utilization", "0.8"])
    cfg = load_config(None, {k: getattr(args, k) for k in FIELDS})
    assert cfg.kv_cache_memory_bytes is None  # auto: sized by the engine
    eng = build_config(**cfg.engine_kwargs())
    assert (eng.device, eng.dtype, eng.gpu_memory_utilization) == ("cuda:1", "float16", 0.8)
    assert eng.cache.kv_cache_memory_bytes is None
    sized = load_config("default", {"kv_cache_memory_bytes": "512MiB"})
    assert sized.kv_cache_memory_bytes == 512 << 20
