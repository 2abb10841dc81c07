"""Which device and dtype the engine runs on, and how much GPU memory the KV cache may take.

The choices are pure functions of what torch reports (passed in), so they are tested without a
GPU; only `detect` and `measure_gpu_kv_bytes` touch torch, and they import it lazily."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from tierserve.engine.worker.model_runner import ModelRunner

DEVICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPES = ("auto", "float32", "float16", "bfloat16")
BF16_MIN_CAPABILITY = (8, 0)
"""Ampere and newer run bfloat16 at full speed; older GPUs get float16."""
CPU_KV_CACHE_BYTES = 1 << 30
"""KV cache of a CPU engine when kv_cache_memory_bytes is not given."""

_CUDA = re.compile(r"^cuda(?::(\d+))?$")


class DeviceError(ValueError):
    """A device, dtype or memory setting this machine cannot honour; the message is one line."""


@dataclass(frozen=True)
class DeviceChoice:
    """The torch device the engine runs on, and why."""

    device: str
    """'cpu' or 'cuda:N'."""
    reason: str
    """In words, for the start-up log and GET /v1/backends."""

    @property
    def type(self) -> str:
        return self.device.split(":")[0]

    @property
    def index(self) -> int | None:
        return int(self.device.split(":")[1]) if self.type == "cuda" else None


@dataclass(frozen=True)
class DtypeChoice:
    """The compute dtype of weights and activations, and why."""

    dtype: str
    """float32, float16 or bfloat16."""
    reason: str


def choose_device(requested: str, cuda_available: bool, device_count: int,
                  describe: Callable[[int], str] | None = None) -> DeviceChoice:
    """auto: cuda:0 when torch sees a GPU, else cpu; cuda or cuda:N must name a visible GPU.
    describe(i) names GPU i for the reason ("NVIDIA H100, capability 9.0")."""
    req = requested.strip().lower()
    count = device_count if cuda_available else 0
    about = (lambda i: f" ({describe(i)})" if describe else "")
    if req == "cpu":
        return DeviceChoice("cpu", "requested")
    if req == "auto":
        if count == 0:
            return DeviceChoice("cpu", "auto: no GPU, using the CPU")
        return DeviceChoice("cuda:0", f"auto: CUDA available{about(0)}")
    m = _CUDA.match(req)
    if m is None:
        raise DeviceError(f"--device {requested!r}: expected one of {', '.join(DEVICES)}")
    if count == 0:
        raise DeviceError(f"--device {requested}: no GPU is visible to torch "
                          "(torch.cuda.is_available() is False); use --device cpu or auto")
    index = int(m.group(1) or 0)
    if index >= count:
        raise DeviceError(f"--device {requested}: only {count} GPU(s) visible "
                          f"(cuda:0 .. cuda:{count - 1})")
    return DeviceChoice(f"cuda:{index}", f"requested{about(index)}")


def choose_dtype(requested: str, device_type: str,
                 capability: tuple[int, int] | None) -> DtypeChoice:
    """auto: bfloat16 on CUDA with capability >= 8.0, float16 below it, float32 on the CPU."""
    req = requested.strip().lower()
    if req not in DTYPES:
        raise DeviceError(f"--dtype {requested!r}: expected one of {', '.join(DTYPES)}")
    if req != "auto":
        return DtypeChoice(req, "requested")
    if device_type != "cuda":
        return DtypeChoice("float32", "auto: float32 on the CPU")
    if capability is None:
        return DtypeChoice("float16", "auto: float16 (compute capability unknown)")
    cap = "%d.%d" % capability
    floor = "%d.%d" % BF16_MIN_CAPABILITY
    if tuple(capability) >= BF16_MIN_CAPABILITY:
        return DtypeChoice("bfloat16", f"auto: bfloat16 on compute capability {cap} >= {floor}")
    return DtypeChoice("float16", f"auto: float16 on compute capability {cap} < {floor}")


def detect(device: str = "auto", dtype: str = "auto") -> tuple[DeviceChoice, DtypeChoice]:
    """Both choices from what torch reports on this machine."""
    import torch

    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0

    def describe(i: int) -> str:
        return "%s, capability %d.%d" % (torch.cuda.get_device_name(i),
                                         *torch.cuda.get_device_capability(i))

    dev = choose_device(device, available, count, describe)
    cap = torch.cuda.get_device_capability(dev.index) if dev.type == "cuda" else None
    return dev, choose_dtype(dtype, dev.type, cap)


def gpu_kv_cache_bytes(total_bytes: int, utilization: float, weights_bytes: int,
                       activation_peak_bytes: int, other_bytes: int = 0) -> int:
    """vLLM's meaning of --gpu-memory-utilization: this process may use `utilization` of the GPU's
    total memory; the KV cache gets what the weights, the activation peak of a full step and
    memory outside torch's allocator (CUDA context, other processes: other_bytes) leave."""
    if not 0.0 < utilization <= 1.0:
        raise DeviceError(f"--gpu-memory-utilization {utilization}: expected a fraction in (0, 1]")
    budget = int(total_bytes * utilization)
    left = budget - weights_bytes - activation_peak_bytes - other_bytes
    if left <= 0:
        raise DeviceError(
            f"no GPU memory left for the KV cache: {utilization:g} x {_gib(total_bytes)} = "
            f"{_gib(budget)}, weights {_gib(weights_bytes)}, activation peak "
            f"{_gib(activation_peak_bytes)}, other {_gib(other_bytes)}; raise "
            "--gpu-memory-utilization or lower --max-num-batched-tokens")
    return left


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def measure_gpu_kv_bytes(runner: ModelRunner, utilization: float) -> int:
    """KV bytes for a CUDA runner whose weights are loaded: profile one full-budget step, drop
    the runner's (small, profiling) KV cache, then apply gpu_kv_cache_bytes."""
    import torch

    dev = runner.device
    peak = runner.profile_activation_peak()
    runner.kv_caches = []
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(dev)
    free, total = torch.cuda.mem_get_info(dev)
    other = max(0, total - free - torch.cuda.memory_reserved(dev))
    return gpu_kv_cache_bytes(total, utilization, weights, peak, other)


def cuda_capability(device: str) -> tuple[int, int] | None:
    """The GPU's compute capability, or None off CUDA."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.get_device_capability(torch.device(device))


def torch_cuda_count() -> int:
    import torch

    return torch.cuda.device_count()
