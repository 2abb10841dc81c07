"""engine/worker/loaders/gguf_kquants.py, GGUF's Q5_0/Q5_1 and K-quant types decoded with torch,
checked against the gguf package: the fp32 bits of gguf.quants.dequantize on random blocks of
every type, in several shapes, with the fp16 scale fields at fp16's edges (zero, subnormal,
negative, the largest, infinity, NaN: the products' NaNs must match to the payload) and every
byte value at every byte position of the blocks; the sizes agree with the package's; a read-only
memory map decodes without a warning; a row of part blocks, or bytes of another size, is
refused; the GGUF loader decodes these types with this module, not the package."""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest
import torch

from tierserve.engine.worker.loaders.gguf_kquants import (BLOCK_BYTES, BLOCK_SIZE, KQUANT_TYPES,
                                                          dequantize)

gguf = pytest.importorskip("gguf")

HALF_FIELDS = {"Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
"""Byte offsets of each type's fp16 fields in its block (scale d, and the minimum's scale)."""
EDGES = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x7C00,
                  0xFC00, 0x7E00, 0xFE9F, 0x7C09, 0x3C00, 0xBE00, 0x1419], np.uint16)
"""fp16 bits: +-0, +-smallest subnormal, largest subnormal, smallest normal, +-65504, +-inf,
quiet NaN, negative NaN with a payload, signalling NaN, 1, -1.5, about 1e-3."""


def _raw(kind: str, shape: tuple[int, ...], rng, every_byte: bool = False) -> np.ndarray:
    """Random blocks for a tensor of numpy shape `shape`, as gguf's reader gives them (uint8, the
    last dim in bytes). every_byte: each byte position runs through all 256 values (a random
    order per position; 256 blocks or more). The fp16 fields take every edge value in turn."""
    n = int(np.prod(shape)) // BLOCK_SIZE[kind]
    if every_byte:
        assert n % 256 == 0
        column = np.arange(256, dtype=np.uint8)[:, None]
        blocks = rng.permuted(np.tile(column, (n // 256, BLOCK_BYTES[kind])), axis=0)
    else:
        blocks = rng.integers(0, 256, size=(n, BLOCK_BYTES[kind]), dtype=np.uint8)
    for at in HALF_FIELDS[kind]:
        blocks[:, at:at + 2] = np.resize(rng.permutation(EDGES), n).view(np.uint8).reshape(n, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // BLOCK_SIZE[kind] * BLOCK_BYTES[kind])


def _same_bits(raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> None:
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 in the package
        want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]))
    got = dequantize(raw, kind, shape)
    assert got.dtype == torch.float32 and tuple(got.shape) == tuple(want.shape) == shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), kind


@pytest.mark.parametrize("kind", KQUANT_TYPES)
@pytest.mark.parametrize("shape", [(3, 512), (1, 256), (5, 2, 256), (7, 768)])
def test_random_blocks_give_the_gguf_packages_bits(kind, shape):
    _same_bits(_raw(kind, shape, np.random.default_rng(len(shape) * 1000 + shape[-1])), kind,
               shape)


@pytest.mark.parametrize("kind", KQUANT_TYPES)
def test_every_byte_value_at_every_position(kind):
    shape = (256, BLOCK_SIZE[kind]) if BLOCK_SIZE[kind] == 256 else (32, 256)
    _same_bits(_raw(kind, shape, np.random.default_rng(11), every_byte=True), kind, shape)


def test_q5_rows_of_a_few_blocks():
    """Q5_0 and Q5_1 rows of 32 and 96 weights (blocks of 32, not 256)."""
    rng = np.random.default_rng(5)
    for kind in ("Q5_0", "Q5_1"):
        for shape in [(4, 32), (9, 96)]:
            _same_bits(_raw(kind, shape, rng), kind, shape)


def test_sizes_are_the_packages():
    assert set(KQUANT_TYPES) == set(BLOCK_BYTES) == set(BLOCK_SIZE) >= {"Q4_K", "Q5_K", "Q6_K"}
    for kind in KQUANT_TYPES:
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]] == \
            (BLOCK_SIZE[kind], BLOCK_BYTES[kind])


def test_a_read_only_memory_map_decodes_without_a_warning(tmp_path):
    rng = np.random.default_rng(3)
    for kind in ("Q4_K", "Q5_0"):
        raw = _raw(kind, (2, 512), rng)
        path = tmp_path / f"{kind}.bin"
        raw.tofile(path)
        mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
        frozen = raw.copy()
        frozen.flags.writeable = False
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = [dequantize(a, kind, (2, 512)) for a in (mapped, frozen)]
        assert torch.equal(got[0].view(torch.int32), got[1].view(torch.int32))
        _same_bits(mapped, kind, (2, 512))
        del mapped


@pytest.mark.parametrize("kind", KQUANT_TYPES)
def test_part_blocks_and_wrong_sizes_are_refused(kind):
    raw = _raw(kind, (2, 512), np.random.default_rng(1))
    half = BLOCK_SIZE[kind] // 2
    with pytest.raises(ValueError, match=f"{kind} rows of {half} weights are not whole blocks"):
        dequantize(raw, kind, (1024 // half, half))
    with pytest.raises(ValueError, match=f"{kind} tensor of shape .* needs"):
        dequantize(raw, kind, (3, 512))
    with pytest.raises(ValueError, match="Q4_0 is not one of"):
        dequantize(raw, "Q4_0", (2, 512))


def test_the_gguf_loader_decodes_k_quants_with_this_module(monkeypatch):
    """gguf_loader._tensor sends these types here (the package's decoder would fail), and keeps
    them out of the block types the quantized kernels read."""
    from tierserve.engine.worker.loaders import gguf_loader

    def refuse(*_):
        raise AssertionError("decoded by the gguf package")

    monkeypatch.setattr(gguf.quants, "dequantize", refuse)
    config = types.SimpleNamespace(architecture="qwen2")
    for kind in ("Q4_K", "Q6_K", "Q5_1"):
        raw = _raw(kind, (3, 512), np.random.default_rng(2))
        t = types.SimpleNamespace(name="blk.0.ffn_up.weight", data=raw, shape=(512, 3),
                                  tensor_type=gguf.GGMLQuantizationType[kind])
        got = gguf_loader._tensor("m.gguf", t, "model.layers.0.mlp.up_proj.weight", config)
        want = dequantize(raw, kind, (3, 512))
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        assert kind not in gguf_loader.QUANT_BLOCK_TYPES
