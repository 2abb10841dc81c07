"""GGUF's 5- and 6-bit and K-quant blocks kept as they are (issue 45): Q5_0, Q5_1, Q4_K, Q5_K and
Q6_K held as codes with an fp32 scale and offset per group (gguf_kquants.code_groups) and run by
the native q4_linear / q8_linear (Q6_K with groups of 16). Checked against the gguf package: the
weights the kernels decode equal gguf.quants.dequantize's on random blocks, the fp16 fields at
their finite edges (zero, subnormal, negative, the largest); each linear gives the fp32 path's
bits on those weights at 1 to 17 rows (both ways through the kernel); a fused layer mixing types
(Gemma 3's Q5_0 q and k beside a Q8_0 v, a Q6_K part beside Q5_0) and an embedding table of
each type read back the same values; gguf_covers takes the mixes and names what it cannot take.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tierserve.engine.worker.loaders.gguf_kquants import CODE_GROUP_TYPES, code_groups
from tierserve.engine.worker.loaders.source import QuantBlocks
from tierserve.engine.worker.quant import (TABLE_BLOCK_TYPES, Int4Weight, Int8GroupWeight,
                                           QuantizationError, gguf_covers, gguf_uncovered,
                                           gguf_weight, table_weight)
from tierserve.kernels.native import load_extension

gguf = pytest.importorskip("gguf")
ops = load_extension()
pytestmark = pytest.mark.skipif(ops is None, reason="the native extension is not built")

HALF_FIELDS = {"Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
               "Q8_0": (0,)}
BLOCK = {"Q5_0": (32, 22), "Q5_1": (32, 24), "Q4_K": (256, 144), "Q5_K": (256, 176),
         "Q6_K": (256, 210), "Q8_0": (32, 34)}
FINITE_EDGES = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF,
                         0x3C00, 0xBE00, 0x1419, 0x2E66], np.uint16)
"""fp16 bits: +-0, +-smallest subnormal, largest subnormal, smallest normal, +-65504, 1, -1.5,
about 1e-3, about 0.1 (inf and NaN scales: the decoders' own tests cover them)."""


def _raw(kind: str, n: int, k: int, rng) -> np.ndarray:
    size, nbytes = BLOCK[kind]
    blocks = rng.integers(0, 256, size=(n * k // size, nbytes), dtype=np.uint8)
    for at in HALF_FIELDS[kind]:
        edges = np.resize(rng.permutation(FINITE_EDGES), len(blocks))
        small = rng.uniform(1e-4, 1e-2, len(blocks)).astype(np.float16).view(np.uint16)
        pick = np.where(rng.random(len(blocks)) < 0.3, edges, small)
        blocks[:, at:at + 2] = pick.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, k // size * nbytes)


def _gguf(raw: np.ndarray, kind: str, n: int, k: int) -> torch.Tensor:
    with np.errstate(all="ignore"):
        w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(np.ascontiguousarray(w)).reshape(n, k)


def _blocks(kind: str, n: int, k: int, seed: int) -> tuple[QuantBlocks, torch.Tensor]:
    raw = _raw(kind, n, k, np.random.default_rng(seed))
    return QuantBlocks(raw, kind, (n, k), None), _gguf(raw, kind, n, k)


def _same_as_fp32(w, ref: torch.Tensor, rows=(1, 3, 8, 17)) -> None:
    """The weight's products equal the fp32 path's (packed panels of the same values) bit for
    bit: a few rows through the registers, more through the decoded panels."""
    panels = ops.pack_linear_weight(ref)
    for m in rows:
        x = torch.randn(m, ref.shape[1], generator=torch.Generator().manual_seed(m))
        got, want = w(x, ops), ops.packed_linear(x, panels, ref.shape[0])
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), m


@pytest.mark.parametrize("kind", CODE_GROUP_TYPES)
def test_each_type_decodes_to_ggufs_values_and_multiplies_as_fp32(kind):
    n, k = 40, 512
    b, ref = _blocks(kind, n, k, seed=len(kind) + ord(kind[1]))
    g = code_groups(b.raw, kind, (n, k))
    assert g.group == (16 if kind == "Q6_K" else 32)
    assert int(g.codes.max()) <= {"Q4_K": 15, "Q6_K": 63}.get(kind, 31)
    w = gguf_weight(["w"], {"w": b}, native=True)
    assert isinstance(w, Int4Weight if kind == "Q4_K" else Int8GroupWeight)
    assert torch.equal(w.decode(ops), ref)  # values: gguf's d * 0 may be -0.0 where ours is +0.0
    _same_as_fp32(w, ref)


def test_a_fused_layer_may_mix_types():
    """q and k Q5_0 with v Q8_0 (Gemma 3 270M's Q4_K_M), and a Q6_K part beside Q5_0 (groups of
    16 and 32: the 32s' scales repeated)."""
    for kinds in (("Q5_0", "Q5_0", "Q8_0"), ("Q6_K", "Q5_0"), ("Q4_K", "Q5_1", "Q8_0")):
        parts = [_blocks(kind, 16 * (i + 1), 256, seed=i) for i, kind in enumerate(kinds)]
        blocks = {f"w{i}": b for i, (b, _) in enumerate(parts)}
        w = gguf_weight(list(blocks), blocks, native=True)
        ref = torch.cat([r for _, r in parts])
        assert isinstance(w, Int8GroupWeight)
        assert torch.equal(w.decode(ops), ref), kinds
        _same_as_fp32(w, ref, rows=(1, 9))


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q5_0", "Q4_K"])
def test_an_embedding_table_reads_the_files_values(kind):
    assert kind in TABLE_BLOCK_TYPES
    b, ref = _blocks(kind, 48, 256, seed=7)
    ids = torch.tensor([0, 47, 3, 3, 20])
    table = table_weight("gguf-exact", "model.embed_tokens.weight", torch.empty(0),
                         {"model.embed_tokens.weight": b}, native=True, readable=True)
    assert torch.equal(table.rows(ids), ref[ids])
    _same_as_fp32(table, ref, rows=(1, 5))  # the tied LM head


def test_groups_of_16_need_the_native_kernels():
    b, _ = _blocks("Q6_K", 16, 256, seed=3)
    with pytest.raises(QuantizationError, match="Q6_K"):
        gguf_weight(["w"], {"w": b}, native=False)


def test_covers_takes_mixed_layers_and_names_the_rest():
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"] + [
        f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    kinds = ["Q5_0", "Q5_0", "Q8_0", "Q4_K", "Q5_0", "Q5_0", "Q6_K"]
    blocks = {n: QuantBlocks(None, kind, (16, 256), None) for n, kind in zip(names, kinds)}
    weights = dict.fromkeys(names + ["model.norm.weight"])
    assert gguf_covers(weights, blocks) and gguf_uncovered(weights, blocks) is None
    blocks[names[-1]] = QuantBlocks(None, "Q3_K", (16, 256), None)
    assert not gguf_covers(weights, blocks)
    assert gguf_uncovered(weights, blocks) == "model.layers.0.mlp.down_proj.weight (Q3_K)"
    del blocks[names[0]]  # an fp16 tensor: no blocks
    assert gguf_uncovered(weights, blocks) == ("model.layers.0.self_attn.q_proj.weight "
                                               "(not block-quantized)")
