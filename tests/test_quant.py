"""Quantized weights (--quantization): the GGUF's own blocks decoded exactly, packed for torch's
weight-only kernels, and the model's quality against the fp32 path (llama.cpp's perplexity
method on tests/data/long_text.md)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tierserve.engine.llm import LLM
from tierserve.engine.worker.loaders.gguf_file import read_gguf
from tierserve.engine.worker.quant import resolve_quantization
from tierserve.engine.worker.loaders import load_model_source
from tierserve.engine.worker.loaders.gguf_loader import unpermute_rope
from tierserve.engine.worker.quant import (GROUP, Int4DotWeight, Int4Groups, Int4Weight,
                                           Int8Groups, Int8GroupWeight, QuantizationError,
                                           blocks_to_groups, gguf_covers, gguf_weight,
                                           pack_q4_dot, quantize_int4, quantize_int8_groups,
                                           unpack_q4_dot)
from tierserve.engine.eval.quant import agreement, perplexity_change, score
from tierserve.kernels.native import cpu_has

TEXT = (Path(__file__).parent / "data" / "long_text.md").read_text()


@pytest.fixture(scope="module")
def source():
    return load_model_source("smollm2-135m")


def _reference(gguf_path: str, name: str) -> np.ndarray:
    # read_gguf gives the gguf package's reader's views (test_loaders checks), in 0.1 s not 5
    t = next(t for t in read_gguf(gguf_path).tensors if t.name == name)
    shape = tuple(int(x) for x in reversed(t.shape))
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)


@pytest.mark.parametrize("gguf_name,hf_name,heads", [
    ("blk.0.ffn_gate.weight", "model.layers.0.mlp.gate_proj.weight", None),
    ("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight", 9),
    ("token_embd.weight", "model.embed_tokens.weight", None)])
def test_blocks_decode_to_the_files_weights(source, gguf_path, gguf_name, hf_name, heads):
    """Q4_1 and Q8_0 blocks read as codes and scales give exactly gguf's dequantized values, in
    the fp32 copy's row order (q's RoPE permutation undone)."""
    b = source.blocks[hf_name]
    ref = _reference(gguf_path, gguf_name)
    if heads:
        ref = unpermute_rope(ref, heads)
    g = blocks_to_groups(b)
    if isinstance(g, Int4Groups):
        got = g.dequantize()
    else:
        got = (g.q.float().view(g.q.shape[0], -1, GROUP) * g.scale[..., None]).view(g.q.shape)
    assert torch.equal(got, torch.from_numpy(ref))
    assert torch.equal(source.weights[hf_name], torch.from_numpy(ref))


def _rows(g: Int8Groups, ids: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Symmetric 8-bit groups' rows `ids` with these scales."""
    q = g.q[ids].float().view(len(ids), -1, GROUP)
    return (q * scale[ids, :, None]).view(len(ids), -1)


