"""CPU backend: decode attention in a small C++ kernel that reads K/V blocks in place; prefill
chunks through torch SDPA (inherited).

The gather that torch_sdpa does for decode writes every context token's K and V to a scratch
tensor and reads it back: three times the bytes attention needs. The kernel (csrc/paged_decode.cpp)
is part of the native extension (kernels/native.py), compiled on first use for this CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.base import BatchLayout, Capabilities
from kernels.native import load_extension
from kernels.torch_sdpa import TorchSdpaBackend


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
