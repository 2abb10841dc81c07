"""CPU backend: decode attention in a small C++ kernel that reads K/V blocks in place; prefill
chunks through torch SDPA (inherited).

The gather that torch_sdpa does for decode writes every context token's K and V to a scratch
tensor and reads it back: three times the bytes attention needs. The kernel (csrc/paged_decode.cpp)
is compiled on first use with the host's compiler for this CPU, and cached.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from dataclasses import dataclass

import torch

from kernels.base import BatchLayout, Capabilities
from kernels.torch_sdpa import TorchSdpaBackend

log = logging.getLogger(__name__)

_SRC = os.path.join(os.path.dirname(__file__), "csrc", "paged_decode.cpp")


_CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def _cpu_tag() -> str:
    """Binaries are built with -march=native: key the cache by this CPU, the source and flags."""
    info = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            info = "".join(l for l in f if l.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    with open(_SRC, "rb") as f:
        src = f.read()
    return hashlib.sha256(info.encode() + src + " ".join(_CFLAGS).encode()).hexdigest()[:12]


@functools.cache
def load_extension():
    """The compiled kernel module, or None (with the reason logged) where it cannot be built."""
    from torch.utils.cpp_extension import load

    name = f"tierserve_paged_decode_{_cpu_tag()}"
    build_dir = os.path.join(os.path.expanduser(os.environ.get("TIERSERVE_CACHE", "~/.cache/tierserve")),
                             "ext", name)
    os.makedirs(build_dir, exist_ok=True)
    try:
        return load(name=name, sources=[_SRC], build_directory=build_dir,
                    extra_cflags=_CFLAGS,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, build error: fall back to torch_sdpa
        log.warning("cpu_native kernel unavailable (%s: %s)", type(e).__name__, str(e)[:200])
        return None


@dataclass
class NativeDecodeMeta:
    batch: int
    block_size: int
    block_tables: torch.Tensor
    context_lens: torch.Tensor


class CpuNativeBackend(TorchSdpaBackend):
    name = "cpu_native"
    capabilities = Capabilities(
        device_types=("cpu",),
        dtypes=(torch.float32,),
        kv_dtypes=("auto", "float32"),
        requires=("ninja",),
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ext = load_extension()
        if self.ext is None:
            raise RuntimeError("the cpu_native kernel could not be built (see the log)")

    def _decode_meta(self, layout: BatchLayout) -> NativeDecodeMeta:
        b = layout.num_decodes
        return NativeDecodeMeta(b, layout.block_size, layout.block_tables[:b].contiguous(),
                                torch.tensor(layout.context_lens[:b], dtype=torch.long))

    def _decode(self, q, kv_cache, m: NativeDecodeMeta):
        out = self.ext.paged_decode(q[:m.batch], kv_cache, m.block_tables, m.context_lens,
                                    m.block_size, self.scale)
        return out.view(m.batch, -1)