def test_packed_kernels_match_their_weights_and_a_wrong_packing_does_not(source):
    g = blocks_to_groups(source.blocks["model.layers.0.mlp.gate_proj.weight"])
    w = g.dequantize()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, w.shape[1], generator=gen)
    ref = x @ w.t()
    err = lambda y: float((y - ref).norm() / ref.norm())  # noqa: E731
    assert err(Int4Weight(g)(x)) < 0.01  # torch's kernel: bf16 activations and scales
    shuffled = Int4Groups(g.codes.view(-1, GROUP).flip(-1).reshape(g.codes.shape), g.scale,
                          g.offset)  # each group's codes reversed: the packing a bug would give
    assert err(Int4Weight(shuffled)(x)) > 0.3
    e = blocks_to_groups(source.blocks["model.embed_tokens.weight"])
    # torch's planes: lookups read the codes kept beside them (torch's packing is private and
    # differs by CPU level), with the planes' own bf16 scales, so the rows are what the head
    # multiplies by; the copy is a byte a weight, counted in the weight bytes
    table = Int8GroupWeight(e, readable=True)
    ids = torch.tensor([0, 1, 15, 16, 31, 32, 63, 64, 49151])
    exact = _rows(e, ids, e.scale)
    assert torch.equal(table.rows(ids), _rows(e, ids, e.scale.to(torch.bfloat16).float()))
    assert torch.allclose(table.rows(ids), exact, rtol=8e-3, atol=0)
    assert table.nbytes == Int8GroupWeight(e).nbytes + e.q.numel()
    with pytest.raises(QuantizationError, match="private layout"):  # no codes kept: refused,
        Int8GroupWeight(e).rows(ids)  # never read out of torch's packing
    with pytest.raises(QuantizationError, match="private layout"):
        Int4Weight(g).decode()
    assert err(Int4Weight(quantize_int4(w))(x)) < 0.01
    from tierserve.kernels.native import fused_ops

    ops = fused_ops()
    # the native kernels decode the weights to fp32 and multiply in the fp32 path's order: the
    # same bits as the fp32 panels of the decoded weights, at every batch size (registers up to
    # a few rows, the fp32 tiles over decoded panels beyond), with a bias too
    panels = ops.pack_linear_weight(w)
    bias = torch.randn(w.shape[0], generator=gen)
    native4 = Int4Weight(g, native=True)
    for m in (1, 2, 3, 5, 64):
        xm = torch.randn(m, w.shape[1], generator=gen)
        assert torch.equal(native4(xm, ops), ops.packed_linear(xm, panels, w.shape[0]))
        assert torch.equal(native4(xm, ops, bias), ops.packed_linear(xm, panels, w.shape[0],
                                                                     bias))
    assert err(Int4Weight(shuffled, native=True)(x, ops)) > 0.3
    assert torch.equal(native4.decode(ops), w)  # --prefill-bf16's weights: exact, or bf16-rounded
    assert torch.equal(native4.decode(ops, bf16=True), w.to(torch.bfloat16))
    assert torch.equal(native4.unpack().codes, g.codes)  # the panel order undone
    assert err(native4(x)) < 0.01  # no extension: torch's packing, made once
    readable4 = Int4Weight(g, native=True, readable=True)  # as --prefill-bf16 asks
    assert readable4.nbytes == Int4Weight(g, native=True).nbytes  # panels: read as they are
    assert err(readable4(x)) < 0.01  # no extension: torch's packing, the codes kept beside it
    assert readable4.nbytes == Int4Weight(g).nbytes + g.codes.numel() // 2
    assert (readable4.decode() - w).abs().max() <= 0.01 * w.abs().max()  # bf16 scales, zeros
    q8 = quantize_int8_groups(w)  # int8 mode: min/max groups of 32, codes 0..255
    back = torch.addcmul(q8.offset[..., None], q8.q.float().view(w.shape[0], -1, GROUP),
                         q8.scale[..., None])
    assert ((back - w.view(back.shape)).abs() <= q8.scale[..., None] / 2 + 1e-6).all()
    assert err(Int8GroupWeight(q8)(x)) < 0.01
    int8 = Int8GroupWeight(q8, native=True)
    int8_panels = ops.pack_linear_weight(int8.rows(torch.arange(w.shape[0])))
    for m in (1, 5, 64):
        xm = torch.randn(m, w.shape[1], generator=gen)
        assert torch.equal(int8(xm, ops), ops.packed_linear(xm, int8_panels, w.shape[0]))
    # the planes' rows: bf16 scales, within about a step of the exact ones
    step = q8.scale[ids[:3]].repeat_interleave(GROUP, 1)
    planes = Int8GroupWeight(q8, readable=True)
    assert ((planes.rows(ids[:3]) - int8.rows(ids[:3])).abs() <= 2 * step).all()
    # the native Q8_0 head, and the embedding rows from the same bytes (exact)
    native = Int8GroupWeight(e, native=True)
    assert torch.equal(native.rows(ids), exact)
    assert torch.equal(native.decode(ops, bf16=True)[ids], exact.to(torch.bfloat16))
    head = ops.pack_linear_weight(native.rows(torch.arange(e.q.shape[0])))
    for m in (1, 4, 50):
        hx = torch.randn(m, e.q.shape[1], generator=gen)
        assert torch.equal(native(hx, ops), ops.packed_linear(hx, head, e.q.shape[0]))
    flipped = Int8Groups(e.q.view(-1, GROUP).flip(-1).reshape(e.q.shape), e.scale)
    href = hx @ native.rows(torch.arange(e.q.shape[0])).t()
    herr = lambda y: float((y - href).norm() / href.norm())  # noqa: E731
    assert herr(Int8GroupWeight(flipped, native=True)(hx, ops)) > 0.3
    assert herr(native(hx)) < 0.01  # no extension: torch's planes, made once


