"""Every backend that runs here against the torch_ref oracle on random paged inputs.

triton runs under TRITON_INTERPRET=1 (set before triton is first imported)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tierserve.kernels import create_backend  # noqa: E402
from tierserve.kernels.bench import make_batch, rel_err, run_backend as run  # noqa: E402
from tierserve.kernels.composite import PhaseSplit  # noqa: E402

HAS_TRITON = __import__("importlib").util.find_spec("triton") is not None


# (heads, kv heads, head dim, block size, seqs): decode only, prefill only, mixed with chunked
# prefill after cached context, GQA groups 1/3/4, head dims 64/96/128 (96 is not a power of 2).
SHAPES = [
    (4, 4, 64, 16, [(1, 1), (1, 17), (1, 40)]),
    (6, 2, 64, 16, [(5, 5), (13, 13)]),
    (8, 2, 96, 8, [(1, 9), (1, 33), (7, 7), (6, 30)]),
    (4, 1, 128, 16, [(1, 64), (20, 50)]),
    (12, 4, 64, 32, [(1, 3), (1, 70), (33, 33), (1, 1)]),
    (9, 3, 64, 16, [(1, 1), (1, 15), (1, 16), (1, 17), (1, 300), (1, 777)]),  # SmolLM2's decode
    # SmolLM2's prefill: whole prompts, chunks after cached tokens, tiles of 16 queries cut short
    (9, 3, 64, 16, [(1, 20), (300, 300), (17, 100), (5, 5), (40, 200), (16, 16), (33, 48)]),
    (16, 2, 128, 32, [(70, 70), (1, 9), (31, 95)]),  # GQA 8, head dim 128, 32-token blocks
]
# (the last row's trailing (1, 1) sits after a prefill: a one-token prompt is a prefill)

HAS_NATIVE = __import__("tierserve.kernels.native", fromlist=["x"]).load_extension() is not None

BACKENDS = (["torch_sdpa", "torch_ref"] + (["cpu_native"] if HAS_NATIVE else [])
            + (["triton"] if HAS_TRITON else []))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}p{s[3]}")
@pytest.mark.parametrize("name", BACKENDS)
def test_matches_torch_ref_fp32(name, shape):
    h, hkv, d, bs, seqs = shape
    if name == "triton":  # interpreted, every program in numpy: prompts of at most 100 new
        seqs = [(min(q, 100), c - q + min(q, 100)) for q, c in seqs]  # tokens (7 query tiles)
    inputs = make_batch(seqs, h, hkv, d, bs)
    ref = run("torch_ref", *inputs)
    assert rel_err(run(name, *inputs), ref) < 1e-5


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_split_decode_matches():
    """Many splits per sequence (as on a GPU with few sequences), including empty trailing ones."""
    q, k, v, cache, layout = make_batch([(1, 5), (1, 130), (1, 64)], 8, 2, 64, 16)
    be = create_backend("triton", 8, 2, 64, 1 / 8)
    be.target_programs = 64
    meta = be.build_metadata(layout)
    assert meta.decode.num_splits > 1
    ref = run("torch_ref", q, k, v, cache, layout)
    assert rel_err(run(be, q, k, v, cache, layout), ref) < 1e-5


@pytest.mark.parametrize("name", [b for b in BACKENDS if b != "cpu_native"])  # fp32 KV only
def test_fp8_kv_matches_torch_ref(name):
    """fp8 caches dequantize on read: every backend agrees with the oracle reading the same
    fp8 bytes (prefill of a fresh prompt in torch_sdpa reads the step's unquantized K/V, so only
    context-reading shapes are compared here)."""
    seqs = [(1, 20), (1, 47), (6, 30)]
    q, k, v, cache, layout = make_batch(seqs, 8, 2, 64, 16, kv_dtype="fp8_e4m3")
    ref = run("torch_ref", q, k, v, cache, layout, kv_scale=0.5)
    assert rel_err(run(name, q, k, v, cache, layout, kv_scale=0.5), ref) < 1e-5


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s[0]}kv{s[1]}d{s[2]}p{s[3]}")
@pytest.mark.skipif(not HAS_NATIVE, reason="native extension not built")
def test_cpu_native_fp16_kv_is_fp32_kv_of_the_rounded_values(shape):
    """cpu_native widens fp16 blocks as it reads them: over an fp16 cache it returns, to the bit,
    what it returns over an fp32 cache holding the same (fp16-rounded) values, in decode and in
    prefill, for compiled shapes and the generic path (block 8, head dim 96)."""
    h, hkv, d, bs, seqs = shape
    q, k, v, cache, layout = make_batch(seqs, h, hkv, d, bs, kv_dtype="float16")
    k16, v16 = k.half().float(), v.half().float()  # the step's own K/V, as the fp16 cache has them
    assert run("cpu_native", q, k16, v16, cache, layout).equal(
        run("cpu_native", q, k16, v16, cache.float(), layout))


@pytest.mark.parametrize("name", BACKENDS)
def test_fp16_kv_matches_torch_ref(name):
    """Every backend over an fp16 cache agrees with the oracle reading the same fp16 values."""
    seqs = [(1, 20), (1, 47), (6, 30), (17, 17)]
    q, k, v, cache, layout = make_batch(seqs, 9, 3, 64, 16, kv_dtype="float16")
    ref = run("torch_ref", q, k.half().float(), v.half().float(), cache.float(), layout)
    assert rel_err(run(name, q, k.half().float(), v.half().float(), cache, layout), ref) < 1e-5


def test_phase_split_dispatches_each_phase():
    """The composite sends decodes to one backend and prefill chunks to the other."""
    q, k, v, cache, layout = make_batch([(1, 9), (1, 33), (7, 7), (6, 30)], 8, 2, 64, 8)
    args = (8, 2, 64, 1 / 8)
    calls = []

    def spy(be):
        fwd = be.forward
        be.forward = lambda q, *a: calls.append((be.name, q.shape[0])) or fwd(q, *a)
        return be
    split = PhaseSplit(prefill=spy(create_backend("torch_ref", *args)),
                       decode=spy(create_backend("torch_sdpa", *args)))
    ref = run("torch_ref", q, k, v, cache, layout)
    assert rel_err(run(split, q, k, v, cache, layout), ref) < 1e-5
    assert calls == [("torch_sdpa", 2), ("torch_ref", 13)]
    assert split.name == "prefill=torch_ref,decode=torch_sdpa"


def test_gpu_check_dry_run(capsys):
    """bench/gpu_check.py's logic on the CPU with tiny shapes (the GPU run is separate)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_check", "bench/gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--device", "cpu", "--tiny"]) == 0
    out = capsys.readouterr().out
    assert "| torch_sdpa | h9/kv3/d64/p16 | mixed | fp8_e4m3 |" in out
    assert "| tiny | greedy agreement routed vs torch_sdpa | 1 |" in out
    assert "| quantization (float32) |" in out and "\n| int4 | 110 | " in out  # issue 31's row
    # issue 43's: a checkpoint loaded by a fresh process, its seconds and peak host memory
    assert "| load (cpu, float32) |" in out and "| random Llama, 2 layers | " in out