@pytest.mark.parametrize("threads", [1, 2])
def test_gguf_serves_the_fp32_paths_bits_in_one_call_and_layer_by_layer(
        llm, gguf_llm, varied_prompts, monkeypatch, threads):
    """The native kernels decode the file's blocks to the fp32 path's weights and multiply in its
    order, inside the one-call decode stack (decode_forward.cpp takes the codes) and layer by
    layer: greedy tokens and logprobs of --quantization gguf-exact equal none's on the same GGUF, to
    the bit, for contexts of 1 to 1,500 tokens, from a fifth of the weight bytes."""
    from test_native_ops import _CountingOps, _greedy_logprobs

    model = gguf_llm.engine.executor.runner.model
    assert model._stack is not None and len(model._qstack) == 8 * len(model.layers)
    assert model._stack[1].dtype == torch.uint8  # the qkv codes, not fp32 panels
    counting = _CountingOps(model.ops)
    monkeypatch.setattr(model, "ops", counting)
    prompts = [varied_prompts[i] for i in (0, 7, 15)]  # 1, 128 and 1,500 tokens
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fp32 = _greedy_logprobs(llm.engine, prompts, f"fp32-{threads}")
        monkeypatch.setattr(model, "stack_decode_min_batch", 1)
        one_call = _greedy_logprobs(gguf_llm.engine, prompts, f"qstack-{threads}")
        assert counting.calls >= 8 and counting.teams == {threads}
        monkeypatch.setattr(model, "stack_decode_min_batch", 0)
        calls = counting.calls
        by_layer = _greedy_logprobs(gguf_llm.engine, prompts, f"qstack-{threads}", "layers")
        assert counting.calls == calls
    finally:
        torch.set_num_threads(old)
    assert one_call == by_layer == fp32
    assert gguf_llm.engine.executor.facts().weight_bytes * 5 <= llm.engine.executor.facts().weight_bytes


def test_q4_dot_layout_round_trips_and_puts_each_code_where_the_kernel_reads_it():
    """pack_q4_dot (q4i8_linear's layout, kernels/csrc/q4_int8.cpp) keeps every code and fp16
    scale; one code checked at the byte the kernel's 32-byte loads take it from."""
    gen = torch.Generator().manual_seed(3)
    n, k = 40, 96  # rows past a whole group of 16: padding
    g = Int4Groups(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32),
                   torch.rand(n, k // GROUP, generator=gen).half().float(),
                   -torch.rand(n, k // GROUP, generator=gen).half().float())
    packed = pack_q4_dot(g)
    assert packed.shape == (3, 3 * 320) and packed.dtype == torch.uint8
    back = unpack_q4_dot(packed, n)
    assert all(torch.equal(a, b) for a, b in zip(dataclasses.astuple(back), dataclasses.astuple(g)))
    # row 25 = group 1, half 1, row 1 of its 8; k = 32 + 20: block 1, high nibble, v = 1, t = 0
    unit = packed[1, 320:640]
    assert int(unit[160 + 32 + 32 * 1 + 4 * 1 + 0]) >> 4 == int(g.codes[25, 52])
    assert unit[160:176].view(torch.float16)[1].item() == g.scale[25, 1].item()
    assert unit[176:192].view(torch.float16)[1].item() == g.offset[25, 1].item()


def test_q4_dot_packing_is_the_kernels(source):
    """The Python packing the engine loads with and the extension's own q4i8_pack agree."""
    from tierserve.kernels.native import load_extension

    ops = load_extension()
    if ops is None:
        pytest.skip("no native extension")
    g = blocks_to_groups(source.blocks["model.layers.2.mlp.down_proj.weight"])
    assert torch.equal(pack_q4_dot(g), ops.q4i8_pack(g.codes.to(torch.uint8), g.scale, g.offset))


def test_gguf_int8_activations_in_one_call_equal_layer_by_layer(varied_prompts, monkeypatch):
    """--quantization gguf (int8 activations on the Q4 blocks): the one-call decode stack and the
    layer-by-layer path give the same tokens and logprobs to the bit (the same kernel, and a
    row's result does not depend on the batch), for contexts of 1 to 1,500 tokens."""
    from test_native_ops import _CountingOps, _greedy_logprobs

    llm = LLM(quantization="gguf", kv_cache_memory_bytes=1 << 28)
    model = llm.engine.executor.runner.model
    assert isinstance(model.layers[0].mlp.gate_up_proj._quant, Int4DotWeight)
    assert "q4i8_linear" in llm.engine.info.quant_kernels["Int4DotWeight"]
    counting = _CountingOps(model.ops)
    monkeypatch.setattr(model, "ops", counting)
    prompts = [varied_prompts[i] for i in (0, 7, 15)]  # 1, 128 and 1,500 tokens
    monkeypatch.setattr(model, "stack_decode_min_batch", 1)
    one_call = _greedy_logprobs(llm.engine, prompts, "dot")
    assert counting.calls >= 8
    monkeypatch.setattr(model, "stack_decode_min_batch", 0)
    calls = counting.calls
    assert _greedy_logprobs(llm.engine, prompts, "dot", "layers") == one_call
    assert counting.calls == calls


@pytest.fixture(scope="module")
def gguf_llm() -> LLM:
    return LLM(quantization="gguf-exact", kv_cache_memory_bytes=1 << 28)


def test_refusals_name_the_tensor_and_the_mode(source):
    with pytest.raises(QuantizationError, match="model.layers.0.mlp.up_proj.weight"):
        gguf_weight(["model.layers.0.mlp.up_proj.weight"], {})
    with pytest.raises(QuantizationError, match="CUDA with bfloat16, not cuda with float16"):
        resolve_quantization("gguf", "cuda", "float16", True)
    with pytest.raises(QuantizationError, match="compute capability 8.0 or newer.*7.5"):
        resolve_quantization("int4", "cuda", "bfloat16", True, capability=(7, 5))
    assert resolve_quantization("int8", "cuda", "bfloat16", True, capability=(9, 0)) == "int8"
    with pytest.raises(QuantizationError, match="int2"):
        resolve_quantization("int2", "cpu", "float32", True)
    assert resolve_quantization("auto", "cpu", "float32", True) == "gguf-exact"
    assert resolve_quantization("auto", "cpu", "float32", True, int8_dot=True) == "gguf"
    assert resolve_quantization("auto", "cpu", "float32", True, native=False) == "none"
    # auto keeps a GGUF's blocks only where every decoder linear has blocks the kernels take (a
    # fused layer may mix them: tests/test_kquant_linear.py)
    assert gguf_covers(source.weights, source.blocks)
    name = "model.layers.4.self_attn.k_proj.weight"
    assert not gguf_covers(source.weights, {k: v for k, v in source.blocks.items() if k != name})
    mixed = dict(source.blocks, **{name: dataclasses.replace(source.blocks[name], kind="Q8_0")})
    assert gguf_covers(source.weights, mixed)
    other = dict(source.blocks, **{name: dataclasses.replace(source.blocks[name], kind="Q3_K")})
    assert not gguf_covers(source.weights, other)
    assert resolve_quantization("auto", "cpu", "float32", False) == "none"
    assert resolve_quantization("auto", "cuda", "bfloat16", True) == "none"


@pytest.fixture(scope="module")
def quality():
    """Each mode scored on the same 2,048 tokens of real text as the fp32 path (four windows of 512,
    1,788 positions scored)."""
    out = {}
    for mode in ("none", "gguf", "int8", "int4"):
        llm = LLM(quantization=mode, kv_cache_memory_bytes=1 << 28)
        ids = llm.get_tokenizer().encode(TEXT)[:2048]
        out[mode] = (score(llm, ids), llm.engine.executor.facts().weight_bytes, llm.engine.info)
        del llm
    return out


@pytest.mark.parametrize("mode,min_agree,max_ppl", [("gguf", 0.95, 0.01), ("int8", 0.98, 0.01),
                                                    ("int4", 0.92, 0.05)])
def test_quality_against_fp32(quality, mode, min_agree, max_ppl):
    """Top-1 agreement and perplexity against the dequantized fp32 path: issue 31's bounds, issue
    44's for gguf's int8 activations (gguf-exact gives the fp32 path's bits: the test above;
    docs/BENCHMARKS.md has the measured values)."""
    ref, test = quality["none"][0], quality[mode][0]
    assert len(test.top1) == 1788
    assert agreement(test, ref) >= min_agree
    assert abs(perplexity_change(test, ref)) < max_ppl


def test_gguf_weights_take_a_fifth_of_fp32(quality):
    assert quality["gguf"][1] * 5 <= quality["none"][1]
    info = quality["gguf"][2]
    assert info.quantization == "gguf" and info.weight_bytes == quality["gguf"][1]
    assert "q4i8_linear" in next(iter(info.quant_kernels.values()))


def test_bf16_prefill_on_amx_keeps_quality_and_is_refused_elsewhere(quality):
    """--prefill-bf16: prefill chunks multiply the linears in bf16 (oneDNN on AMX's tiles); the
    teacher-forced score is all prefill, so it measures exactly that rounding. Without AMX the
    start stops with a one-line error naming it."""
    if not cpu_has("amx_bf16"):
        with pytest.raises(ValueError, match="AMX"):
            LLM(quantization="gguf", prefill_bf16=True, kv_cache_memory_bytes=1 << 26)
        return
    llm = LLM(quantization="gguf", prefill_bf16=True, kv_cache_memory_bytes=1 << 28)
    assert all(lin.bf16_min_rows == 64 for lin in llm.engine.executor.runner.model.layers[0].modules()
               if hasattr(lin, "bf16_min_rows"))
    ref = quality["none"][0]
    test = score(llm, llm.get_tokenizer().encode(TEXT)[:2048])
    assert 0.98 <= agreement(test, ref) < 1.0  # bf16 rounding: close, not the same bits
    assert abs(perplexity_change(test, ref)) < 0.01


_OTHER_LEVEL = """
import torch
from tierserve.kernels.native import load_extension
from tierserve.engine.worker.loaders import load_model_source
from tierserve.engine.worker.quant import Int4Weight, Int8GroupWeight, blocks_to_groups
from tierserve.engine.worker.quant import quantize_int8_groups

ops = load_extension()
assert ops is not None, "the extension did not build"
src = load_model_source("smollm2-135m")
gen = torch.Generator().manual_seed(0)
for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.3.self_attn.q_proj.weight"):
    g = blocks_to_groups(src.blocks[name])
    w = g.dequantize()
    panels = ops.pack_linear_weight(w)
    q4 = Int4Weight(g, native=True)
    bias = torch.randn(w.shape[0], generator=gen)
    for m in (1, 2, 3, 5, 64):
        x = torch.randn(m, w.shape[1], generator=gen)
        assert torch.equal(q4(x, ops), ops.packed_linear(x, panels, w.shape[0])), (name, m)
        assert torch.equal(q4(x, ops, bias), ops.packed_linear(x, panels, w.shape[0], bias))
        assert torch.equal(ops.q4_decode(q4.codes, q4.d, q4.z, w.shape[0]), w)
        assert torch.equal(ops.q4_decode(q4.codes, q4.d, q4.z, w.shape[0], True),
                           w.to(torch.bfloat16))
e = Int8GroupWeight(blocks_to_groups(src.blocks["model.embed_tokens.weight"]), native=True)
for q8 in (e, Int8GroupWeight(quantize_int8_groups(w), native=True)):
    rows = q8.rows(torch.arange(q8.out_features))
    head = ops.pack_linear_weight(rows)
    for m in (1, 2, 3, 50):
        x = torch.randn(m, rows.shape[1], generator=gen)
        assert torch.equal(q8(x, ops), ops.packed_linear(x, head, rows.shape[0])), m
print("ok")
"""


@pytest.mark.skipif(not cpu_has("avx512f"), reason="this CPU has no AVX-512: the native build "
                    "is the AVX2 path, which every other test here runs")
def test_the_kernels_avx2_path_gives_the_fp32_bits_too():
    """The AVX2 path (AMD EPYC boxes: no AVX-512), built on an AVX-512 box with -march=haswell in
    a subprocess (a second build of the extension, minutes): 4- and 8-bit products at 1 to 64
    rows equal that build's fp32 panels to the bit, and the weights decode to gguf's values."""
    import subprocess
    import sys

    env = dict(os.environ, TIERSERVE_NATIVE_MARCH="haswell")
    out = subprocess.run([sys.executable, "-c", _OTHER_LEVEL], env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


_EACH_LEVEL = """
import sys

import torch
from tierserve.engine.worker.quant import (GROUP, Int4Groups, Int4Weight, Int8Groups,
                                           Int8GroupWeight)

level, path = sys.argv[1:]
assert torch.backends.cpu.get_cpu_capability() == level.upper(), "the level was not forced"
(codes, scale, offset), (q, d) = torch.load(path)
g, e = Int4Groups(codes.int(), scale, offset), Int8Groups(q.int(), d)
gen = torch.Generator().manual_seed(0)


def kernel_codes(w, cols):
    # the codes torch's kernel multiplies by at input positions `cols`, in every row: one-hot
    # inputs through the kernel with scale 1 and zero 8 (w = q), so no layout is read
    sz = torch.ones_like(w.scales_zeros)
    sz[..., 1] = 8
    x = torch.zeros(len(cols), GROUP * sz.shape[0], dtype=torch.bfloat16)
    x[torch.arange(len(cols)), cols] = 1
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.packed, GROUP, sz).t().int()


def err(y, ref):
    return float((y - ref).norm() / ref.norm())


q4 = Int4Weight(g, readable=True)
assert torch.equal(kernel_codes(q4, torch.arange(g.codes.shape[1])), g.codes)
x = torch.randn(4, g.codes.shape[1], generator=gen)
w = q4.decode()
assert (w - g.dequantize()).abs().max() <= 0.01 * w.abs().max()  # bf16 scales and zeros
assert err(q4(x), x @ w.t()) < 0.01
shuffled = Int4Groups(g.codes.view(-1, GROUP).flip(-1).reshape(g.codes.shape), g.scale, g.offset)
assert err(Int4Weight(shuffled)(x), x @ w.t()) > 0.3

table = Int8GroupWeight(e, readable=True)
n, k = e.q.shape
ids = torch.cat([torch.tensor([0, 1, 15, 16, 31, 32, 63, 64, n - 1]),
                 torch.randint(0, n, (64,), generator=gen)])
bf16 = e.scale.to(torch.bfloat16).float()
assert torch.equal(table.rows(ids), (e.q[ids].float().view(len(ids), -1, GROUP)
                                     * bf16[ids, :, None]).view(len(ids), k))
cols, u = torch.tensor([0, 1, 17, 31, 32, k - 1]), e.q + 128
assert torch.equal(kernel_codes(table.hi, cols), (u >> 4)[:, cols])
assert torch.equal(kernel_codes(table.lo, cols), (u & 15)[:, cols])
hx = torch.randn(3, k, generator=gen)
href = hx @ table.decode().t()
assert err(table(hx), href) < 0.01
flipped = Int8Groups(e.q.view(-1, GROUP).flip(-1).reshape(n, k), e.scale)
assert err(Int8GroupWeight(flipped)(hx), href) > 0.3
print("ok")
"""


@pytest.mark.parametrize("level", ["default", "avx2", "avx512"])
def test_lookups_and_kernels_agree_whichever_layout_torch_packs(source, tmp_path, level):
    """torch packs int4 weights in a layout of its own choosing, which differs by the CPU level
    it runs at (AVX-512, AVX2, default). At each level, forced in a subprocess
    (ATEN_CPU_CAPABILITY; AVX-512 only where this CPU has it): the embedding's lookups equal its
    weights, torch's kernel multiplies by exactly the codes kept beside its packing (read through
    the kernel itself on one-hot inputs, no layout assumed), and a shuffled packing is caught."""
    import subprocess
    import sys

    from tierserve.kernels.native import cpu_has

    if level == "avx512" and not all(cpu_has(f"avx512{f}") for f in ("f", "bw", "vl", "dq")):
        pytest.skip("this CPU has no AVX-512")
    g = blocks_to_groups(source.blocks["model.layers.0.mlp.gate_proj.weight"])
    e = blocks_to_groups(source.blocks["model.embed_tokens.weight"])
    path = tmp_path / "groups.pt"
    torch.save(((g.codes.to(torch.uint8), g.scale, g.offset), (e.q.to(torch.int8), e.scale)),
               path)
    env = dict(os.environ, ATEN_CPU_CAPABILITY=level)
    out = subprocess.run([sys.executable, "-c", _EACH_LEVEL, level, str(path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_cuda_int4_operands_hold_the_groups(source):
    """What the CUDA path hands torch's tinygemm kernel (CUDA's pack itself needs a GPU:
    bench/gpu_check.py --checks runs it): codes two to a byte with the even column in the high
    nibble, and per group (scale, zero) with w = (q - 8) scale + zero, [in / 32, out, 2] bf16.
    Decoded by that rule they give the groups' weights (up to bf16 scales); a swapped nibble
    order or a transposed scale table does not."""
    from tierserve.engine.worker.quant import cuda_int4_operands

    g = blocks_to_groups(source.blocks["model.layers.2.mlp.down_proj.weight"])
    pairs, sz = cuda_int4_operands(g)
    n, k = g.codes.shape
    assert pairs.dtype == torch.uint8 and pairs.shape == (n, k // 2)
    assert sz.dtype == torch.bfloat16 and sz.shape == (k // GROUP, n, 2)

    def decode(pairs, sz):
        q = torch.stack([pairs >> 4, pairs & 15], -1).view(n, k).float()
        scale, zero = sz[..., 0].t().float(), sz[..., 1].t().float()
        return ((q.view(n, -1, GROUP) - 8) * scale[..., None] + zero[..., None]).view(n, k)

    want = g.dequantize()
    got = decode(pairs, sz)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()  # bf16 scales and zeros
    swapped = (pairs << 4) | (pairs >> 4)
    assert (decode(swapped, sz) - want).abs().max() > 0.1 * want.abs().max()

